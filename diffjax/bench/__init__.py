"""Benchmarks and the on-device check, importable: `attention` (the fused kernels against cuDNN and XLA; the DIFF
candidates of a platform), `train` (a training step, DIFF against its baseline), `timing` (interleaved rounds and
per-round ratios), `device_check` (the candidates, the 1.4B step, conformance and a training run on an accelerator
within a time budget: `budget`; its goals and files: `device_report`), `gpu_wheels` (what a GPU machine without a
package registry needs), `env` (where a number was measured). `experiments/` holds their command lines."""
