"""The command line of `diffjax.aot.kernel_resources` (registers, spills, shared memory of the Triton kernels)."""

from diffjax import host
from diffjax.aot.kernel_resources import main

if __name__ == "__main__":
    host.run_script(main)
