"""How the local sandbox confines a process: bubblewrap, `unshare`, or nothing; and a pids cgroup.

Who calls it: mortal.workers.sandbox (LocalExecutor), which asks `select_mode` once per executor
and wraps every command with `Mode.wrap`. What each mode confines, honestly:

    bubblewrap  new user, network, pid, ipc, uts and mount namespaces; the root file system is
                read-only (only /usr, /lib*, /bin, /etc and the interpreter's prefixes are visible;
                the rest of the host, /root and the repository included, is not there at all); a
                private tmpfs /tmp; the execution's temp dir is the only writable host folder; all
                capabilities dropped; uid 65534 inside; dies with its parent.
    unshare     new user (mapped root), network, pid, ipc, uts and mount namespaces (its own /proc):
                no network and no signals to host processes, BUT the file system is the host's
                and writable wherever the worker's user may write (as root: everywhere).
    none        nothing but the rlimits and the timeout; refused unless explicitly allowed.

Process count: RLIMIT_NPROC is ignored by the kernel for uid 0 (also inside a user namespace
mapped to it), so when the worker runs as root a per-execution pids cgroup caps the processes
where the cgroup file system is writable (`ProcessCap`); without one, only the timeout ends a fork
bomb, and the executor says so in its warning. Modes are probed once per process with a real
command, never assumed from the binary being on PATH.
What it must not do: run the untrusted code itself, or weaken a mode silently.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from mortal.workers.errors import FatalWorkerError

log = logging.getLogger("mortal.sandbox")
MODES = ("bubblewrap", "unshare", "none")
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc")
PROBE_SECONDS = 20.0


class SandboxUnavailable(FatalWorkerError):
    """No confinement works here and unconfined execution was not allowed: the run cannot score code."""

    def __init__(self, message: str) -> None:
        super().__init__("SandboxUnavailable", message)


@dataclass(frozen=True)
class Mode:
    """A confinement: how to wrap `argv` so it runs confined with `workdir` as its only writable place."""

    name: str
    confines: str

    def wrap(self, argv: list[str], workdir: str) -> list[str]:
        if self.name == "bubblewrap":
            return [*bwrap_prefix(workdir), *argv]
        if self.name == "unshare":
            return [*UNSHARE_PREFIX, *argv]
        return list(argv)

    @property
    def private_tmp(self) -> bool:
        """True when /tmp inside is a private tmpfs (else the temp dir doubles as TMPDIR)."""
        return self.name == "bubblewrap"


CONFINES = {
    "bubblewrap": "no network, read-only root with only system dirs and the interpreter visible, private /tmp, "
                  "own pid/ipc/uts namespaces, no capabilities",
    "unshare": "no network, own pid/ipc/uts/mount namespaces; the file system is NOT read-only",
    "none": "nothing but rlimits and the timeout",
}
UNSHARE_PREFIX = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
                  "--mount-proc", "--ipc", "--uts", "--"]


def _interpreter_dirs() -> list[str]:
    """The folders the same interpreter needs: venv and base prefixes, and where the binary really is."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  str(Path(os.path.realpath(sys.executable)).parent.parent)}
    dirs = sorted({os.path.realpath(d) for d in candidates} | {os.path.abspath(d) for d in candidates})
    # Keep only outermost folders that the system binds do not already cover.
    kept: list[str] = []
    for d in dirs:
        if any(d == s or d.startswith(s + "/") for s in (*SYSTEM_DIRS, *kept)):
            continue
        kept.append(d)
    return kept


@functools.cache
def _bwrap_has(flag: str) -> bool:
    """Whether this bubblewrap knows `flag` (--disable-userns came with 0.8; older ones still confine)."""
    try:
        out = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout + out.stderr


def bwrap_prefix(workdir: str) -> list[str]:
    args = ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if _bwrap_has("--disable-userns"):  # no nested user namespaces for the code either
        args.append("--disable-userns")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _interpreter_dirs():  # bound at the path Python uses, from where it really is
        args += ["--ro-bind", os.path.realpath(path), path]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, workdir,
             "--remount-ro", "/", "--chdir", workdir]
    return args


# -- probing ---------------------------------------------------------------------------------------
_probed: dict[str, str | None] = {}
_probe_lock = threading.Lock()


def _probe_command(name: str, workdir: str) -> list[str]:
    """This interpreter, confined, printing ok when loopback is its only network interface."""
    check = "import socket; print('ok' if {n for _, n in socket.if_nameindex()} <= {'lo'} else 'network')"
    return Mode(name, "").wrap([sys.executable, "-I", "-c", check], workdir)


