"""Build the sandbox's file system, then exec the command: a script run by the sandbox, not a module.

    unshare [--user --map-root-user] --mount ... -- python -I -S -c SOURCE jail WORKDIR TMP_BYTES RO_PATHS \
        [UID] -- ARGV...
    bwrap ... --ro-bind WORKDIR /sandbox-in ... -- python -I -S -c SOURCE seed /sandbox-in [UID] -- ARGV...

Who calls it: mortal.workers.rewards.confinement wraps every confined command with it, passing this file's
text as SOURCE (so it runs where the file itself is not visible, as inside bubblewrap). Either way the
code's working directory is a private tmpfs (the one of /tmp when WORKDIR is under /tmp), seeded
with a copy of WORKDIR, which the code sees read-only at /sandbox-in: what the code writes never
reaches the host's disk, and is capped at TMP_BYTES.

`jail` (the "unshare" mode) runs as the mapped root of new user and mount namespaces (as real root
in new ones but the user namespace, when mortal runs as root) and builds what bubblewrap builds: a
fresh root (a tmpfs) holding read-only binds of RO_PATHS (an os.pathsep-joined list; a symlink
stays a symlink), a minimal /dev, the namespace's own /proc, a private tmpfs /tmp of TMP_BYTES and
WORKDIR as above, all in a mount namespace of its own (nothing reaches the host's); it pivots into
that root, detaches the host's, drops every capability (bounding set emptied, no root magic on
exec, no new privileges) and execs ARGV in WORKDIR. Needs Linux >= 5.12 (open_tree, move_mount,
mount_setattr). `seed` (the "bubblewrap" mode, where bwrap built all that) only copies the seed in
and execs ARGV. With UID (given when mortal runs as root, where no user namespace is made: one
would map the code to host root), both give the working directory to UID and become UID (its group
too, no other group) before copying the seed in, so the code is an unprivileged host user. Only
the standard library (-S: no site, no mortal). A failed step exits 125 naming it, so a mode's
probe says why it does not work.
What it must not do: exec ARGV when a step failed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys

# Syscall numbers: the new mount API shares one table on every architecture; pivot_root does not.
NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
NR_OPEN_TREE, NR_MOVE_MOUNT, NR_MOUNT_SETATTR = 428, 429, 442
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 0x2, 0x4, 0x1000, 0x4000
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 0x2, -100, 0x8000
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH = 0x1, 0o2000000, 0x4
MOUNT_ATTR_RDONLY = 0x1
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT = 38, 24, 28, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT | SECBIT_NO_SETUID_FIXUP | SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE, each locked.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
SECBIT_NO_SETUID_FIXUP = 0x04  # left off (locked off) when switching user: setuid must clear the capabilities
CLONE_NEWNS, MS_PRIVATE = 0x00020000, 0x40000
USAGE = "fsjail jail WORKDIR TMP_BYTES RO_PATHS [UID] -- ARGV... | fsjail seed DIR [UID] -- ARGV..."
DEVICES = ("null", "zero", "full", "random", "urandom")
SEED = "/sandbox-in"

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def check(result: int, step: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{step}: {os.strerror(errno)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def clone_tree(path: str) -> int:
    """A detached copy of the mount at `path`, to attach later where the host's view is gone."""
    return check(
        libc.syscall(NR_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC),
        f"open_tree {path}",
    )


def attach(fd: int, target: str) -> None:
    check(
        libc.syscall(NR_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount {target}",
    )


def read_only_tree(path: str) -> None:
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY)
    check(
        libc.syscall(
            NR_MOUNT_SETATTR,
            AT_FDCWD,
            path.encode(),
            AT_RECURSIVE,
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        ),
        f"mount_setattr {path}",
    )


