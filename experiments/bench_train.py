"""The command line of `diffjax.bench.train` (diffjax/bench/train.py), whose docstring gives the usage."""

from diffjax import host
from diffjax.bench.train import main

if __name__ == "__main__":
    host.run_script(main)
