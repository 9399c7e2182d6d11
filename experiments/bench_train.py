"""The training-step benchmark, DIFF against its baseline.

The command line of `diffjax.bench.train` (diffjax/bench/train.py), whose docstring gives the usage."""

import sys

from diffjax import host
from diffjax.bench.train import main

if __name__ == "__main__":
    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    sys.exit(main())
