"""The attention benchmark.

The command line of `diffjax.bench.attention` (diffjax/bench/attention.py), whose docstring gives the usage."""

import sys

from diffjax import host
from diffjax.bench.attention import main

if __name__ == "__main__":
    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    sys.exit(main())
