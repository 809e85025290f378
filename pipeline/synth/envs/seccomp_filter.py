"""The system-call filter of every process in an `os` sandbox, compiled to seccomp BPF by libseccomp.

An allowlist after Docker's default profile (moby `profiles/seccomp/default.json`): the calls it
allows a container that holds no extra capability, the others refused with EPERM. Refused, among
others: the kernel keyrings (`keyctl`, `add_key`, `request_key`: not namespaced, shared with the
host and every other episode), new namespaces (`unshare`, `setns`, `clone` with a CLONE_NEW* flag:
user namespaces open kernel code written for privileged callers), `mount`/`umount2`/`pivot_root`
and the new mount API, `ptrace` and `process_vm_*`, `bpf`, `perf_event_open`, kernel modules,
`reboot`, `kexec_*`, `userfaultfd`, `open_by_handle_at`, `swapon`/`swapoff`, `syslog`, `acct`, the
clocks, `io_uring_*` (allowed by older Docker profiles; a frequent source of kernel bugs),
`modify_ldt`, `iopl`/`ioperm`, and `socket(AF_VSOCK)`. `clone3` gets ENOSYS, as under Docker: its
flags sit in memory a filter cannot read, and ENOSYS makes the C library fall back to `clone`,
whose flags are checked. Only the machine's native ABI passes: a system call through another one
(x32, or i386 through `int 0x80` on x86_64) kills the process.
"""
from __future__ import annotations

import errno
import os
from functools import lru_cache

import pyseccomp as seccomp

ALLOWED = (
    # files and directories
    "access", "chdir", "chmod", "chown", "close", "close_range", "copy_file_range", "creat", "dup", "dup2", "dup3",
    "faccessat", "faccessat2", "fadvise64", "fallocate", "fchdir", "fchmod", "fchmodat", "fchown", "fchownat",
    "fcntl", "fdatasync", "flock", "fstat", "fstatfs", "fsync", "ftruncate", "futimesat", "getcwd", "getdents",
    "getdents64", "lchown", "link", "linkat", "lseek", "lstat", "mkdir", "mkdirat", "mknod", "mknodat",
    "name_to_handle_at", "newfstatat", "open", "openat", "openat2", "pread64", "preadv", "preadv2", "pwrite64",
    "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv", "rename", "renameat",
    "renameat2", "rmdir", "sendfile", "splice", "stat", "statfs", "statx", "symlink", "symlinkat", "sync",
    "sync_file_range", "syncfs", "tee", "truncate", "umask", "unlink", "unlinkat", "utime", "utimensat",
    "utimes", "vmsplice", "write", "writev",
    # extended attributes, file notifications
    "fgetxattr", "flistxattr", "fremovexattr", "fsetxattr", "getxattr", "lgetxattr", "listxattr", "llistxattr",
    "lremovexattr", "lsetxattr", "removexattr", "setxattr", "fanotify_mark", "inotify_add_watch", "inotify_init",
    "inotify_init1", "inotify_rm_watch",
    # waiting, polling, events, timers, asynchronous I/O
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait",
    "epoll_wait_old", "eventfd", "eventfd2", "futex", "futex_waitv", "get_robust_list", "set_robust_list",
    "nanosleep", "clock_nanosleep", "pause", "poll", "ppoll", "pselect6", "select", "restart_syscall",
    "alarm", "getitimer", "setitimer", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
    "timer_settime", "timerfd_create", "timerfd_gettime", "timerfd_settime", "io_cancel", "io_destroy",
    "io_getevents", "io_pgetevents", "io_setup", "io_submit",
    # memory
    "brk", "madvise", "membarrier", "memfd_create", "memfd_secret", "mincore", "mlock", "mlock2", "mlockall",
    "mmap", "mprotect", "mremap", "msync", "munlock", "munlockall", "munmap", "pkey_alloc", "pkey_free",
    "pkey_mprotect", "remap_file_pages",
    # processes, signals, identity, limits, scheduling
    "arch_prctl", "capget", "capset", "execve", "execveat", "exit", "exit_group", "fork", "vfork", "wait4",
    "waitid", "getpid", "getppid", "gettid", "getpgid", "getpgrp", "getsid", "setpgid", "setsid", "kill",
    "tgkill", "tkill", "pidfd_open", "pidfd_send_signal", "process_mrelease", "prctl", "rseq", "seccomp",
    "set_tid_address", "get_thread_area", "set_thread_area", "rt_sigaction", "rt_sigpending", "rt_sigprocmask",
    "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo", "sigaltstack",
    "signalfd", "signalfd4", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups",
    "getrlimit", "setrlimit", "prlimit64", "getrusage", "getpriority", "setpriority", "ioprio_get",
    "ioprio_set", "sched_getaffinity", "sched_setaffinity", "sched_getattr", "sched_setattr", "sched_getparam",
    "sched_setparam", "sched_getscheduler", "sched_setscheduler", "sched_get_priority_max",
    "sched_get_priority_min", "sched_rr_get_interval", "sched_yield", "getcpu",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
    # clocks (reading), system information
    "clock_getres", "clock_gettime", "gettimeofday", "time", "times", "adjtimex", "clock_adjtime", "sysinfo",
    "uname", "getrandom", "ioctl",
    # sockets (socket itself below), System V and POSIX IPC
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt", "listen", "recvfrom",
    "recvmmsg", "recvmsg", "sendmmsg", "sendmsg", "sendto", "setsockopt", "shutdown", "socketpair", "pipe",
    "pipe2", "msgctl", "msgget", "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop", "shmat", "shmctl",
    "shmdt", "shmget", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink",
)
# clone: only without a new namespace (CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET).
_CLONE_NEW_NAMESPACES = 0x7E020000
_AF_VSOCK = 40
# personality: the values Docker allows (PER_LINUX, PER_LINUX32, UNAME26 with each, and the query).
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)


def _resolve(name: str) -> int | None:
    """The native number of a system call, None where this machine's ABI has no such call."""
    number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
    return number if number >= 0 else None


def build() -> seccomp.SyscallFilter:
    """The filter: refuse with EPERM whatever is not allowed below; kill on a foreign ABI."""
    f = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in ALLOWED:
        number = _resolve(name)
        if number is not None:
            f.add_rule(seccomp.ALLOW, number)
    f.add_rule(seccomp.ALLOW, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_NEW_NAMESPACES, 0))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.NE, _AF_VSOCK))
    for persona in _PERSONALITIES:
        f.add_rule(seccomp.ALLOW, "personality", seccomp.Arg(0, seccomp.EQ, persona))
    return f


@lru_cache(maxsize=1)
def bpf() -> bytes:
    """The compiled filter (a `struct sock_filter` array), as bwrap --seccomp and seccomp(2) take it."""
    fd = os.memfd_create("trajforge-seccomp")
    try:
        build().export_bpf(_Fd(fd))
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def memfd() -> int:
    """A new file descriptor (close-on-exec) holding `bpf()`, at offset 0: bwrap reads it to its end,
    the entry helper with pread."""
    fd = os.memfd_create("trajforge-seccomp")
    os.write(fd, bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Fd:
    """What export_bpf writes to: any object with fileno()."""

    def __init__(self, fd: int):
        self._fd = fd

    def fileno(self) -> int:
        return self._fd
