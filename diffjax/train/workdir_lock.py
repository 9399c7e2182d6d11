"""One workdir, one writer: a run holds an advisory `flock` on `<workdir>/.lock` while it trains (the main process
of a multi-process run, for all); the OS drops it however the process ends (docs/design.md §3).

Where there is no flock (object storage; Lustre mounted without `-o flock`, which answers ENOSYS) the run holds a
lease instead: `<workdir>/.lease/<n>` made by an exclusive create (O_CREAT|O_EXCL; GCS `ifGenerationMatch=0`, S3
`If-None-Match: *`), n one more than the newest lease, so of two runs taking over the same lease one wins. The holder
rewrites its lease every LEASE_S / 4 and marks it released when it ends; a lease not rewritten for LEASE_S (its
holder was killed), or whose holder ran on this host and is gone, no longer blocks. Leases are tiny and never
deleted (deleting one could let a slow contender re-create it)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time

from diffjax import distributed, paths
from diffjax.config import ConfigError

LOCK = ".lock"
LEASES = ".lease"
LEASE_S = 300.0  # a killed holder blocks the run directory this long (hosts' clocks must agree to well within it)
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)  # Lustre without -o flock; some FUSE / BeeGFS mounts


@contextlib.contextmanager
def hold(workdir, what: str):
    """Hold `workdir`'s lock for the block; a ConfigError naming the holder if a live process has it."""
    if not distributed.is_main():
        yield
        return
    workdir = paths.run_dir(workdir)
    if paths.is_remote(workdir):
        with _lease(workdir, what):
            yield
        return
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        f = open(workdir / LOCK, "a+")  # closed by the `with` below
    except OSError as e:  # a read-only file system: the run directory is what to name, not the lock inside it
        if e.errno != errno.EROFS:
            raise
        raise OSError(e.errno, e.strerror, str(workdir)) from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ConfigError(f"{workdir} is in use: {_describe(f.read())}; wait for it to finish, stop it, or use "
                              f"another --workdir") from None
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            flock = False
        else:
            flock = True
        if not flock:
            f.close()
            with _lease(workdir, what):
                yield
            return
        f.seek(0)
        f.truncate()
        f.write(json.dumps(_holder(what)))
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def _holder(what: str) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": what,
            "since": datetime.datetime.now().isoformat(timespec="seconds")}


@contextlib.contextmanager
def _lease(workdir, what: str):
    paths.check_checkpointable(workdir)  # before the lease: a run refused leaves nothing behind
    directory = workdir / LEASES
    paths.makedirs(directory)
    numbers = [int(n) for n in paths.listing(directory) if n.isdigit()]
    if numbers:
        newest = directory / str(max(numbers))
        holder = json.loads(paths.read_fresh(newest))
        age = time.time() - holder["renewed"]
        if not holder.get("released") and age < LEASE_S and not _dead_here(holder):
            raise ConfigError(f"{workdir} is in use: {_describe(json.dumps(holder))}, its lease renewed "
                              f"{age:.0f} s ago; wait for it to finish, stop it, or use another --workdir (a lease "
                              f"not renewed for {LEASE_S:.0f} s is free)")
    mine = directory / str(max(numbers, default=-1) + 1)
    record = _holder(what) | {"renewed": time.time()}
    try:
        paths.create_exclusive(mine, json.dumps(record).encode())
    except FileExistsError:  # another run took the lease between our listing and our create
        raise ConfigError(f"{workdir} is in use: another run took it just now ({mine}); use another "
                          f"--workdir") from None
    except OSError as e:
        raise ConfigError(f"cannot write {workdir}: {e}") from None
    done = threading.Event()

    def renew():  # a run blocked longer than LEASE_S (a long compile) must not lose its lease
        while not done.wait(LEASE_S / 4):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the run itself goes on
                paths.write_text(mine, json.dumps(record | {"renewed": time.time()}))

    renewer = threading.Thread(target=renew, name="diffjax-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        done.set()
        renewer.join()
        with contextlib.suppress(Exception):  # unreleased, it frees itself after LEASE_S
            paths.write_text(mine, json.dumps(record | {"renewed": time.time(), "released": True}))


def _dead_here(holder: dict) -> bool:
    """The holder ran on this host and its process is gone (killed): its lease need not run out."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"{holder['command']} (process {holder['pid']} on {holder['host']}, since {holder['since']}) holds it"
    except (ValueError, KeyError, TypeError):
        return "another process holds its lock"
