"""AgentBench-style OS environment: a persistent bash in a disposable, offline sandbox.

Model-issued commands only ever run inside the sandbox; when it cannot be built, `reset` raises
`SandboxUnavailable` instead of running anything on the host.

The sandbox (one per episode), built from stock tools, needs root (as in CI):
- a pids cgroup (v1 `pids` hierarchy, or v2 with `pids` delegated at its root) bounds the number
  of processes of everything below; RLIMIT_NPROC cannot, because the kernel exempts uid 0; a
  memory cgroup (v1 `memory` hierarchy, or v2 `memory.max`) bounds the episode's memory, tmpfs
  pages included; without either, `reset` refuses;
- `unshare --mount --ipc` gives private mount and IPC namespaces where `sandbox_root` builds the
  root on one size-limited tmpfs: the sandbox's own empty /root, /home, /tmp, /run, /var/tmp,
  /dev/shm..., and copy-on-write overlays of an allowlist of host system trees (/usr, /etc, /bin,
  /sbin, /lib*, /var/lib/dpkg) with /etc's secrets whited out. The agent may write anywhere
  (useradd, /etc), the host never sees it, every byte counts against `disk_bytes`, and the mounts
  vanish with the namespace's last process. Nothing else of the host is there;
- `bwrap` binds that tree as `/` with a fresh /proc (its kernel settings read-only, its kernel
  memory, keys and timer entries masked: _PROC_READ_ONLY, _PROC_MASKED), and new pid, net
  (loopback only, down), uts and cgroup namespaces; its pid 1 and a `sleep infinity` are the
  anchor of the sandbox and die with us (--die-with-parent); it starts with an empty environment
  in `/`, so /proc/1 inside shows nothing of the host's;
- every process we start inside (init scripts, the agent's shell, check scripts) goes in through
  `sandbox_enter`, one host-side Python process that joins the namespaces and the root, installs
  the seccomp filter of `seccomp_filter` (a Docker-like allowlist: no keyrings, no new
  namespaces, no mount, ptrace, bpf, modules...), keeps only a few capabilities (no CAP_SYS_ADMIN,
  MKNOD, DAC_READ_SEARCH, NET_ADMIN, PTRACE...), sets CPU-time, address-space and file-size
  limits, and execs the command with a fixed environment: no sandbox program ever runs with more.
`close` kills every process of the cgroup, which also ends the namespaces and their mounts, then
removes the cgroup and the temporary directory.

Upstream semantics kept: `create.init` scripts run as separate non-interactive processes before
the episode (non-zero exit = task error), `start` runs inside the agent's shell (its cd, variables,
background jobs and `su - user` persist), observations have ANSI escapes removed and are cut at 800
characters (first 780 + "\\n[truncated because the output is too long]"), check scripts run as
root in the same sandbox after the episode, `bash -c CODE -- params...` / `python3 -c CODE
params...`, each passing check appending its stdout to params.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

from trajforge.pipeline.envs.os import os_match, parse_os_action, task_prompt
from trajforge.pipeline.envs.tasks import Task, coerce_task
from trajforge.pipeline.synth.envs import sandbox_enter, sandbox_root
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, EnvFailure, StepResult

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
TRUNCATION_NOTE = "\n[truncated because the output is too long]"

# Parts of /proc, after the OCI runtime spec's lists as Docker and runc apply them. Read-only: the
# kernel settings, which are the host's (a writable kernel.core_pattern runs any program as host
# root). Masked: kernel memory, other tenants' keys, timer and scheduler details, hardware.
_PROC_READ_ONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")
_PROC_MASKED = ("asound", "acpi", "interrupts", "kcore", "keys", "latency_stats", "timer_list", "timer_stats",
                "sched_debug", "scsi")
_SANDBOX_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "USER=root",
                "LOGNAME=root", "SHELL=/bin/bash", "TERM=dumb", "LANG=C.UTF-8"]
_TOOLS = ("bwrap", "unshare")

class SandboxUnavailable(EnvFailure):
    """The sandbox cannot be built here; nothing was run on the host."""


class TaskSetupError(EnvFailure):
    """An init/start script failed (upstream aborts the task as an error)."""


class TaskNotRunnable(EnvFailure, ValueError):
    """The task is marked as not runnable here (Task.skip_reason)."""


@dataclass
class SandboxConfig:
    step_timeout: float = 30.0      # one agent command; then Ctrl-C, then the episode ends
    setup_timeout: float = 60.0     # each init script and the start script
    check_timeout: float = 30.0     # each check script
    memory_bytes: int = 1 << 30     # RLIMIT_AS of every process (upstream container: 1 GiB)
    cpu_seconds: int = 120          # RLIMIT_CPU of every process
    max_processes: int = 256        # pids.max of the whole sandbox
    file_bytes: int = 256 << 20     # RLIMIT_FSIZE
    disk_bytes: int = 512 << 20     # everything the sandbox writes: its tmpfs + SysV shared memory
    output_bytes: int = 1 << 20     # output kept per command (head + the tail); the rest is dropped
    observation_chars: int = 800    # upstream cut

    @property
    def shm_bytes(self) -> int:
        """SysV shared memory of the sandbox's IPC namespace (shmmax, shmall); the tmpfs gets the rest."""
        return self.disk_bytes // 8

    @property
    def episode_memory_bytes(self) -> int:
        """The memory cgroup's limit: one process at its RLIMIT_AS plus everything written to memory."""
        return self.memory_bytes + self.disk_bytes


