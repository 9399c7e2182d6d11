"""Ahead-of-time compilation for accelerator targets on a host without one (`diffjax compile`)."""
