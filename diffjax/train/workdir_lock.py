"""One workdir, one writer: a run holds an advisory `flock` on `<workdir>/.lock` while it trains (the main process
of a multi-process run, for all); the OS drops it however the process ends (docs/design.md §3)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from diffjax import distributed
from diffjax.config import ConfigError

LOCK = ".lock"


@contextlib.contextmanager
def hold(workdir: Path, what: str):
    """Hold `workdir`'s lock for the block; a ConfigError naming the holder if a live process has it."""
    if not distributed.is_main():
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
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": what,
                            "since": datetime.datetime.now().isoformat(timespec="seconds")}))
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"{holder['command']} (process {holder['pid']} on {holder['host']}, since {holder['since']}) holds it"
    except (ValueError, KeyError, TypeError):
        return "another process holds its lock"
