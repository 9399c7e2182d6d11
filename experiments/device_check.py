"""The command line of `diffjax.bench.device_check` (diffjax/bench/device_check.py), whose docstring gives the usage."""

from diffjax import host
from diffjax.bench.device_check import main

if __name__ == "__main__":
    host.run_script(main)
