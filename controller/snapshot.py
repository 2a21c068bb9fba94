"""The run carries its code: what a spec takes from the applying user's folder, copied with the run.

Who calls it: mortal.controller.admission, when `mortalctl apply`, MortalTrainer or a watched folder
applies a run. The modules its `module:attr` references name and the relative files it names that live
in the applying folder are copied, as Ray's runtime_env working_dir does, into
$MORTAL_HOME/runs/<run>/code/<sha256>/, so every worker imports the same code wherever the controller
was started. The digest goes into the run's annotation `mortal.dev/code-snapshot` (an edited reward
makes a re-apply `configured`). Bounded: .git, virtualenvs and caches are skipped, and a snapshot above
MORTAL_CODE_SNAPSHOT_LIMIT_MB is refused naming its largest parts.
What it must not do: import user code (that is the admission probe's, in a child process).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mortal.state import paths
from mortal.state.containment import PathOutside, inside
from mortal.state.errors import NotFound

if TYPE_CHECKING:
    from mortal.specs.training import TrainingSpec
    from mortal.state.store import Store

CODE_ANNOTATION = "mortal.dev/code-snapshot"
LIMIT_ENV = "MORTAL_CODE_SNAPSHOT_LIMIT_MB"
DEFAULT_LIMIT_MB = 64
SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "venv",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        "node_modules",
        ".ipynb_checkpoints",
    }
)
SKIPPED_SUFFIXES = (".pyc", ".pyo")
DIGEST = re.compile(r"^[0-9a-f]{64}$")
INSTALLED_TOP = frozenset({"mortal"})  # mortal's own code is the installed package, never the user's copy
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".jinja")


class SnapshotRefused(ValueError):
    """What the run needs from the folder cannot travel with it; `field` is the spec field to blame."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Part:
    """One thing the run takes from the folder: `rel` is its path there (and in the snapshot)."""

    field: str  # the spec field that needs it, e.g. spec.rewards[0].function
    rel: str
    link: bool = False  # a local model folder or file: linked to where it is, never copied


