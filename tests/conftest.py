"""Test setup: 8 fake CPU devices for sharding tests, set before jax is imported anywhere; a seeded `rng`."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
    """A fresh NumPy generator whose seed is printed (pytest shows it when the test fails); DIFFJAX_TEST_SEED
    replays one."""
    seed = int(os.environ.get("DIFFJAX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed} (replay with DIFFJAX_TEST_SEED={seed})")
    return np.random.default_rng(seed)
