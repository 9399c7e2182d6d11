"""Registers, spills and shared memory of the fused Triton kernels, from a CPU host.

The command line of `diffjax.aot.kernel_resources` (diffjax/aot/kernel_resources.py): its docstring has the usage."""

from diffjax import host
from diffjax.aot.kernel_resources import main

if __name__ == "__main__":
    host.run_script(main)
