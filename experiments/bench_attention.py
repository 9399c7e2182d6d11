"""The command line of `diffjax.bench.attention` (diffjax/bench/attention.py), whose docstring gives the usage."""

from diffjax import host
from diffjax.bench.attention import main

if __name__ == "__main__":
    host.run_script(main)
