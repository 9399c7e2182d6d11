"""Evaluation protocols of the paper (DESIGN §6), one file each."""
