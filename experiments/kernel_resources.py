"""Registers, spills and shared memory of the fused Triton kernels, from a CPU host.

The command line of `diffjax.aot.kernel_resources` (diffjax/aot/kernel_resources.py): its docstring has the usage."""

import sys

from diffjax import host
from diffjax.aot.kernel_resources import main

if __name__ == "__main__":
    host.cpu_unless_accelerator()  # JAX on the CPU where no accelerator is, its plugins' start-up lines silenced
    sys.exit(main())