@dataclass
class Snapshot:
    """A built snapshot, in a temporary folder until `install`; `digest` None: the run needs nothing."""

    folder: Path  # where it was built (the admission probe runs in it)
    parts: list[Part] = field(default_factory=list)
    size: int = 0
    digest: str | None = None
    scratch: Path | None = None  # the temporary folder `close` removes, when not `folder` itself

    @classmethod
    def kept(cls, run: str, digest: str) -> Snapshot | None:
        """The run's installed snapshot `digest`, as a new temporary copy (None if there is none): what a
        document applied again from elsewhere (`get -o yaml | apply -f -`) keeps when that folder has
        none of its code."""
        installed = paths.code_dir(run, digest) if DIGEST.match(digest) else None
        if installed is None or not installed.is_dir():
            return None
        folder = Path(tempfile.mkdtemp(prefix="mortal-code-")) / "kept"
        shutil.copytree(installed, folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        return cls(folder, digest=digest, scratch=folder.parent)

    def install(self, run: str) -> Path | None:
        """Move it to the run's code folder (content-addressed: an identical one already there is kept)."""
        if self.digest is None:
            return None
        final = paths.code_dir(run, self.digest)
        if final.is_dir():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        incoming = final.parent / f".incoming-{uuid.uuid4().hex}"
        shutil.copytree(self.folder, incoming, symlinks=True)
        try:
            os.rename(incoming, final)  # readers see the whole folder or none of it
        except OSError:
            shutil.rmtree(incoming, ignore_errors=True)
            if not final.is_dir():
                raise
        return final

    def close(self) -> None:
        shutil.rmtree(self.scratch or self.folder, ignore_errors=True)


def being_deleted(store: Store, name: str) -> bool:
    """A run of this name is being deleted: its purge will set the run's folder aside, and a snapshot
    installed there before then with it (apply waits, the watched folder leaves it for a later pass)."""
    try:
        return store.get_run(name).deleted_at is not None
    except NotFound:
        return False


def references(spec: TrainingSpec) -> list[tuple[str, str]]:
    """(field, 'module:attr') of every reference to Python code the workers import."""
    refs = [(f"spec.rewards[{i}].function", r.function) for i, r in enumerate(spec.rewards) if r.function]
    refs += [
        (f"spec.rewards[{i}].args.class", str(r.args["class"]))
        for i, r in enumerate(spec.rewards)
        if r.env == "environment" and r.args.get("class")
    ]
    refs += [(f"spec.rollout.tools[{i}]", ref) for i, ref in enumerate(spec.rollout.tools)]
    environment = spec.rollout.environment
    if isinstance(environment, str):
        refs.append(("spec.rollout.environment", environment))
    elif isinstance(environment, dict):
        refs += [(f"spec.rollout.environment.{name}", ref) for name, ref in environment.items()]
    return refs


def local_paths(spec: TrainingSpec) -> list[tuple[str, str]]:
    """(field, path as written) of the spec's names that may be files of the folder."""
    named = [("spec.dataset.name", spec.dataset.name), ("spec.model.name", spec.model.name)]
    template = getattr(spec.rollout, "chat_template", None)
    if template:
        named.append(("spec.rollout.chatTemplate", template))
    return [(f, name) for f, name in named if not name.startswith(("builtin:", "package:", "/", "~"))]


def _module_path(top: str, folder: Path) -> Path | None:
    for candidate in (folder / top, folder / f"{top}.py"):
        if candidate.is_dir() or candidate.is_file():
            return candidate
    return None


def needed_parts(spec: TrainingSpec, folders: list[Path]) -> list[tuple[Part, Path]]:
    """What the run takes from `folders` (the first that has it wins), with where each part is."""
    found: dict[str, tuple[Part, Path]] = {}
    for where, ref in references(spec):
        top = ref.partition(":")[0].split(".")[0]
        if top in INSTALLED_TOP or not top.isidentifier():  # args.class is free text: '' would be the folder
            continue
        for folder in folders:
            path = _module_path(top, folder)
            if path is not None:
                _refuse_links_out(where, folder, path)
                found.setdefault(path.name, (Part(where, path.name), path))
                break
    for where, name in local_paths(spec):
        is_model = where == "spec.model.name"
        for folder in folders[:1]:  # relative file names are the applying folder's (the CLI's working folder)
            path = folder / name
            if not path.exists() or (not is_model and not path.is_file()):
                continue
            rel = os.path.normpath(name)
            if rel.startswith(".." + os.sep) or rel == "..":
                raise SnapshotRefused(
                    where,
                    f"{name!r} is outside the applying folder {folder}; give an "
                    "absolute path, or move it into the folder",
                )
            if not is_model:  # a model folder is linked where it is, never copied
                _refuse_links_out(where, folder, path)
            found.setdefault(rel, (Part(where, rel, link=is_model), path))
    return list(found.values())


def _refuse_links_out(field: str, folder: Path, path: Path) -> None:
    """Every file of `path` the snapshot would copy resolves inside `folder`: a symlink out of it (to a key,
    a home folder) is refused, never followed into a snapshot that travels with the run."""
    for source in _files(path):
        try:
            inside(folder, source)
        except PathOutside:
            raise SnapshotRefused(
                field,
                f"{source.relative_to(folder)} links outside the applying folder "
                f"{folder} (to {os.path.realpath(source)}); copy it into the "
                "folder, or give it by absolute path",
            ) from None


def importing_folders(spec: TrainingSpec, working: Path) -> list[Path]:
    """`working`, then the folders this process imported the spec's user modules from (a MortalTrainer
    script's own folder, on sys.path[0]); installed packages' folders are not the user's to copy."""
    installed = {
        Path(p).resolve()
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    folders = [working]
    for _, ref in references(spec):
        top = ref.partition(":")[0].split(".")[0]
        origin = getattr(sys.modules.get(top), "__file__", None)
        if top in INSTALLED_TOP or not origin:
            continue
        path = Path(origin).resolve()
        root = path.parent.parent if path.name == "__init__.py" else path.parent
        if root not in folders and not any(root == p or root.is_relative_to(p) for p in installed):
            folders.append(root)
    return folders


def limit_bytes() -> int:
    raw = os.environ.get(LIMIT_ENV)
    try:
        return int(float(raw) * 2**20) if raw else DEFAULT_LIMIT_MB * 2**20
    except ValueError:
        raise SnapshotRefused("<environment>", f"{LIMIT_ENV}={raw!r} is not a number of MiB") from None


def _files(path: Path) -> Iterator[Path]:
    """The files of a module, package or data file to copy: no VCS, virtualenv or cache folders."""
    if path.is_file():
        yield path
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if not name.endswith(SKIPPED_SUFFIXES) and (Path(root) / name).is_file():
                yield Path(root) / name


def build(spec: TrainingSpec, folders: list[Path]) -> Snapshot:
    """Copy what the run needs into a new temporary folder and hash it; raises SnapshotRefused."""
    parts = needed_parts(spec, folders)
    limit = limit_bytes()
    listed: list[tuple[Part, Path, list[tuple[str, Path]]]] = []
    total, sizes = 0, {}
    for part, path in parts:
        files = (
            []
            if part.link
            else [
                (os.path.join(part.rel, os.path.relpath(f, path)) if path.is_dir() else part.rel, f)
                for f in _files(path)
            ]
        )
        size = sum(f.stat().st_size for _, f in files)
        sizes[part.rel] = size
        total += size
        listed.append((part, path, files))
    if total > limit:
        largest = ", ".join(
            f"{rel} ({size / 2**20:.1f} MiB)"
            for rel, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
        )
        blamed = max(parts, key=lambda pp: sizes[pp[0].rel])[0].field
        raise SnapshotRefused(
            blamed,
            f"the code and files this run takes from {folders[0]} come to "
            f"{total / 2**20:.1f} MiB, over the snapshot limit of "
            f"{limit / 2**20:.0f} MiB ({LIMIT_ENV}); largest: {largest}. Keep data "
            "and models out of the package your rewards live in, or give them by "
            "absolute path",
        )
    snapshot = Snapshot(Path(tempfile.mkdtemp(prefix="mortal-code-")), [p for p, _ in parts], total)
    digest = hashlib.sha256()
    try:
        for part, path, files in sorted(listed, key=lambda item: item[0].rel):
            if part.link:
                target = str(path.resolve())
                (snapshot.folder / part.rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target, snapshot.folder / part.rel)
                digest.update(f"link\0{part.rel}\0{target}\n".encode())
                continue
            for rel, source in files:
                dest = snapshot.folder / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)
                digest.update(f"file\0{rel}\0{hashlib.sha256(dest.read_bytes()).hexdigest()}\n".encode())
    except BaseException:
        snapshot.close()
        raise
    snapshot.digest = digest.hexdigest() if parts else None
    return snapshot


def archive(run: str, env: Mapping[str, str], home: str | Path) -> bytes | None:
    """The run's snapshot as a gzipped tar, for a worker on a node that does not share this MORTAL_HOME
    (Ray with spec.ray.sharedFilesystem false: it travels with the worker's creation call). Linked model
    folders are left out; None when the run has no snapshot here."""
    digest = env.get(paths.CODE_SNAPSHOT_ENV)
    folder = paths.code_dir(run, digest, home) if digest and DIGEST.match(digest) else None
    if folder is None or not folder.is_dir():
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(folder, arcname=".", filter=lambda info: None if info.issym() or info.islnk() else info)
    return buffer.getvalue()


def unpack(data: bytes, run: str, env: Mapping[str, str], home: str | Path) -> Path | None:
    """On the worker's node: `archive`'s bytes become the run's snapshot under this node's MORTAL_HOME, where
    the worker looks for it (mortal.workers.main); one already there is kept."""
    digest = env.get(paths.CODE_SNAPSHOT_ENV)
    if not digest or not DIGEST.match(digest):
        return None
    final = paths.code_dir(run, digest, home)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    incoming = final.parent / f".incoming-{uuid.uuid4().hex}"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        # "data": no member may leave the folder or be a device (Pythons before 3.11.4 have no filters)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(incoming, filter="data")
        else:
            tar.extractall(incoming)
    try:
        os.rename(incoming, final)
    except OSError:
        shutil.rmtree(incoming, ignore_errors=True)
        if not final.is_dir():
            raise
    return final


def code_environ(annotations: Mapping[str, str]) -> dict[str, str]:
    """The worker variable naming the run's snapshot (none when the run takes nothing from a folder)."""
    digest = annotations.get(CODE_ANNOTATION)
    return {paths.CODE_SNAPSHOT_ENV: digest} if digest else {}
