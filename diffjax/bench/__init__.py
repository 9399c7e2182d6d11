"""Benchmarks and the on-device check, importable: `attention` (the fused kernels against cuDNN and XLA),
`train` (a training step, DIFF against its baseline), `device_check` (conformance and both benchmarks on an
accelerator), `env` (where a number was measured). `experiments/` holds their command lines."""