# --- cgroup ------------------------------------------------------------------------------------
def cgroup_roots(mountinfo: str) -> dict[str, tuple[Path, int]]:
    """{controller: (mount point, version)} for `pids` and `memory`, from /proc/self/mountinfo's
    text: where we may create a child cgroup that has this controller. v1 hierarchies win (on a
    hybrid host the v2 tree has none of the controllers that v1 holds)."""
    found: dict[str, tuple[Path, int]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        mountpoint, (fstype, _source, superopts) = Path(left.split()[4]), right.split()[:3]
        if not os.access(mountpoint, os.W_OK):
            continue
        if fstype == "cgroup":
            for controller in {"pids", "memory"} & set(superopts.split(",")):
                found[controller] = (mountpoint, 1)
        elif fstype == "cgroup2":
            try:
                enabled = set((mountpoint / "cgroup.subtree_control").read_text().split())
            except OSError:
                continue
            for controller in {"pids", "memory"} & enabled:
                found.setdefault(controller, (mountpoint, 2))
    return found


@lru_cache(maxsize=1)
def _cgroup_roots() -> dict[str, tuple[Path, int]]:
    try:
        return cgroup_roots(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return {}


class _Cgroup:
    """The episode's cgroup(s): one directory on v2, one per controller on v1."""

    def __init__(self, name: str, config: SandboxConfig, roots: dict[str, tuple[Path, int]]):
        if "pids" not in roots:
            raise SandboxUnavailable("no writable pids cgroup: the process count could not be bounded")
        if "memory" not in roots:
            raise SandboxUnavailable("no writable memory cgroup (v1 `memory` hierarchy, or v2 with `memory` "
                                     "enabled): the episode's memory could not be bounded")
        self.paths: list[Path] = []
        try:
            self._create(name, config, roots)
        except BaseException:
            self.destroy()
            raise

    def _create(self, name: str, config: SandboxConfig, roots: dict[str, tuple[Path, int]]) -> None:
        for controller in ("pids", "memory"):
            path = roots[controller][0] / name
            if path not in self.paths:
                path.mkdir()
                self.paths.append(path)
        self.pids_dir, self.memory_dir = roots["pids"][0] / name, roots["memory"][0] / name
        (self.pids_dir / "pids.max").write_text(str(config.max_processes))
        limit = str(config.episode_memory_bytes)
        if roots["memory"][1] == 1:
            (self.memory_dir / "memory.limit_in_bytes").write_text(limit)
            self._peak_file = self.memory_dir / "memory.max_usage_in_bytes"
            swap_file = self.memory_dir / "memory.memsw.limit_in_bytes"  # memory + swap: no swap beyond
        else:
            (self.memory_dir / "memory.max").write_text(limit)
            self._peak_file = self.memory_dir / "memory.peak"
            swap_file, limit = self.memory_dir / "memory.swap.max", "0"
        if swap_file.exists():
            swap_file.write_text(limit)

    def wrap(self, argv: list[str]) -> list[str]:
        """Join the cgroup(s) before exec, so that everything the command forks is counted."""
        procs = [str(path / "cgroup.procs") for path in self.paths]
        joins = " && ".join(f'echo $$ > "${i}"' for i in range(len(procs)))
        return ["sh", "-c", f'{joins} && shift {len(procs) - 1} && exec "$@"', *procs, *argv]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            try:
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(found)

    def current(self) -> int:
        return int((self.pids_dir / "pids.current").read_text())

    def memory_peak(self) -> int | None:
        try:
            return int(self._peak_file.read_text())
        except (OSError, ValueError):
            return None  # v2 before Linux 5.19 has no memory.peak

    def destroy(self) -> None:
        deadline = time.monotonic() + 10
        while self.paths and time.monotonic() < deadline:
            for path in self.paths:
                kill_file = path / "cgroup.kill"
                if kill_file.exists():
                    kill_file.write_text("1")
            # Repeat: a fork bomb may fork between our read and our kill (pids.max bounds it).
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for path in list(self.paths):
                try:
                    if path.exists():
                        path.rmdir()
                    self.paths.remove(path)
                except OSError:
                    pass
            if self.paths:
                time.sleep(0.02)
        if self.paths:
            raise RuntimeError(f"could not remove cgroup {self.paths}: processes left {self.pids()}")


# --- sandbox -----------------------------------------------------------------------------------
def _proc_cover(empty_file: str) -> list[str]:
    """bwrap options, applied after it mounts /proc: the entries of _PROC_READ_ONLY bound read-only
    over themselves (from the host's /proc: the same kernel objects, and each reader sees its own
    namespaces' values), those of _PROC_MASKED hidden (an empty read-only file over a file, an empty
    read-only tmpfs over a folder). Only entries this kernel has. bwrap's own cover of /proc/sys is
    not enough: it binds only what a write-access check passes, which fails on /proc/sys."""
    args: list[str] = []
    for name in _PROC_READ_ONLY:
        if os.path.lexists(f"/proc/{name}"):
            args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in _PROC_MASKED:
        if os.path.isdir(f"/proc/{name}"):
            args += ["--perms", "0555", "--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
        elif os.path.lexists(f"/proc/{name}"):
            args += ["--ro-bind", empty_file, f"/proc/{name}"]
    return args


def _seccomp_memfd() -> int:
    """A descriptor holding the compiled seccomp filter (libseccomp is needed only here, so that the
    rest of this module, the action parser included, imports without it)."""
    try:
        from trajforge.pipeline.synth.envs import seccomp_filter
        return seccomp_filter.memfd()
    except (ImportError, RuntimeError, OSError) as e:
        raise SandboxUnavailable(f"the seccomp filter could not be built (install libseccomp2 and pyseccomp): {e}") from e


@dataclass
class ScriptRun:
    exit_code: int | None   # None: killed at timeout
    stdout: str
    stderr: str


class Sandbox:
    """Namespaces + disposable root fs; `spawn` starts a process inside, `close` removes all."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._tools = {t: shutil.which(t) for t in _TOOLS}
        missing = [t for t, path in self._tools.items() if path is None]
        if missing:
            raise SandboxUnavailable(f"missing tools: {', '.join(missing)} (install bubblewrap and util-linux)")
        if os.geteuid() != 0:
            raise SandboxUnavailable("the sandbox needs root (overlay mount, pids cgroup); refusing to run on the host")
        self.name = f"trajforge-{secrets.token_hex(6)}"
        self._procs: list[subprocess.Popen] = []  # the anchor first, then everything spawned
        self._cgroups: list[_Cgroup] = []
        self._fds: list[int] = []
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._release = weakref.finalize(self, _release, self._procs, self._cgroups, self._fds, self._dir)
        self._cgroup: _Cgroup | None = None
        self._anchor: subprocess.Popen | None = None
        try:
            self._seccomp_fd = _seccomp_memfd()
            self._fds.append(self._seccomp_fd)
            self._cgroup = _Cgroup(self.name, self.config, _cgroup_roots())
            self._cgroups.append(self._cgroup)
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        c, d = self.config, str(self._dir)
        read_fd, write_fd = os.pipe()
        # --dev-bind, not --bind: bwrap would remount everything below nodev, /dev/null included.
        bwrap = [self._tools["bwrap"], "--dev-bind", f"{d}/root", "/", "--proc", "/proc",
                 *_proc_cover(f"{d}/{sandbox_root.EMPTY_FILE}"),
                 "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                 "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
                 "--seccomp", str(self._seccomp_fd), "--info-fd", str(write_fd), "--",
                 # Runs once bwrap has finished building the root: "ready" means we may enter.
                 "sh", "-c", "echo ready && exec sleep infinity"]
        # The IPC namespace is unshare's (not bwrap's): its SysV shm limits are set while we still
        # hold CAP_SYS_ADMIN, and bwrap's child keeps it.
        argv = [self._tools["unshare"], "--mount", "--ipc", "--propagation", "private", "--",
                sys.executable, "-I", "-S", sandbox_root.__file__, d, str(c.disk_bytes - c.shm_bytes),
                str(c.shm_bytes), "--", *bwrap]
        assert self._cgroup is not None
        try:
            # No host variable and no host folder: bwrap becomes the sandbox's pid 1, and what it
            # starts with is what /proc/1/environ shows inside.
            self._anchor = subprocess.Popen(self._cgroup.wrap(argv), stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            pass_fds=(write_fd, self._seccomp_fd), start_new_session=True,
                                            cwd="/", env={})
            self._procs.append(self._anchor)
        finally:
            os.close(write_fd)
        try:
            info = self._read_info(read_fd)
        finally:
            os.close(read_fd)
        if info is not None and self._wait_ready():
            self.ns_pid = int(info["child-pid"])
            return
        err = b""
        if self._anchor.poll() is not None and self._anchor.stderr:
            err = self._anchor.stderr.read()
        raise SandboxUnavailable(f"the sandbox did not start: {err.decode(errors='replace').strip()}")

    def _wait_ready(self) -> bool:
        assert self._anchor is not None and self._anchor.stdout is not None
        ready, _, _ = select.select([self._anchor.stdout], [], [], 15)
        return bool(ready) and self._anchor.stdout.readline() == b"ready\n"

    def _read_info(self, fd: int) -> dict | None:
        """bwrap's --info-fd JSON (it holds the host pid of the sandbox's pid 1)."""
        buf, deadline = b"", time.monotonic() + 15
        decoder = json.JSONDecoder()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
                try:
                    return decoder.raw_decode(buf.decode().strip())[0]
                except ValueError:
                    continue
            elif self._anchor is not None and self._anchor.poll() is not None:
                break
        return None

    def inner_argv(self, argv: list[str], cwd: str = "/root") -> list[str]:
        """`argv` run inside, through sandbox_enter: the episode's cgroup, namespaces and root, the
        seccomp filter, the kept capabilities, the limits, and `_SANDBOX_ENV` as its environment."""
        c = self.config
        rlimits = f"AS={c.memory_bytes},CPU={c.cpu_seconds},FSIZE={c.file_bytes},CORE=0"
        return self._cgroup.wrap([  # type: ignore[union-attr]
            sys.executable, "-I", "-S", sandbox_enter.__file__, str(self.ns_pid), str(self._seccomp_fd), cwd,
            rlimits, *_SANDBOX_ENV, "--", *argv])

    def spawn(self, argv: list[str], **popen) -> subprocess.Popen:
        if self._anchor is None or self._anchor.poll() is not None:
            raise RuntimeError("the sandbox is closed")
        proc = subprocess.Popen(self.inner_argv(argv), start_new_session=True, pass_fds=(self._seccomp_fd,),
                                cwd="/", env={}, **popen)
        self._procs.append(proc)
        return proc

    def run_script(self, script: dict, args: list[str], timeout: float) -> ScriptRun:
        """One non-interactive script (init, check) as its own process, as upstream runs them."""
        if script["language"] == "python":
            argv = ["python3", "-c", script["code"], *args]
        else:
            argv = ["bash", "-c", script["code"], "--", *args]
        proc = self.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the process group spans the namespace boundary
            except ProcessLookupError:
                pass
            code = None
            try:
                out, err = proc.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                # A process that left the group (setsid) still holds the pipes; close() reaps it.
                out, err = b"", b""
        return ScriptRun(code, out.decode(errors="replace"), err.decode(errors="replace"))

    def processes(self) -> int:
        """How many processes the sandbox holds now (our host-side helpers included)."""
        return self._cgroup.current() if self._cgroup and self._cgroup.pids_dir.exists() else 0

    def memory_peak(self) -> int | None:
        """The most memory the episode has held (cgroup accounting: processes and tmpfs pages)."""
        return self._cgroup.memory_peak() if self._cgroup else None

    def close(self) -> None:
        self._release()
        self._cgroup = self._anchor = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(procs: list[subprocess.Popen], cgroups: list[_Cgroup], fds: list[int], directory: Path) -> None:
    """Free everything a sandbox holds. The anchor goes first: its death (--die-with-parent) takes
    the pid namespace's init with it, and the kernel kills every process inside at once; the
    cgroup then catches stragglers (our host-side nsenter helpers) and anything forked meanwhile."""
    if procs and procs[0].poll() is None:
        procs[0].kill()
    for cgroup in cgroups:
        cgroup.destroy()
    cgroups.clear()
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream:
                stream.close()
    procs.clear()
    for fd in fds:
        os.close(fd)
    fds.clear()
    if directory.exists():
        # Only ever an empty mount point on the host side: the tmpfs lived in the namespace.
        directory.rmdir()


@lru_cache(maxsize=1)
def sandbox_unavailable_reason() -> str | None:
    """None when a sandbox can be built here (tried for real, once per process), else why not."""
    try:
        with Sandbox() as box:
            run = box.run_script({"language": "bash", "code": "echo ok"}, [], timeout=20)
            if run.stdout.strip() != "ok":
                return f"probe command failed: {run.stderr.strip()}"
    except SandboxUnavailable as e:
        return str(e)
    return None


# --- the agent's shell -------------------------------------------------------------------------
@dataclass
class CommandResult:
    output: str
    exit_code: int | None     # None: the command did not finish
    timed_out: bool = False
    shell_alive: bool = True  # False: the shell no longer answers; the episode cannot go on


class Shell:
    """A persistent bash inside the sandbox, driven through pipes.

    Non-interactive on purpose: reading commands from a pipe, bash takes one line at a time, so a
    command that reads stdin gets the lines after it, as on a terminal: `su - jack` in a start
    script turns the rest of the session into jack's shell, `read v` reads the next line. (An
    interactive bash without a tty buffers its input and starves such commands; with readline it
    echoes every command.) The end of each command's output is found by a sentinel line with its
    exit code, printed by a `printf` queued after the command; the marker is split over two printf
    arguments so that an echo of the input (set -v/-x, a program copying stdin) cannot forge it.
    At timeout the shell's process group gets SIGINT, like Ctrl-C: foreground commands die,
    background jobs (SIGINT ignored in non-interactive shells) live on, and the shell's INT trap
    breaks out of loops and keeps the shell alive. If it still does not answer, it is dead.
    """

    _PREFIX = "__TRAJFORGE_END_"

    def __init__(self, sandbox: Sandbox):
        self._sandbox = sandbox
        self._token = secrets.token_hex(8)
        self._count = 0
        # Late sentinels (after a timeout), and sentinel commands copied by a program reading stdin.
        self._stale = re.compile(re.escape(f"{self._PREFIX}{self._token}".encode()) + rb"\d+:\d+\n")
        self._echoed = f"'{self._PREFIX}' '{self._token}".encode()
        self._cond = threading.Condition()
        self._buf = bytearray()
        self._dropped = 0
        self._eof = False
        # The output pipe belongs to the reader thread, which closes it at EOF (when the sandbox's
        # processes are gone), so no other thread closes an fd it may still be reading.
        read_fd, write_fd = os.pipe()
        try:
            # setsid: the shell leads its own process group (shared only with its foreground commands).
            self._proc = sandbox.spawn(["setsid", "bash", "--noprofile", "--norc"],
                                       stdin=subprocess.PIPE, stdout=write_fd, stderr=write_fd)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()
        # $$ is the shell's pid inside the sandbox, the process group that Ctrl-C goes to.
        first = self.run("trap 'break 1000 2>/dev/null' INT; echo $$", timeout=sandbox.config.setup_timeout)
        pid = first.output.strip()
        if first.exit_code is None or not pid.isdigit():
            raise SandboxUnavailable(f"the shell did not start: {first.output}")
        self._pgid = int(pid)

    def _read(self, fd: int) -> None:
        cap = self._sandbox.config.output_bytes
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            with self._cond:
                if not chunk:
                    os.close(fd)
                    self._eof = True
                    self._cond.notify_all()
                    return
                self._buf += chunk
                if len(self._buf) > cap:
                    # Keep the head (what the agent will see) and the tail (where the sentinel comes).
                    cut = len(self._buf) - cap
                    del self._buf[cap // 2: cap // 2 + cut]
                    self._dropped += cut
                self._cond.notify_all()

    def _send(self, text: str) -> bool:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def _sentinel(self) -> tuple[str, re.Pattern[bytes]]:
        self._count += 1
        mark = f"{self._token}{self._count}"
        line = f"printf '\\n%s%s:%s\\n' '{self._PREFIX}' '{mark}' \"$?\"\n"
        # A literal head keeps the search fast on large outputs; the newline printf adds before the
        # marker is trimmed by _end.
        return line, re.compile(re.escape(f"{self._PREFIX}{mark}".encode()) + rb":(\d+)\n")

    def _end(self, m: re.Match[bytes]) -> int:
        """Where the command's output stops: before the sentinel and the newline printed ahead of it."""
        start = m.start()
        return start - 1 if start and self._buf[start - 1] == 0x0A else start

    def _wait(self, pattern: re.Pattern[bytes], deadline: float) -> re.Match[bytes] | None:
        with self._cond:
            while True:
                m = pattern.search(self._buf)
                if m or self._eof:
                    return m
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _take(self, end: int, skip_to: int) -> str:
        with self._cond:
            raw = self._stale.sub(b"", bytes(self._buf[:end]))
            if self._echoed in raw:
                raw = b"\n".join(line for line in raw.split(b"\n") if self._echoed not in line)
            text = raw.decode(errors="replace")
            del self._buf[:skip_to]
            if self._dropped:
                text += f"\n[{self._dropped} bytes of output dropped]"
                self._dropped = 0
        return text

    def run(self, command: str, timeout: float) -> CommandResult:
        """Run one command in the session. It goes to bash as one `eval` line, so that bash never
        waits for the rest of an incomplete command (an unclosed quote is a syntax error, not a
        shell swallowing every later line)."""
        line, pattern = self._sentinel()
        if not self._send(f"eval -- {_ansi_c_quote(command)}\n{line}"):
            return CommandResult(self._take(len(self._buf), len(self._buf)), None, shell_alive=False)
        m = self._wait(pattern, time.monotonic() + timeout)
        if m:
            code = int(m.group(1))  # before _take: a match reads the (mutable) buffer lazily
            return CommandResult(self._take(self._end(m), m.end()), code)
        if self._eof:
            return CommandResult(self._take(len(self._buf), len(self._buf)), None, shell_alive=False)
        # Timeout: Ctrl-C, then fresh sentinels (the queued one may have been eaten by a program
        # reading stdin, dropped with bash's input buffer on SIGINT, or be stuck inside an unclosed
        # quote). Bash drops its buffered input while it handles the signal, so wait a moment and
        # retry; a late copy of an earlier sentinel is removed from later output by _take.
        self._sandbox.run_script({"language": "bash", "code": f"kill -INT -- -{self._pgid}"}, [], timeout=5)
        time.sleep(0.2)
        recovered = None
        for _ in range(3):
            recover_line, recover = self._sentinel()
            if not self._send(recover_line):
                break
            recovered = self._wait(recover, time.monotonic() + 1.0)
            if recovered or self._eof:
                break
        with self._cond:
            first = pattern.search(self._buf)
            end = self._end(first) if first else (self._end(recovered) if recovered else len(self._buf))
            skip = recovered.end() if recovered else len(self._buf)
        return CommandResult(self._take(end, skip), None, timed_out=True, shell_alive=recovered is not None)


# --- the environment ---------------------------------------------------------------------------
def clean_observation(text: str, limit: int = 800) -> str:
    """Upstream: ANSI escapes removed, cut at `limit` (first limit-20 + a truncation note)."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "")
    if len(text) > limit:
        return text[: limit - 20] + TRUNCATION_NOTE
    return text


class OsSandboxEnv(ClosingEnvironment):
    name = "os"
    # The os spec's `unavailable` (pipeline/envs/os.py) asks this.
    unavailable_reason = staticmethod(sandbox_unavailable_reason)

    def __init__(self, **config: object):
        known = {f.name for f in fields(SandboxConfig)}
        unknown = set(config) - known
        if unknown:
            raise TypeError(f"unknown os env settings: {', '.join(sorted(unknown))}")
        self.config = SandboxConfig(**config)  # type: ignore[arg-type]
        self.sandbox: Sandbox | None = None
        self._shell: Shell | None = None
        self._task: Task | None = None
        self._done = False

    def reset(self, task: Task | dict) -> str:
        self.close()
        t = coerce_task(task)
        if t.env != "os":
            raise ValueError(f"task {t.id} is for env {t.env!r}, not 'os'")
        if t.skip_reason:
            raise TaskNotRunnable(f"{t.id}: {t.skip_reason}")
        self._task, self._done = t, False
        try:
            self.sandbox = Sandbox(self.config)
            for n, script in enumerate(t.data["init"]):
                run = self.sandbox.run_script(script, [], timeout=self.config.setup_timeout)
                if run.exit_code != 0:
                    raise TaskSetupError(f"{t.id}: init script {n} exited with {run.exit_code}: "
                                         f"{(run.stderr or run.stdout).strip()[-500:]}")
            self._shell = Shell(self.sandbox)
            if t.data.get("start"):
                start = t.data["start"]
                code = start["code"] if start["language"] == "bash" else f"python3 -c {_sh_quote(start['code'])}"
                result = self._shell.run(code, timeout=self.config.setup_timeout)
                if result.timed_out or not result.shell_alive:
                    raise TaskSetupError(f"{t.id}: start script did not finish: {result.output[-500:]}")
        except BaseException:
            self.close()
            raise
        return task_prompt(t)

    def step(self, action: str) -> StepResult:
        if self._shell is None or self._task is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        kind, arg = parse_os_action(action)
        if kind == "invalid":
            return StepResult(f"Invalid action: {arg}.", info={"valid": False})
        if kind in ("answer", "finish"):
            return self._finish(arg)
        result = self._shell.run(arg or "", timeout=self.config.step_timeout)
        # `error`: the command ran but failed (the agent loop counts these apart from invalid actions).
        error = (f"timed out after {self.config.step_timeout:g}s" if result.timed_out
                 else f"exit status {result.exit_code}" if result.exit_code else None)
        info = {"valid": True, "exit_code": result.exit_code, "timed_out": result.timed_out, "error": error}
        observation = clean_observation(result.output, self.config.observation_chars)
        if not result.shell_alive:
            # The shell exited (`exit`) or is wedged (it ignores Ctrl-C): the episode ends, scored.
            end = self._finish(None)
            end.observation = observation
            end.info = {**info, **end.info, "error": "shell not responding after timeout" if result.timed_out
                        else "the shell exited"}
            return end
        return StepResult(observation, info=info)

    def _finish(self, answer: str | None) -> StepResult:
        assert self._task is not None and self.sandbox is not None
        self._done = True
        ev = self._task.data["evaluation"]
        log: list[dict] = []
        if "match" in ev:
            success = os_match(answer, ev["match"])
        else:
            params, success = ["" if answer is None else str(answer)], True
            for entry in ev["check"]:
                script = entry if entry is not None else ev["example"]
                run = self.sandbox.run_script(script, params, timeout=self.config.check_timeout)
                log.append({"exit_code": run.exit_code, "stdout": run.stdout[-2000:], "stderr": run.stderr[-2000:]})
                if run.exit_code != 0:
                    success = False
                    break
                params.append(run.stdout)
        score = float(success)
        return StepResult("", reward=score, done=True,
                          info={"valid": True, "answer": answer, "score": score, "success": success, "checks": log})

    def close(self) -> None:
        self._shell = None
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+=/.,:@%^~")


def _ansi_c_quote(text: str) -> str:
    """bash $'...' quoting of any text, on one line (bytes outside a safe set become \\xHH)."""
    return "$'" + "".join(chr(b) if chr(b) in _SAFE else f"\\x{b:02x}" for b in text.encode()) + "'"


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