def probe(name: str) -> str | None:
    """None when mode `name` runs a confined Python here (the network is gone), else why not. Cached."""
    with _probe_lock:
        if name in _probed:
            return _probed[name]
        binary = {"bubblewrap": "bwrap", "unshare": "unshare"}.get(name)
        reason: str | None = None
        if binary is not None and shutil.which(binary) is None:
            reason = f"{binary} is not on PATH"
        elif binary is not None:
            workdir = Path(os.path.realpath(os.environ.get("TMPDIR", "/tmp"))) / f"mortal-probe-{uuid.uuid4().hex[:8]}"
            workdir.mkdir(parents=True)
            try:
                out = subprocess.run(_probe_command(name, str(workdir)), capture_output=True, text=True,
                                     timeout=PROBE_SECONDS, cwd=workdir, env={"PATH": "/usr/bin:/bin"})
                if out.returncode != 0 or out.stdout.strip() != "ok":
                    reason = f"{binary} failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                reason = f"{binary} failed: {exc}"
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        _probed[name] = reason
        return reason


def select_mode(requested: str = "auto", allow_unconfined: bool = False) -> Mode:
    """The strongest working mode (bubblewrap, then unshare), or the one requested; typed error if none."""
    if requested not in ("auto", *MODES):
        raise ValueError(f"confinement must be auto, {', '.join(MODES)} (got {requested!r})")
    if requested == "none":
        return _unconfined(allow_unconfined, "confinement 'none' was requested")
    tried = [requested] if requested != "auto" else ["bubblewrap", "unshare"]
    reasons = []
    for name in tried:
        reason = probe(name)
        if reason is None:
            if name == "unshare":
                log.warning("sandbox: confining code with `unshare`%s: no network, but the file system is the "
                            "host's and writable%s; install bubblewrap (apt-get install bubblewrap) for a read-only "
                            "root", f" ({reasons[0]})" if reasons else "",
                            " as root, everywhere" if os.geteuid() == 0 else " where this user may write")
            return Mode(name, CONFINES[name])
        reasons.append(f"{name}: {reason}")
    return _unconfined(allow_unconfined, "; ".join(reasons))


def _unconfined(allowed: bool, why: str) -> Mode:
    if not allowed:
        raise SandboxUnavailable(
            f"no sandbox works on this machine ({why}); install bubblewrap (Debian/Ubuntu: apt-get install "
            "bubblewrap) or allow user namespaces for `unshare`, or set allow_unconfined (spec: "
            "rewards[i].args.allow_unconfined: true) to run model-written code WITHOUT confinement"
        )
    log.warning("sandbox: running code UNCONFINED (%s): only rlimits and the timeout apply", why)
    return Mode("none", CONFINES["none"])


# -- process cap (pids cgroup) ---------------------------------------------------------------------
def _pids_cgroup_root() -> Path | None:
    """Our own pids cgroup folder (v1 'pids' hierarchy, or v2 with pids delegated to children)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            return folder if folder.is_dir() else None
    for line in lines:
        if line.startswith("0::"):
            folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            try:
                if "pids" in (folder / "cgroup.subtree_control").read_text().split():
                    return folder
            except OSError:
                return None
    return None


class ProcessCap:
    """A pids cgroup for one execution: at most `limit` processes, all killable at once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs_path = str(folder / "cgroup.procs")

    @classmethod
    def create(cls, limit: int) -> ProcessCap | None:
        root = _pids_cgroup_root()
        if root is None:
            return None
        folder = root / f"mortal-sandbox-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        try:
            folder.mkdir()
            (folder / "pids.max").write_text(str(limit))
        except OSError:  # not root, or a read-only cgroup file system
            if folder.is_dir():
                folder.rmdir()
            return None
        return cls(folder)

    def join_self(self) -> None:
        """Move the calling process in; called between fork and exec (raw syscalls only)."""
        fd = os.open(self.procs_path, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self.procs_path).read_text().split()]
        except OSError:
            return []

    def kill_all(self) -> None:
        kill = self.folder / "cgroup.kill"  # v2 only
        if kill.exists():
            try:
                kill.write_text("1")
                return
            except OSError:
                pass
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)

    def remove(self) -> None:
        self.kill_all()
        for _ in range(100):
            try:
                self.folder.rmdir()
                return
            except OSError:  # a killed process is still being reaped
                threading.Event().wait(0.01)
        log.warning("sandbox: could not remove cgroup %s", self.folder)


_cap_supported: bool | None = None


def process_cap(limit: int) -> ProcessCap | None:
    """A new cap, or None where no pids cgroup can be made (remembered after the first failure)."""
    global _cap_supported
    if _cap_supported is False:
        return None
    cap = ProcessCap.create(limit)
    _cap_supported = cap is not None
    return cap


def processes_capped() -> bool:
    """Whether a confined execution's process count is really capped here (RLIMIT_NPROC or a pids cgroup)."""
    if os.geteuid() != 0:
        return True
    cap = process_cap(4)
    if cap is None:
        return False
    cap.remove()
    return True
