"""Builds the root filesystem of one `os` sandbox, then execs bwrap on it.

Run as root, by path (`python -I -S sandbox_root.py DIR TMPFS_BYTES SHM_BYTES -- /usr/bin/bwrap ...`), in
the fresh mount and IPC namespaces that `unshare --mount --ipc` gave it; standard library only. One
process that makes its mounts and files with syscalls: a shell script doing the same runs ~90
programs (0.36 s per episode on a busy 2-core host, against 0.09 s for this script).

What the sandbox sees, all on one tmpfs of TMPFS_BYTES mounted on DIR (the host side of which stays
an empty directory):
- DIR/root, the sandbox's `/`: the empty directories of _EMPTY_DIRS (/root, /home, /tmp, /run,
  /var/tmp, /dev/shm, /opt...), the host's character devices of _DEVICES bound in, a new devpts;
- overlayfs mounts of the host trees of _HOST_TREES (read-only lower layers) whose upper layers are
  DIR/upper/<tree>: the agent may write anywhere (useradd, /etc, /usr/bin), copy-on-write, and
  every byte it writes counts against the tmpfs size;
- in /etc, whatever other users may not read on the host (shadow, gshadow, private keys, database
  auth files...) is whited out; shadow and gshadow are replaced by copies whose password fields are
  locked (useradd, passwd and chpasswd need the files). The checkout we run from is whited out too,
  should it lie inside a visible tree;
- DIR/EMPTY_FILE, an empty read-only file outside the sandbox's root, for bwrap to bind over the
  /proc files it masks.
The IPC namespace's SysV shared memory (shmmax, shmall) is capped at SHM_BYTES.
"""
from __future__ import annotations

import ctypes
import os
import stat
import sys

# The host trees the sandbox sees (a symlink, as /bin -> usr/bin on merged-/usr systems, is copied
# as a symlink): what a shell, coreutils, python3, useradd/su and dpkg queries need. Nothing else.
_HOST_TREES = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "var/lib/dpkg")
# The sandbox's own empty directories, with their usual modes.
_EMPTY_DIRS = (("tmp", 0o1777), ("root", 0o700), ("home", 0o755), ("run", 0o755), ("run/lock", 0o1777),
               ("var", 0o755), ("var/tmp", 0o1777), ("var/log", 0o755), ("var/cache", 0o755),
               ("var/lib", 0o755), ("var/mail", 0o2775), ("var/spool", 0o755), ("var/local", 0o755),
               ("var/opt", 0o755), ("opt", 0o755), ("srv", 0o755), ("mnt", 0o755), ("media", 0o755),
               ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("dev/shm", 0o1777), ("dev/pts", 0o755))
_LINKS = (("var/run", "/run"), ("var/lock", "/run/lock"), ("dev/ptmx", "pts/ptmx"), ("dev/fd", "/proc/self/fd"),
          ("dev/stdin", "/proc/self/fd/0"), ("dev/stdout", "/proc/self/fd/1"), ("dev/stderr", "/proc/self/fd/2"))
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Host files replaced by a copy whose password field is locked.
_LOCKED_COPIES = {"/etc/shadow": "*", "/etc/gshadow": "!"}
EMPTY_FILE = "empty"
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

_MS_NODEV, _MS_BIND = 4, 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str = "") -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or 'bind'} {source} on {target}: {os.strerror(errno)}")


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def hidden_host_entries() -> list[str]:
    """Entries of the visible trees to white out: in /etc, those other users may not read on the
    host; the checkout, if it lies inside a visible tree."""
    hidden, stack = [], ["/etc"]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    continue  # resolved inside the sandbox, to the sandbox's own files
                mode = entry.stat(follow_symlinks=False).st_mode
                if entry.is_dir(follow_symlinks=False):
                    if mode & 0o005 != 0o005:
                        hidden.append(entry.path)
                    else:
                        stack.append(entry.path)
                elif not mode & 0o004:
                    hidden.append(entry.path)
    if any(_inside(_CHECKOUT, os.path.realpath("/" + tree)) for tree in _HOST_TREES):
        hidden.append(_CHECKOUT)
    return sorted(hidden)


