"""Starts one process inside a running `os` sandbox, its privileges dropped before any file of the
sandbox is executed.

Run as root, by path, with the host's Python, standard library only:
    python -I -S sandbox_enter.py PID SECCOMP_FD CWD RLIMITS [NAME=VALUE...] -- COMMAND...
PID: a process inside, whose namespaces and root we take; SECCOMP_FD: an inherited descriptor that
holds the compiled filter (see seccomp_filter); RLIMITS: `AS=bytes,CPU=seconds,...` (resource's
RLIMIT_* names); NAME=VALUE...: the command's whole environment. It runs once per process started
inside, so it imports little: json and signal (through enum) would triple its start-up time.

Why one process and no chain of tools (nsenter, setpriv, prlimit, env): every program run after
entering the sandbox's mount namespace comes from the sandbox's own root, which the agent may
rewrite (it is root there, /usr is a writable overlay). A privileged step taken by such a program
(setpriv after nsenter) would run the agent's code with every capability. Here all the code is
loaded from the host before the first setns, and no module is loaded after it; then:
1. rlimits; setns into the pid namespace of `pid` and fork: the parent stays on the host, waits
   and passes the child's exit on; the child joins the other namespaces and chroots to the root
   of `pid`;
2. the seccomp filter (while we still hold CAP_SYS_ADMIN, so no_new_privs is not needed and set-uid
   programs such as `su` and `passwd` keep working inside);
3. the capability bounding set cut to KEPT_CAPABILITIES, inheritable and ambient sets emptied
   (uid 0 then gets exactly the bounding set at exec);
4. exec COMMAND with SPEC's environment, nothing of ours.
"""
from __future__ import annotations

import _signal  # the signal module's C core
import ctypes
import os
import resource
import sys

# What root inside keeps, by capability number: file ownership and permissions (useradd -m, chown,
# chmod, writing root's files), setuid/setgid (su, useradd), kill (other users' processes), ports
# below 1024 in the sandbox's own network namespace. Docker's default set without MKNOD (host disk
# devices), NET_RAW, SETFCAP, SETPCAP, SYS_CHROOT and AUDIT_WRITE (writes into the host's audit log).
KEPT_CAPABILITIES = {"chown": 0, "dac_override": 1, "fowner": 3, "fsetid": 4, "kill": 5, "setgid": 6,
                     "setuid": 7, "net_bind_service": 10}
# In nsenter's order.
_NAMESPACES = (("cgroup", 0x02000000), ("ipc", 0x08000000), ("uts", 0x04000000), ("net", 0x40000000),
               ("pid", 0x20000000), ("mnt", 0x00020000))
_PR_CAPBSET_DROP, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 24, 22, 2
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _open_namespaces(pid: int) -> tuple[list[tuple[int, int, str]], int]:
    """Descriptors of the namespaces of `pid` that differ from ours, and of its root directory."""
    fds = []
    for name, flag in _NAMESPACES:
        if os.stat(f"/proc/{pid}/ns/{name}").st_ino != os.stat(f"/proc/self/ns/{name}").st_ino:
            fds.append((os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY), flag, name))
    return fds, os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)


def _setns(fd: int, flag: int, name: str) -> None:
    _check(_libc.setns(fd, flag), f"setns {name}")
    os.close(fd)


def _drop_privileges(bpf: bytes, last_cap: int) -> None:
    prog = _SockFprog(len(bpf) // 8, bpf)
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")
    kept = set(KEPT_CAPABILITIES.values())
    for cap in range(last_cap + 1):
        if cap not in kept:
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    mask = sum(1 << cap for cap in kept)
    data = (_CapData * 2)(_CapData(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0), _CapData(mask >> 32, mask >> 32, 0))
    _check(_libc.capset(ctypes.byref(_CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")


def _wait_and_pass_on(child: int) -> None:
    """Exit as the child did (its code, or the same signal), as nsenter does."""
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        _signal.signal(os.WTERMSIG(status), _signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _exec(command: list[str], env: dict[str, str]) -> None:
    """execvpe without os.execvpe, which imports a module (see main)."""
    if "/" in command[0]:
        os.execve(command[0], command, env)
    error: OSError = FileNotFoundError(2, "command not found", command[0])
    for directory in env.get("PATH", "").split(":"):
        try:
            os.execve(f"{directory}/{command[0]}", command, env)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
            error = e
    raise error


def main(pid: int, seccomp_fd: int, cwd: str, rlimits: dict[str, int], env: dict[str, str],
         command: list[str]) -> None:
    bpf = os.pread(seccomp_fd, os.fstat(seccomp_fd).st_size, 0)
    os.close(seccomp_fd)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
    namespaces, root = _open_namespaces(pid)
    # From here on no module may be loaded: inside, the interpreter's own paths name the sandbox's
    # files, which the agent may have written, and we still hold every capability.
    sys.path.clear()
    # Only the pid namespace here (it applies to our children): the parent stays on the host's root.
    for fd, flag, name in [n for n in namespaces if n[2] == "pid"]:
        _setns(fd, flag, name)
    child = os.fork()
    if child:
        _wait_and_pass_on(child)
    for fd, flag, name in [n for n in namespaces if n[2] != "pid"]:
        _setns(fd, flag, name)
    os.fchdir(root)
    os.chroot(".")
    os.close(root)
    os.chdir(cwd)
    _drop_privileges(bpf, last_cap)
    # Python ignores these two at start-up; an ignored signal stays ignored across exec.
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_DFL)
    _exec(command, env)


if __name__ == "__main__":
    end = sys.argv.index("--", 5) if "--" in sys.argv[5:] else len(sys.argv)
    if end + 1 >= len(sys.argv):
        sys.exit("usage: sandbox_enter.py PID SECCOMP_FD CWD RLIMITS [NAME=VALUE...] -- COMMAND...")
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
         {name: int(value) for name, value in (limit.split("=") for limit in sys.argv[4].split(","))},
         dict(entry.split("=", 1) for entry in sys.argv[5:end]), sys.argv[end + 1:])
