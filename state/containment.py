"""Keep every path mortal deletes, copies or loads inside what its run owns.

Paths read back from the store are data, not orders: a checkpoint or weights row could point anywhere
(a row written by hand, a compromised client of the HTTP store, a run name from before the store
checked names). Before mortal removes, copies or loads one, it asks here, with the root that owns it:

    inside(paths.checkpoints_dir(run), row.path)        -> the resolved Path, or PathOutside
    owned_checkpoint(run, row.path, spec_uri)           -> the same for a checkpoint row (folder or URL)

A folder is resolved first (os.path.realpath: `..` and every symlink followed, the root's own included),
so a symlink inside the run's folder that points out is refused too; it must then lie strictly below its
root (never the root itself: removing the root would take every sibling with it). A URL in remote
storage (spec.checkpoint.uri: s3://, gs://, ...) cannot be resolved from here: its path is normalized
(`..` and `.` segments, repeated '/') and must start with the run's prefix `<uri>/<run>/`.
Callers turn PathOutside into a Warning event on the run and leave the path alone.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from mortal.state import paths
from mortal.state.store import Store

URL_SEPARATOR = "://"
REFUSED_REASON = "PathOutside"  # the reason of the Warning event report_refused writes


class PathOutside(ValueError):
    """A path read from the store (or built from a stored name) lies outside the folder or URL prefix that
    owns it, once resolved: it is refused, never followed."""

    def __init__(self, path: str | Path, root: str | Path, why: str = "") -> None:
        self.path, self.root = str(path), str(root)
        super().__init__(
            f"{self.path} is not inside {self.root}{why}; refused (mortal touches only what the run owns)"
        )


def inside(root: str | Path, candidate: str | Path) -> Path:
    """`candidate` (absolute, or relative to `root`) resolved, when it lies strictly below `root` resolved;
    PathOutside otherwise. Neither needs to exist (a missing tail is resolved lexically)."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(Path(root) / candidate))
    if real == real_root or not real.is_relative_to(real_root):
        raise PathOutside(
            candidate, real_root, f" (it resolves to {real})" if str(real) != str(candidate) else ""
        )
    return real


def tree_inside(root: str | Path, folder: str | Path) -> Path:
    """`folder` checked with `inside`, and every symlink below it too: a copy or a load follows links, so a
    checkpoint holding `model.safetensors -> /etc/shadow` is refused whole. Returns `folder` resolved."""
    real = inside(root, folder)
    for parent, dirs, files in os.walk(real):
        for name in (*dirs, *files):
            if os.path.islink(os.path.join(parent, name)):
                inside(root, os.path.join(parent, name))
    return real


def report_refused(store: Store, run: str, doing: str, refused: PathOutside) -> None:
    """The Warning event on the run that says a stored path was refused (the one reason every caller uses)."""
    store.add_event(run, "Warning", REFUSED_REASON, f"{doing}: {refused}")


def _normalized_url(url: str) -> tuple[str, str]:
    """(protocol, normalized path) of a storage URL: lowercase protocol, `.`/`..` and repeated '/' folded."""
    protocol, _, rest = url.partition(URL_SEPARATOR)
    return protocol.lower(), posixpath.normpath("/" + rest.lstrip("/"))


def posix_inside(root: str, candidate: str) -> str:
    """`candidate` normalized, when it lies strictly below `root` normalized (posix paths on storage this
    machine cannot resolve: a Modal volume, an object store's keys); PathOutside otherwise."""
    path, root_path = (
        posixpath.normpath("/" + candidate.lstrip("/")),
        posixpath.normpath("/" + root.lstrip("/")),
    )
    if not path.startswith(root_path.rstrip("/") + "/"):
        raise PathOutside(candidate, root)
    return path.removeprefix("/") if not candidate.startswith("/") else path


def url_inside(root: str, candidate: str) -> str:
    """`candidate` when, normalized, it lies strictly below the URL `root` (same protocol, a path under
    root's path); PathOutside otherwise. For storage this machine cannot resolve (object stores)."""
    protocol, path = _normalized_url(candidate)
    root_protocol, root_path = _normalized_url(root)
    if URL_SEPARATOR not in candidate or protocol != root_protocol:
        raise PathOutside(candidate, root)
    try:
        posix_inside(root_path, path)
    except PathOutside:
        raise PathOutside(candidate, root) from None
    return candidate


def _local_folder(url: str) -> Path | None:
    """The folder of a file:// URL, which is resolved as a folder; None for remote storage."""
    protocol, path = _normalized_url(url)
    return Path(path) if protocol in ("file", "local") else None


def owned_checkpoint(run: str, path: str, uri: str | None = None) -> str:
    """A checkpoint row's path, checked: a folder strictly inside the run's checkpoints folder under this
    machine's MORTAL_HOME (returned resolved), a file:// URL whose folder is there or under `<uri>/<run>/`,
    or a remote URL under `<uri>/<run>/` (spec.checkpoint.uri). PathOutside otherwise, naming the root."""
    own = paths.checkpoints_dir(run)
    if URL_SEPARATOR not in path:
        return str(inside(own, path))
    local = _local_folder(path)
    if local is not None:  # a mounted filesystem: resolved, its symlinks followed too
        local_root = _local_folder(uri) if uri is not None else None
        try:
            inside(own, local)
        except PathOutside:
            if local_root is None:
                raise
            inside(local_root / run, local)
        return path
    if uri is None:
        raise PathOutside(path, own, " (a URL, and the run's spec.checkpoint.uri is not set)")
    return url_inside(f"{uri.rstrip('/')}/{run}", path)