def _like(path: str, host: str) -> None:
    """Give `path` the owner and mode of the host entry it stands for in the upper layer."""
    st = os.stat(host)
    os.chown(path, st.st_uid, st.st_gid)
    os.chmod(path, stat.S_IMODE(st.st_mode))


def _locked_copy(host: str, target: str) -> None:
    """`host` (shadow, gshadow) with every password field replaced by a locked one."""
    with open(host) as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    with open(target, "w") as f:
        f.writelines(f"{name}:{_LOCKED_COPIES[host]}:{rest}\n" for name, _password, rest in entries)
    _like(target, host)


def _overlay(base: str, root: str, tree: str, hidden: list[str]) -> None:
    """Mount host /tree at root/tree, copy-on-write into base/upper, `hidden` whited out."""
    host, key = "/" + tree, tree.replace("/", "_")
    upper, work = f"{base}/upper/{key}", f"{base}/work/{key}"
    os.mkdir(upper)
    os.mkdir(work)
    _like(upper, host)
    for path in hidden:
        rel = os.path.relpath(path, host)
        parts = rel.split("/")
        for depth in range(1, len(parts)):  # upper-layer directories that lead to it
            parent = "/".join(parts[:depth])
            if not os.path.lexists(f"{upper}/{parent}"):
                os.mkdir(f"{upper}/{parent}")
                _like(f"{upper}/{parent}", f"{host}/{parent}")
        if path in _LOCKED_COPIES:
            _locked_copy(path, f"{upper}/{rel}")
        else:
            os.mknod(f"{upper}/{rel}", stat.S_IFCHR, os.makedev(0, 0))  # an overlayfs whiteout: no such entry
    os.makedirs(f"{root}/{tree}", exist_ok=True)
    _mount("overlay", f"{root}/{tree}", "overlay", data=f"lowerdir={host},upperdir={upper},workdir={work}")


def build(base: str, tmpfs_bytes: int, shm_bytes: int) -> str:
    """Build the sandbox's root under `base`; returns it."""
    os.umask(0o022)
    # nr_inodes: one per 4 KiB, so that a flood of empty files is bounded too (inodes are kernel
    # memory that `size` does not count).
    inodes = max(tmpfs_bytes // 4096, 4096)
    _mount("trajforge", base, "tmpfs", _MS_NODEV, f"size={tmpfs_bytes},nr_inodes={inodes},mode=755")
    with open("/proc/sys/kernel/shmmax", "w") as f:
        f.write(str(shm_bytes))
    with open("/proc/sys/kernel/shmall", "w") as f:
        f.write(str(max(shm_bytes // os.sysconf("SC_PAGE_SIZE"), 1)))
    root = f"{base}/root"
    for directory in (root, f"{base}/upper", f"{base}/work"):
        os.mkdir(directory)
    os.close(os.open(f"{base}/{EMPTY_FILE}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444))
    for name, mode in _EMPTY_DIRS:
        os.mkdir(f"{root}/{name}")
        os.chmod(f"{root}/{name}", mode)
    hidden = hidden_host_entries()
    for tree in _HOST_TREES:
        host = "/" + tree
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{tree}")
        elif os.path.isdir(host):
            _overlay(base, root, tree, [p for p in hidden if _inside(p, host)])
    for device in _DEVICES:
        if os.path.exists(f"/dev/{device}"):
            open(f"{root}/dev/{device}", "w").close()
            _mount(f"/dev/{device}", f"{root}/dev/{device}", None, _MS_BIND)
    _mount("devpts", f"{root}/dev/pts", "devpts", data="newinstance,ptmxmode=0666,mode=0620,max=64")
    for name, target in _LINKS:
        os.symlink(target, f"{root}/{name}")
    return root


if __name__ == "__main__":
    directory, tmpfs, shm, separator, *command = sys.argv[1:]
    if separator != "--" or not command:
        sys.exit("usage: sandbox_root.py DIR TMPFS_BYTES SHM_BYTES -- /ABSOLUTE/COMMAND ARGS...")
    try:
        build(directory, int(tmpfs), int(shm))
    except OSError as e:
        sys.exit(f"building the sandbox's root failed: {e}")
    # An empty environment: the command (bwrap) becomes the sandbox's pid 1, whose environment
    # anyone inside can read in /proc/1/environ.
    os.execve(command[0], command, {})