def bind(source: str, target: str) -> None:
    """`source` at `target` inside the new root: a bind of a folder or file, a symlink as a symlink."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)


def build_root(root: str, workdir: str, tmp_bytes: int, ro_paths: list[str]) -> None:
    """1. fresh root  2. read-only binds, /dev, /proc, the seed  3. all read-only  4. /tmp, the workdir
    5. read-only binds of paths under /tmp or the workdir (an interpreter in a venv there)."""
    seed = clone_tree(workdir)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    private = ["/tmp", *([] if workdir.startswith("/tmp/") else [workdir])]  # under /tmp: in its tmpfs
    # e.g. a venv in /tmp
    hidden = [p for p in ro_paths if any(p == f or p.startswith(f + "/") for f in private)]
    for path in ro_paths:
        if path not in hidden and os.path.lexists(path) and not os.path.lexists(root + path):
            bind(path, root + path)
    make_dev(root + "/dev")
    bind("/proc", root + "/proc")
    os.makedirs(root + SEED)
    attach(seed, root + SEED)
    os.close(seed)
    for folder in private:
        os.makedirs(root + folder, exist_ok=True)
    read_only_tree(root)
    for folder in private:
        mount("tmpfs", root + folder, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={tmp_bytes}")
    for path in hidden:  # bound over the private tmpfs, read-only like the rest
        if os.path.lexists(path) and not os.path.lexists(root + path):
            bind(path, root + path)
            if not os.path.islink(path):
                read_only_tree(root + path)
    os.makedirs(root + workdir, exist_ok=True)


def make_dev(dev: str) -> None:
    """A /dev of the harmless devices only, as bubblewrap's --dev."""
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755")
    for name in DEVICES:
        bind("/dev/" + name, f"{dev}/{name}")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    os.symlink("/proc/self/fd", dev + "/fd")


def enter(root: str, workdir: str) -> None:
    """Make `root` the root and forget the host's (pivot_root(".", ".") then detach the old one)."""
    number = NR_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(0, f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(root)
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir(workdir)


def drop_privileges(uid: int | None = None) -> None:
    """No capability now or after exec: empty bounding set, root gets nothing from exec, no new privileges.

    With `uid`: the working directory becomes that user's, then the process becomes that user (and
    group, no supplementary groups), which clears its capabilities: it is then no one special on the host.
    """
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    if uid is not None:
        os.chown(".", uid, uid)
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    securebits = SECUREBITS if uid is None else SECUREBITS & ~SECBIT_NO_SETUID_FIXUP
    check(libc.prctl(PR_SET_SECUREBITS, securebits, 0, 0, 0), "set securebits")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
            raise OSError(0, f"switch to uid {uid}: still {os.getresuid()}")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")


def private_mounts() -> None:
    """A mount namespace of this process's own, nothing shared back: what it mounts stays here."""
    check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def seed(source: str) -> None:
    """The code's files: a copy of the host's temp dir into the private working directory (the cwd)."""
    shutil.copytree(source, ".", symlinks=True, dirs_exist_ok=True)


def jail(workdir: str, tmp_bytes: str, ro_paths: str, uid: str | None = None) -> None:
    if os.getpid() != 1:  # unshare --pid --fork makes it the first process of a new pid namespace
        raise OSError(0, "refusing to build a root outside new namespaces (run it under unshare --pid)")
    if not os.path.isabs(workdir):
        raise OSError(0, f"WORKDIR must be absolute (got {workdir!r})")
    private_mounts()
    root = workdir  # the new root is mounted over the workdir, whose contents `clone_tree` kept
    build_root(root, workdir, int(tmp_bytes), [p for p in ro_paths.split(os.pathsep) if p])
    libc.sethostname(b"sandbox", 7)
    enter(root, workdir)
    drop_privileges(None if uid is None else int(uid))
    seed(SEED)


def seed_as(source: str, uid: str | None = None) -> None:
    """The "bubblewrap" step: as root (no user namespace), become `uid` first; else only copy the seed."""
    if uid is not None:
        drop_privileges(int(uid))
    seed(source)


def main(args: list[str]) -> None:
    try:
        split = args.index("--")
    except ValueError:
        split = len(args)
    step, argv = args[:split], args[split + 1 :]
    steps = {
        ("jail", 4): lambda: jail(*step[1:]),
        ("jail", 5): lambda: jail(*step[1:]),
        ("seed", 2): lambda: seed_as(*step[1:]),
        ("seed", 3): lambda: seed_as(*step[1:]),
    }
    action = steps.get((step[0] if step else "", len(step)))
    if action is None or not argv:
        sys.stderr.write(f"fsjail: usage: {USAGE}\n")
        os._exit(125)
    os.umask(0o022)  # the folders it makes must be passable by the code's user
    try:
        action()
    except OSError as exc:
        sys.stderr.write(f"fsjail: {exc.strerror or exc}\n")
        os._exit(125)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
