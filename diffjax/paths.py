"""Run directories on a local filesystem or on object storage (`gs://`, `s3://`): the one place that turns a --workdir
into a path object. Local paths stay `pathlib.Path`; a URL becomes an `etils.epath.Path` (what Orbax uses; its
fsspec backend reaches the bucket through gcsfs / s3fs with the Google / AWS libraries' own credentials). Objects
cannot be appended to or renamed in place, so what a run appends to (metrics.jsonl, TensorBoard events) is written
in a local staging directory and uploaded whole (`train/metrics.py`) (docs/multihost.md, "Object storage")."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

from diffjax.config import ConfigError

REMOTE = ("gs://", "s3://")  # s3://: the small files only (check_checkpointable)


def is_remote(path) -> bool:
    return path is not None and os.fspath(path).startswith(REMOTE)


def run_dir(path):
    """`path` (a str, pathlib.Path or epath.Path) as a path object: a URL never goes through pathlib, which would
    collapse `gs://b` into a local `gs:/b`."""
    text = os.fspath(path)
    if is_remote(text):
        from etils import epath  # Orbax's own dependency

        return epath.Path(text)
    return Path(text)


def absolute(path):
    """A local path made absolute (what config.json and Orbax record); a URL is absolute already."""
    path = run_dir(path)
    return path if is_remote(path) else path.absolute()


def resolved(path):
    path = run_dir(path)
    return path if is_remote(path) else path.resolve()


def filesystem(path):
    """The fsspec filesystem behind a URL (gcsfs, s3fs): the very instance epath uses, so that one cache is kept."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(os.fspath(path))


def refresh(path) -> None:
    """Forget the listings fsspec cached for a URL: another process (the run being trained) may have written since
    this one listed (an evaluation in a notebook, a resume), and fsspec answers `exists` from a parent's cached
    listing. Nothing for a local path."""
    if is_remote(path):
        filesystem(path).invalidate_cache()


def makedirs(path) -> None:
    """A local directory; nothing on object storage (no directories there: a prefix exists once an object does, and
    fsspec's mkdir could create a bucket)."""
    if not is_remote(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def write_text(path, text: str) -> None:
    """Replace the file whole, atomically (readers, other processes, never see part of it): a local temporary file
    renamed over it; on object storage a single upload is atomic already."""
    path = run_dir(path)
    if is_remote(path):
        path.write_text(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save_figure(fig, path, **savefig) -> None:
    """A matplotlib figure at `path` (its format from the suffix, as matplotlib takes it), local or remote."""
    if not is_remote(path):
        fig.savefig(path, **savefig)
        return
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(os.fspath(path))[1][1:] or "png", **savefig)
    run_dir(path).write_bytes(buf.getvalue())


def create_exclusive(path, data: bytes) -> None:
    """Create `path` holding `data` unless it exists (FileExistsError): O_CREAT|O_EXCL locally; on object storage a
    conditional create (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`, as gcsfs / s3fs send for mode "create")."""
    if is_remote(path):
        filesystem(path).pipe_file(os.fspath(path), data, mode="create")
        refresh(path)
        return
    with open(path, "xb") as f:
        f.write(data)


def listing(path) -> list[str]:
    """Names in directory `path` (none if it does not exist), listed afresh: another process may have just written."""
    if is_remote(path):
        refresh(path)
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in filesystem(path).ls(os.fspath(path), detail=False))
        except FileNotFoundError:
            return []
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def read_fresh(path) -> bytes:
    if is_remote(path):
        refresh(path)
        return filesystem(path).cat_file(os.fspath(path))
    return Path(path).read_bytes()


def move_tree(src, dst) -> None:
    """Move a directory whole (a damaged checkpoint set aside); on object storage fsspec copies then deletes."""
    if is_remote(src):
        filesystem(src).mv(os.fspath(src), os.fspath(dst), recursive=True)
        return
    Path(dst).parent.mkdir(exist_ok=True)
    shutil.move(src, dst)


def check_checkpointable(path) -> None:
    """Orbax 0.12 writes arrays to object storage through TensorStore's GCS driver only: an s3:// directory reaches it
    normalized to the local path `s3:/…` (its `_normalize_path` restores `gs://` alone), so it is refused here."""
    if os.fspath(path).startswith("s3://"):
        raise ConfigError(f"{os.fspath(path)}: Orbax, which writes the checkpoints, reaches gs:// buckets but not "
                          f"s3:// ones; use gs://, or a local or shared filesystem (synced to S3 with aws s3 sync)")


def check_reachable(url: str) -> None:
    """A ConfigError in one line when `url`'s bucket cannot be listed (missing, no permission, no network), before
    anything is written anywhere; nothing for a local path."""
    if not is_remote(url):
        return
    check_checkpointable(url)
    scheme, rest = os.fspath(url).split("://", 1)
    bucket = rest.split("/", 1)[0]
    if not bucket or rest.rstrip("/") == bucket:
        raise ConfigError(f"{url}: name a directory inside the bucket, e.g. {scheme}://{bucket or 'BUCKET'}/runs/NAME")
    try:
        fs = filesystem(url)
        fs.ls(f"{bucket}", detail=False)
        fs.invalidate_cache()  # a cached listing of the bucket would hide the objects other processes write later
    except FileNotFoundError:
        raise ConfigError(f"{url}: bucket {bucket!r} does not exist (or these credentials cannot see it)") from None
    except ImportError as e:
        raise ConfigError(f"{url}: {e.name or 'gcsfs'} is not installed (pip install -e '.[cloud]')") from None
    except Exception as e:  # noqa: BLE001 — the libraries' errors (auth, HTTP, connection) are no one type
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(f"cannot reach {url}: {type(e).__name__}: {reason}") from None
