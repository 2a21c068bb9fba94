"""Checkpoints in storage at a URL (spec.checkpoint.uri): upload, completion, download, removal, via fsspec.

Called by mortal.workers.actor.checkpoint (`Checkpointer`, when the spec names a URI) and, to probe the URL
before the first step, by mortal.workers.actor. Layout, next to the local copy under MORTAL_HOME:

    <uri>/<run>/step-<N>/   the checkpoint folder's files, as mortal.workers.actor.checkpoint writes them
                            mortal.json, uploaded last: the completion marker

Object stores (s3, gs, az) have no atomic rename of a folder, so a checkpoint cannot appear whole there
the way `atomic_dir` makes one appear on a disk. Instead: every other file is uploaded first, the
marker (mortal.json) last, and only then does the caller record the checkpoint's row in the store. A
reader trusts a remote checkpoint only when it has a row (the store is the truth) *and* a marker (its
files are all there), so a writer that died mid-upload left nothing a reader uses; the next upload of
that step starts by removing what it left. Pruning deletes the row first, then the files.
A download goes through `atomic_dir`, so a node's local copy too appears whole or not at all.
What it must not do: decide when to write or which checkpoint is current (the store and the
Checkpointer do), or know what the files are beyond the marker's name.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mortal.state.containment import url_inside
from mortal.workers.atomic import atomic_dir

URI_FIELD = "spec.checkpoint.uri"
MARKER = "mortal.json"  # mortal.workers.actor.checkpoint.MORTAL_FILE (that module imports this one)


class StorageError(Exception):
    """The checkpoint storage cannot be used as the spec says (unknown protocol, its package missing, no
    permission to write, unreachable); the message names spec.checkpoint.uri and says the fix."""


def is_url(path: str | Path) -> bool:
    """A checkpoint row's path that is a storage URL rather than a folder on this machine."""
    return "://" in str(path)


def local_path(path: str | Path) -> Path | None:
    """The folder on this machine a row's path stands for: itself, or a file:// URL's path; None for
    remote storage (s3://, gs://, ...), which only a download reaches."""
    text = str(path)
    if not is_url(text):
        return Path(text)
    protocol, _, rest = text.partition("://")
    return Path("/" + rest.lstrip("/")) if protocol in ("file", "local") else None


def open_filesystem(uri: str) -> tuple[Any, str]:
    """fsspec's filesystem for `uri` and the path inside it; StorageError (naming the field) when the
    protocol is unknown or its package is not installed here."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except ImportError as exc:  # fsspec knows the protocol, its package (s3fs, gcsfs, adlfs) is missing
        raise StorageError(
            f"{URI_FIELD} {uri!r}: this machine lacks the package of that storage: {exc}"
        ) from exc
    except ValueError as exc:  # "Protocol not known"
        raise StorageError(
            f"{URI_FIELD} {uri!r}: {exc}; use a protocol fsspec knows (s3, gs, az, file, ...)"
        ) from exc
    return fs, root


@dataclass
class CheckpointStorage:
    """One run's checkpoints under `<uri>/<run>/`."""

    uri: str
    run: str

    def __post_init__(self) -> None:
        self.uri = self.uri.rstrip("/")
        self.fs, root = open_filesystem(self.uri)
        self.root = posixpath.join(root, self.run)

    def url(self, step: int) -> str:
        """The URL a row records for the checkpoint of `step` (what every node reads)."""
        return f"{self.uri}/{self.run}/step-{step}"

    def _path(self, url: str) -> str:
        """The filesystem path of one of this run's checkpoint URLs: normalized, strictly below the run's
        prefix (mortal.state.containment.url_inside: a stored `<prefix>/../other` is refused, not
        followed)."""
        prefix = f"{self.uri}/{self.run}/"
        if not url.startswith(prefix):
            raise StorageError(
                f"{url!r} is not a checkpoint of run {self.run!r} under {URI_FIELD} {self.uri!r} "
                "(the spec's storage changed since it was written?)"
            )
        url_inside(prefix, url)  # PathOutside
        return posixpath.join(self.root, posixpath.normpath(url[len(prefix) :]))

    def owns(self, url: str) -> str:
        """`url`, when it is one of this run's checkpoints in this storage (StorageError under another prefix,
        PathOutside when it leaves the run's)."""
        self._path(url)
        return url

    def probe(self) -> None:
        """Write, read back and remove a small file under the run's prefix, so a URL that cannot be written
        fails the run before its first step instead of at its first checkpoint (StorageError)."""
        probe = posixpath.join(self.root, f".probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"mortal")
            if self.fs.cat_file(probe) != b"mortal":
                raise OSError("the file read back differs from the one written")
            self.fs.rm_file(probe)
        except (OSError, ValueError, NotImplementedError) as exc:  # fsspec maps denials to PermissionError
            raise StorageError(
                f"{URI_FIELD} {self.uri!r}: cannot write under {self.uri}/{self.run}/: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def upload(self, folder: Path, step: int) -> str:
        """Copy a complete local checkpoint folder to `url(step)`: what an earlier, unfinished upload of that
        step left is removed first, every file but the marker is copied, then the marker. Returns the URL
        (record it only after this returns)."""
        dest = self._path(self.url(step))
        self._remove(dest)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        marker = folder / MARKER
        if marker not in files:
            raise StorageError(f"{folder} has no {MARKER}: not a complete checkpoint, nothing uploaded")
        try:
            for path in [*(p for p in files if p != marker), marker]:
                target = posixpath.join(dest, path.relative_to(folder).as_posix())
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
                self.fs.put_file(str(path), target)
        except OSError as exc:
            raise StorageError(
                f"{URI_FIELD}: uploading step {step} to {self.url(step)} failed: {exc}"
            ) from exc
        return self.url(step)

    def complete(self, url: str) -> bool:
        """The marker is there: every file of the checkpoint was uploaded before it. (Asked of the storage
        itself: object-store filesystems cache listings, and another node may have uploaded since.)"""
        marker = posixpath.join(self._path(url), MARKER)
        self.fs.invalidate_cache(posixpath.dirname(marker))
        return bool(self.fs.exists(marker))

    def download(self, url: str, dest: Path) -> Path:
        """Copy the checkpoint at `url` into `dest` (a folder on this node), whole or not at all."""
        source = self._path(url)
        with atomic_dir(dest) as tmp:
            for remote in sorted(self.fs.find(source)):
                relative = posixpath.relpath(remote, source)
                (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(remote, str(tmp / relative))
        return dest

    def remove(self, url: str) -> None:
        """Delete a checkpoint's files (after its row: readers stop choosing it first)."""
        self._remove(self._path(url))

    def _remove(self, path: str) -> None:
        self.fs.invalidate_cache(path)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
