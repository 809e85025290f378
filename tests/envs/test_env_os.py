"""The `os` environment for real: AgentBench OS fixture tasks in the real sandbox, the shell's
session semantics, the limits, and escape attempts that must all be contained."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import FIXTURES, REPO
from tests.support.sandbox import sandbox_leftovers
from trajforge.pipeline.envs.tasks import Task, load_tasks
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.envs.os_sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    TaskNotRunnable,
    TaskSetupError,
    _Cgroup,
    cgroup_roots,
    clean_observation,
    parse_os_action,
    sandbox_unavailable_reason,
)

OS_DIR = FIXTURES / "tasks" / "agentbench" / "os"

_missing = [t for t in ("bwrap", "unshare") if shutil.which(t) is None]
needs_sandbox = pytest.mark.skipif(
    bool(_missing) or os.geteuid() != 0,
    reason=f"sandbox unavailable: {'missing ' + ', '.join(_missing) if _missing else 'not root'} "
           "(apt-get install bubblewrap; run as root as CI does)")
x86_64_only = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 system call numbers and ABIs")


def bash(code: str) -> str:
    return f"Think: run it.\n\nAct: bash\n\n```bash\n{code}\n```"


def os_task(**record) -> dict:
    return {"env": "os", "description": "test", "evaluation": {"match": "x"}, **record}


# Reference solutions for fixture tasks that carry no `evaluation.example`. Each derives its answer
# from the sandbox's state, so a broken environment gives a wrong answer.
SOLUTIONS = {
    'If a regular file named "workspace" exists in /working (recursively)? If so, output "yes", '
    'otherwise output "no" (with out quotes).':
        "find /working -type f -name workspace | grep -q . && echo yes || echo no",
    # The times of three writes (the log's size changing, polled every 50 ms): the mean of the two
    # intervals, rounded. Counting the bytes of a fixed 3 s window missed a write that landed a few ms
    # past the window's end (the writer's period is 1 s plus its own time, more on a loaded machine):
    # 2 writes of 1 s read as 2 s.
    "There's a program that writes 'succeed' into /root/log periodically. I only know the interval is 1 second, "
    "2 seconds, or 3 seconds. Please find out the interval. Answer me only the integer number of seconds. "
    "(e.g. 1, 2, or 3)":
        "s=$(stat -c %s /root/log 2>/dev/null); t=(); while [ ${#t[@]} -lt 3 ]; do sleep 0.05; "
        "c=$(stat -c %s /root/log 2>/dev/null); if [ \"$c\" != \"$s\" ]; then s=$c; t+=($(date +%s%N)); fi; done; "
        "echo $(( ((t[2] - t[0]) / 2 + 500000000) / 1000000000 ))",
    "There's a program that writes something into /root every 1 second. I want to know what is the file. "
    "tell me the filename please. (without its directory)":
        # The first entry whose modification time changes while polled every 50 ms: `ls -t` after a
        # fixed sleep named the writer's file only if it had written within the sleep.
        "cd /root; s=$(stat -c '%y %n' *); while sleep 0.05; do c=$(stat -c '%y %n' *); "
        "n=$(grep -vxFf <(echo \"$s\") <(echo \"$c\") | head -n 1); [ -n \"$n\" ] && break; done; echo \"${n##* }\"",
    "what is the output if i execute ~/test?": "bash /home/jack/test",
    "execute ~/test and get the output": "bash /home/jack/test",
}


def fixture_tasks() -> list[Task]:
    return [t for f in sorted(OS_DIR.glob("*.json")) for t in load_tasks(f)]


def task_param(t: Task):
    marks = [pytest.mark.skip(reason=f"{t.id}: {t.skip_reason}")] if t.skip_reason else []
    return pytest.param(t, id=f"{t.id}", marks=marks)


def solve(env, task: Task):
    """Run the reference solution as the agent would: a bash action, then answer its last line."""
    example = task.data["evaluation"]["example"]
    code = example["code"] if example else SOLUTIONS[task.description]
    result = env.step(bash(code))
    assert result.info["valid"] and not result.done, result
    lines = [line for line in result.observation.splitlines() if line.strip()]
    return env.step(f"Act: answer({lines[-1]})" if lines else "Act: finish"), result


def test_fixture_tasks_load_and_network_ones_are_marked():
    tasks = fixture_tasks()
    assert len(tasks) == 15
    skipped = {t.description: t.skip_reason for t in tasks if t.skip_reason}
    # Exactly the two sudo tasks of 6-new.json need apt (and so the network).
    assert sorted(skipped) == ["Why can't I use sudo? Help me fix it.", "Why can't I use sudo?? fix it."]
    assert all("network" in r for r in skipped.values())
    # Every runnable task has a reference solution: the record's example or one above.
    assert all(t.data["evaluation"]["example"] or t.description in SOLUTIONS for t in tasks if not t.skip_reason)


@needs_sandbox
@pytest.mark.parametrize("task", [task_param(t) for t in fixture_tasks()])
def test_fixture_task_reference_solution_scores_1(task: Task):
    with make_env("os", step_timeout=15) as env:
        prompt = env.reset(task.as_dict())
        assert prompt == f"Now, I will start a new problem in a new OS. My problem is:\n\n{task.description}"
        end, _ = solve(env, task)
        assert end.done and end.reward == 1.0 and end.info["success"] is True, (end, end.info)


@needs_sandbox
@pytest.mark.parametrize("task", [task_param(t) for t in fixture_tasks()])
def test_fixture_task_wrong_answer_scores_0(task: Task):
    with make_env("os", step_timeout=15) as env:
        env.reset(task)
        # A match task gets a wrong answer; a check task is finished without fixing anything.
        action = "Act: answer(certainly-not-it)" if "match" in task.data["evaluation"] else "Act: finish"
        end = env.step(action)
        assert end.done and end.reward == 0.0 and end.info["success"] is False


@needs_sandbox
def test_sandbox_probe_succeeds_here():
    # Where the tests can use the sandbox, the probe the synth flow can call up front agrees.
    assert sandbox_unavailable_reason() is None


@needs_sandbox
def test_skipped_task_refuses_to_run():
    sudo = next(t for t in fixture_tasks() if t.skip_reason)
    env = make_env("os")
    with pytest.raises(TaskNotRunnable, match="network"):
        env.reset(sudo)
    env.close()


@needs_sandbox
def test_session_state_persists_and_init_does_not_leak_into_the_shell():
    # init's `cd` and `su - jack` ran in their own process: the agent is root in /root.
    record = os_task(create={"init": "useradd -m jack && cd /home/jack && su - jack"},
                     start="cd /var && myvar=42")
    with make_env("os", step_timeout=5) as env:
        env.reset(record)
        r = env.step(bash("whoami; pwd; echo $myvar; grep -c '^jack:' /etc/passwd"))
        assert r.observation == "root\n/var\n42\n1\n" and r.info["exit_code"] == 0
        env.step(bash("cd /etc && other=7 && false"))
        r = env.step(bash("echo $PWD $other"))
        assert r.observation == "/etc 7\n"


@needs_sandbox
def test_observation_is_cleaned_and_cut_like_upstream():
    with make_env("os", step_timeout=5) as env:
        env.reset(os_task())
        r = env.step(bash(r"printf '\033[1;31mred\033[0m\n'; seq 1 1000"))
        assert r.observation.startswith("red\n1\n2\n")
        assert len(r.observation) == 780 + len("\n[truncated because the output is too long]")
        assert r.observation.endswith("\n[truncated because the output is too long]")
        r = env.step(bash("exit_status_test() { return 3; }; exit_status_test"))
        assert r.info["exit_code"] == 3 and r.observation == "" and r.info["error"] == "exit status 3"


@needs_sandbox
def test_exiting_the_shell_ends_the_episode_and_it_is_still_scored():
    record = os_task(evaluation={"check": "test -f /root/flag"})
    with make_env("os", step_timeout=5) as env:
        env.reset(record)
        assert env.step(bash("touch /root/flag")).info["error"] is None
        end = env.step(bash("exit 0"))
        assert end.done and end.info["error"] == "the shell exited" and end.info["success"] is True


def test_action_parsing_and_cleaning_without_a_sandbox():
    assert parse_os_action(bash("ls -l /")) == ("bash", "ls -l /\n")
    assert parse_os_action("Think: done.\n\nAct: answer(/home/user1/a b)") == ("answer", "/home/user1/a b")
    assert parse_os_action("Act: finish") == ("finish", None)
    assert parse_os_action("Act: bash ls")[0] == "invalid"
    assert parse_os_action("I think I will look around")[0] == "invalid"
    assert clean_observation("\x1b]0;title\x07\x1b[32mok\x1b[0m\r\n") == "ok\n"


@needs_sandbox
def test_invalid_action_is_reported_and_the_episode_goes_on():
    with make_env("os", step_timeout=5) as env:
        env.reset(os_task(evaluation={"match": "7"}))
        r = env.step("Act: run ls please")
        assert r.info["valid"] is False and not r.done and "Invalid action" in r.observation
        assert env.step(bash("echo $((3 + 4))")).observation == "7\n"
        end = env.step("Act: answer(7)")
        assert end.done and end.info["score"] == 1.0
        with pytest.raises(RuntimeError):
            env.step(bash("echo too late"))


@needs_sandbox
def test_check_protocol_passes_answer_and_stdout_along():
    # Upstream: params = [answer]; each passing check's stdout is appended for the next one.
    record = os_task(evaluation={"check": [
        {"language": "python", "code": "import sys\nassert sys.argv[1] == 'abc'\nprint('from-python')"},
        # Stdout is passed as printed (newline included): $(echo ...) drops it for the comparison.
        'test "$(echo "$2")" = from-python && echo second',
        {"language": "bash", "code": 'test "$(echo "$3")" = second && test -f /root/made-by-agent'}]})
    with make_env("os", step_timeout=5) as env:
        env.reset(record)
        env.step(bash("touch /root/made-by-agent"))
        end = env.step("Act: answer(abc)")
        assert end.info["success"] is True, end.info["checks"]
        assert [c["exit_code"] for c in end.info["checks"]] == [0, 0, 0]
    with make_env("os", step_timeout=5) as env:
        env.reset(record)
        end = env.step("Act: answer(abc)")  # the file was never made: the third check fails
        assert end.info["success"] is False and [c["exit_code"] for c in end.info["checks"]] == [0, 0, 1]


@needs_sandbox
def test_failing_init_is_a_setup_error_and_leaves_nothing():
    env = make_env("os")
    with pytest.raises(TaskSetupError, match="exited with 3"):
        env.reset(os_task(create={"init": "echo broken >&2; exit 3"}))
    assert env.sandbox is None
    env.close()


def test_refuses_without_a_sandbox(monkeypatch, tmp_path):
    # No bubblewrap/unshare on PATH: the environment must refuse, never run on the host.
    monkeypatch.setenv("PATH", str(tmp_path))
    marker = tmp_path / "ran-on-host"
    env = make_env("os")
    with pytest.raises(SandboxUnavailable):
        env.reset(os_task(create={"init": f"touch {marker}"}))
    env.close()
    assert not marker.exists()


# --- escape attempts ----------------------------------------------------------------------------
@pytest.fixture
def sandboxed():
    """A fresh episode with short timeouts and small limits; checks that close leaves nothing."""
    envs = []

    def start(**config):
        env = make_env("os", **{"step_timeout": 3, "memory_bytes": 256 << 20, "max_processes": 64, **config})
        env.reset(os_task())
        envs.append((env, env.sandbox.name))
        return env

    yield start
    for env, name in envs:
        env.close()
        assert sandbox_leftovers(name) == []


@needs_sandbox
def test_escape_network_is_unreachable(sandboxed):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    env = sandboxed()
    probe = ("import socket\n"
             f"for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)):\n"
             "    try:\n"
             "        socket.create_connection((host, port), timeout=2); print('CONNECTED', host)\n"
             "    except OSError as e:\n"
             "        print('blocked', host, e.errno)\n")
    r = env.step(bash(f"python3 - <<'EOF'\n{probe}EOF"))
    assert "CONNECTED" not in r.observation
    assert r.observation.count("blocked") == 3, r.observation
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever reached the host's listener
    listener.close()
    # Control: the sandbox's own loopback works (local servers in tasks), on the same port number.
    r = env.step(bash(f"(python3 -m http.server {port} >/dev/null 2>&1 &); sleep 1; python3 -c "
                      f"\"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/').status)\""))
    assert r.observation == "200\n"


@needs_sandbox
def test_escape_writes_stay_in_the_sandbox(sandboxed, tmp_path):
    host_file = tmp_path / "host-owned.txt"
    host_file.write_text("original")
    env = sandboxed()
    r = env.step(bash(f"echo pwned > /etc/trajforge_escape && cat /etc/trajforge_escape; "
                      f"echo pwned > {host_file}; echo pwned > /usr/bin/trajforge_escape; "
                      "useradd eve && grep -c '^eve:' /etc/passwd"))
    assert r.observation.startswith("pwned\n") and r.observation.rstrip().endswith("1")
    assert not Path("/etc/trajforge_escape").exists()
    assert not Path("/usr/bin/trajforge_escape").exists()
    assert host_file.read_text() == "original"
    assert "eve:" not in Path("/etc/passwd").read_text()


@needs_sandbox
def test_escape_privileged_operations_are_denied(sandboxed):
    env = sandboxed()
    r = env.step(bash("mount -t tmpfs x /mnt && echo MOUNTED; mknod /root/disk b 8 0 && echo MKNOD; "
                      "unshare -m true && echo UNSHARED; ls /sys/class/net 2>/dev/null | wc -l"))
    assert "MOUNTED" not in r.observation and "MKNOD" not in r.observation and "UNSHARED" not in r.observation


@needs_sandbox
def test_escape_parent_environment_is_not_visible(sandboxed, monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("TRAJFORGE_TEST_SECRET", secret)
    env = sandboxed()
    r = env.step(bash("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c TRAJFORGE_TEST_SECRET"))
    assert secret not in r.observation and "TRAJFORGE_TEST_SECRET=" not in r.observation
    assert r.observation.rstrip().endswith("0")


def _inside(env, code: str, *args: str):
    """Run a Python program inside the episode's sandbox as a check script runs (whole output)."""
    return env.sandbox.run_script({"language": "python", "code": code}, list(args), timeout=20)


# Kernel settings whose write access means the host (core_pattern, modprobe: a program the kernel
# runs as host root). Only opened for writing, never written: nothing changes even unprotected.
_KERNEL_SETTINGS = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches",
                    "/proc/sysrq-trigger")
_OPEN_FOR_WRITING = """
import errno, os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_WRONLY))
        print(path, "OPENED")
    except OSError as e:
        print(path, errno.errorcode[e.errno])
"""


@needs_sandbox
def test_escape_kernel_settings_are_read_only_and_kernel_internals_masked(sandboxed):
    paths = [p for p in _KERNEL_SETTINGS if os.path.exists(p)]
    before = {p: Path(p).read_bytes() for p in paths if p.startswith("/proc/sys/kernel/")}
    env = sandboxed()
    run = _inside(env, _OPEN_FOR_WRITING, *paths)
    assert run.stdout.split() == [w for p in paths for w in (p, "EROFS")], run.stdout + run.stderr
    # The agent's own shell too, through the usual redirection.
    r = env.step(bash("echo '|/bin/false' > /proc/sys/kernel/core_pattern"))
    assert "Read-only file system" in r.observation and r.info["exit_code"] != 0
    assert {p: Path(p).read_bytes() for p in before} == before
    # Masked: the entries the kernel has here read as empty files or empty folders.
    masked = [p for p in ("/proc/keys", "/proc/timer_list", "/proc/interrupts", "/proc/kcore", "/proc/sched_debug")
              if os.path.exists(p)]
    r = env.step(bash(f"cat {' '.join(masked)} | wc -c; ls -A /proc/acpi 2>/dev/null | wc -l"))
    assert masked and r.observation == "0\n0\n", r.observation


# System calls the filter refuses, with arguments that do nothing (or fail) when the call is let
# through, so that the test changes nothing where the filter is missing: an unknown key type, a
# read-only keyring query (create=0), a bad reboot magic number, invalid kexec flags...
_FILTERED_CALLS = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
calls = [
    ("add_key", 248, b"trajforge-no-such-type", b"d", None, 0, -3),
    ("request_key", 249, b"trajforge-no-such-type", b"d", None, 0),
    ("keyctl", 250, 0, -3, 0),                       # KEYCTL_GET_KEYRING_ID, session keyring, no create
    ("clone3", 435, None, 0),                        # ENOSYS: the C library falls back to clone
    ("setns", 308, -1, 0),
    ("ptrace", 101, 0, 0, 0, 0),                     # PTRACE_TRACEME
    ("process_vm_readv", 310, os.getpid(), None, 0, None, 0, 0),
    ("bpf", 321, 1000, None, 0),
    ("perf_event_open", 298, None, 0, -1, -1, 0),
    ("io_uring_setup", 425, 1, None),
    ("userfaultfd", 323, 0),
    ("open_by_handle_at", 304, -1, None, 0),
    ("personality", 135, 0x0040000),                 # ADDR_NO_RANDOMIZE
    ("socket", 41, 40, 1, 0),                        # AF_VSOCK
    ("syslog", 103, 10, None, 0),                    # SYSLOG_ACTION_SIZE_BUFFER
    # Also refused for want of a capability; the filter refuses them first.
    ("mount", 165, None, None, None, 0, None),
    ("umount2", 166, b"/trajforge-no-such-mount", 0),
    ("pivot_root", 155, None, None),
    ("init_module", 175, None, 0, b""),
    ("finit_module", 313, -1, b"", 0),
    ("delete_module", 176, b"trajforge_no_such_module", 0),
    ("reboot", 169, 0, 0, 0, None),
    ("kexec_load", 246, 0, 0, None, 0x7FFF0000),
    ("swapon", 167, None, 0),
    ("acct", 163, b"/trajforge-no-such-dir/acct"),
    ("clock_settime", 227, 0, None),
]
for name, number, *args in calls:
    result = libc.syscall(number, *args)
    print(name, errno.errorcode[ctypes.get_errno()] if result == -1 else f"returned-{result}")
# Last, as it forks when let through: a child in a new user namespace (it exits at once).
child = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)   # clone(CLONE_NEWUSER | SIGCHLD)
if child == 0:
    os._exit(0)
print("clone-newuser", errno.errorcode[ctypes.get_errno()] if child == -1 else "returned-pid")
print("getpid", "returned" if libc.syscall(39) == os.getpid() else "wrong")
"""


@needs_sandbox
@x86_64_only
def test_escape_seccomp_filter_refuses_keyrings_namespaces_and_kernel_surfaces(sandboxed):
    env = sandboxed()
    r = env.step(bash("grep '^Seccomp:' /proc/self/status; unshare -U true && echo USERNS; "
                      "unshare -r true && echo ROOT-IN-USERNS"))
    assert r.observation.splitlines()[0].split() == ["Seccomp:", "2"]
    assert "USERNS" not in r.observation and "Operation not permitted" in r.observation
    run = _inside(env, _FILTERED_CALLS)
    results = dict(line.split() for line in run.stdout.splitlines())
    assert results.pop("clone3") == "ENOSYS" and results.pop("getpid") == "returned", run.stdout + run.stderr
    assert results and set(results.values()) == {"EPERM"}, results


_OTHER_ABI = r"""
import ctypes, mmap, sys
if sys.argv[1] == "x32":
    result = ctypes.CDLL(None).syscall(0x40000000 | 39)          # getpid, x32 numbering
else:
    code = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"                   # mov eax, 20 (i386 getpid); int 0x80; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    result = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
print("RETURNED", result)
"""


@needs_sandbox
@x86_64_only
def test_escape_other_system_call_abis_kill_the_process(sandboxed):
    # The filter checks x86_64 numbers; a call through the x32 or i386 ABI would bypass it.
    env = sandboxed()
    for abi in ("x32", "i386"):
        run = _inside(env, _OTHER_ABI, abi)
        assert "RETURNED" not in run.stdout and run.exit_code == -31, (abi, run)  # SIGSYS


@needs_sandbox
def test_escape_capabilities_inside_are_the_kept_few(sandboxed):
    kept = {"chown": 0, "dac_override": 1, "fowner": 3, "fsetid": 4, "kill": 5, "setgid": 6, "setuid": 7,
            "net_bind_service": 10}
    mask = f"{sum(1 << bit for bit in kept.values()):016x}"
    env = sandboxed()
    r = env.step(bash("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status"))
    assert dict(line.split() for line in r.observation.splitlines()) == {
        "CapInh:": "0" * 16, "CapPrm:": mask, "CapEff:": mask, "CapBnd:": mask, "CapAmb:": "0" * 16}


@needs_sandbox
def test_escape_init_process_shows_no_host_path(sandboxed, tmp_path, monkeypatch):
    # Started from a folder of ours, with a folder of ours on PATH: neither may show inside.
    marker = tmp_path / "host-only-bin"
    marker.mkdir()
    monkeypatch.setenv("PATH", f"{marker}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    env = sandboxed()
    r = env.step(bash("wc -c < /proc/1/environ; readlink /proc/1/cwd; "
                      "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -F "
                      f"-e {tmp_path} -e {REPO} -e {sys.prefix}"))
    assert r.observation == "0\n/\n0\n", r.observation


@needs_sandbox
def test_escape_rewritten_programs_never_run_with_privileges(sandboxed):
    # The agent is root inside and may replace any program. Whatever we run later in the sandbox
    # (check scripts, Ctrl-C at a timeout) must never run one of its programs with more than the
    # kept capabilities: the tools a privileged entry could use are replaced by recorders.
    env = sandboxed(step_timeout=2)
    tools = ("nsenter", "setpriv", "prlimit", "env", "setsid", "bash", "python3", "kill")
    record = ("#!/root/recorder-shell\\ngrep CapEff /proc/self/status >> /root/ran-$(basename \"$0\")\\n"
              "exec /root/real-$(basename \"$0\") \"$@\"\\n")
    r = env.step(bash(f"cp /bin/sh /root/recorder-shell; for t in {' '.join(tools)}; do p=$(command -v $t) || continue; "
                      f"cp \"$(readlink -f $p)\" /root/real-$t; printf '{record}' > $p.new; chmod 755 $p.new; "
                      "mv $p.new $p; done; echo replaced"))
    assert r.observation.endswith("replaced\n"), r.observation
    env.step(bash("sleep 30"))  # times out: Ctrl-C is sent from a fresh process inside
    end = env.step("Act: finish")
    assert end.done
    run = env.sandbox.run_script({"language": "bash", "code": "cat /root/ran-*"}, [], timeout=10)
    caps = {line.split()[1] for line in run.stdout.splitlines()}
    assert caps == {"00000000000004fb"}, run.stdout  # recorders ran, never with more


@needs_sandbox
def test_escape_fork_bomb_is_contained(sandboxed):
    env = sandboxed(max_processes=64)
    started = time.monotonic()
    r = env.step(bash("( :(){ :|:& };: ) 2>/dev/null"))
    assert r.info["valid"]
    time.sleep(0.5)
    assert env.sandbox.processes() <= 64
    r = env.step(bash("echo still-answering"))  # builtins need no fork
    assert "still-answering" in r.observation or r.done
    assert time.monotonic() - started < 15


@needs_sandbox
def test_escape_memory_hog_is_killed(sandboxed):
    env = sandboxed(memory_bytes=256 << 20)
    r = env.step(bash("python3 -c 'a = []\nwhile True: a.append(bytearray(10**7))'"))
    assert "MemoryError" in r.observation and r.info["exit_code"] != 0
    assert env.step(bash("echo after")).observation == "after\n"


@needs_sandbox
def test_escape_endless_loop_is_interrupted_at_timeout(sandboxed):
    env = sandboxed(step_timeout=2)
    started = time.monotonic()
    r = env.step(bash("while :; do :; done"))
    assert r.info["timed_out"] and not r.done and time.monotonic() - started < 6
    assert env.step(bash("echo recovered")).observation == "recovered\n"
    # A loop that ignores Ctrl-C: the shell is declared dead, the episode ends (scored 0).
    r = env.step(bash("trap '' INT; while :; do :; done"))
    assert r.done and r.info["score"] == 0.0 and "not responding" in r.info["error"]


@needs_sandbox
def test_cpu_time_and_file_size_limits(sandboxed):
    env = sandboxed(cpu_seconds=1, file_bytes=1 << 20, step_timeout=10)
    started = time.monotonic()
    r = env.step(bash("python3 -c 'while True: pass'"))
    assert r.info["exit_code"] in (137, 152) and time.monotonic() - started < 8  # SIGKILL / SIGXCPU
    r = env.step(bash("head -c 5M /dev/zero > /root/big; stat -c %s /root/big"))
    assert r.observation.rstrip().endswith(str(1 << 20))


@needs_sandbox
def test_output_flood_is_bounded(sandboxed):
    env = sandboxed(output_bytes=64 << 10)
    r = env.step(bash("head -c 5M /dev/zero | tr '\\0' a; echo; echo done"))
    assert r.info["exit_code"] == 0 and len(r.observation) == 780 + len("\n[truncated because the output is too long]")
    assert env.step(bash("echo next")).observation == "next\n"


def _host_shmem() -> int:
    """Bytes of shared memory (tmpfs, SysV shm) on the host: the shared-memory column of `free`."""
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("Shmem:"))
    return int(line.split()[1]) * 1024


@needs_sandbox
def test_escape_writes_everywhere_are_bounded_by_disk_bytes(sandboxed):
    # Every writable place (/, the overlays over /etc, /usr and /var/lib/dpkg, the scratch dirs,
    # /dev/shm) draws on one tmpfs; SysV shared memory has its own share of disk_bytes.
    disk, file_size = 64 << 20, 24 << 20
    config = SandboxConfig(disk_bytes=disk)
    places = ["/", "/tmp", "/root", "/home", "/run", "/var/tmp", "/var/log", "/dev/shm", "/etc", "/usr/bin",
              "/var/lib/dpkg", "/opt", "/srv", "/mnt", "/media"]
    env = sandboxed(disk_bytes=disk, file_bytes=file_size, step_timeout=20)
    before = _host_shmem()
    r = env.step(bash(f"for d in {' '.join(places)}; do head -c {file_size} /dev/zero > $d/fill 2>/dev/null; done; "
                      f"cat {' '.join(p.rstrip('/') + '/fill' for p in places)} 2>/dev/null | wc -c; "
                      "df -B1 --output=size,itotal / | tail -1"))
    written, tmpfs_size, inodes = map(int, r.observation.split())
    grown = _host_shmem() - before
    # Without the bound, 15 x 24 MiB would have landed in host memory.
    assert grown <= disk + (32 << 20), f"host shared memory grew by {grown >> 20} MiB"
    assert file_size * 2 <= written <= disk - config.shm_bytes
    # Empty files are bounded too: one inode per 4 KiB (inodes are memory that `size` ignores).
    assert tmpfs_size == disk - config.shm_bytes and inodes == tmpfs_size // 4096
    r = env.step(bash(f"ipcmk -M {config.shm_bytes + 4096} >/dev/null 2>&1 && echo TOO-BIG; "
                      f"ipcmk -M {config.shm_bytes // 2} >/dev/null && echo fits"))
    assert r.observation == "fits\n"


def _plant(directory: Path, token: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "secret.txt").write_text(token)
    return directory / "secret.txt"


_READ_FROM_A_SANDBOX = r"""
import json, sys
from trajforge.pipeline.synth.envs import make_env
files, folders, name = sys.argv[1].split(), sys.argv[2], sys.argv[3]
bash = lambda code: "Act: bash\n\n```bash\n" + code + "\n```"
with make_env("os", step_timeout=10) as env:
    env.reset({"env": "os", "description": "t", "evaluation": {"match": "x"}})
    seen = {path: env.step(bash("cat " + path)) for path in files}
    seen = {path: [r.observation, r.info["exit_code"]] for path, r in seen.items()}
    # Lines that list the planted folder, or /etc/passwd (a control: ls works).
    seen["ls"] = env.step(bash(f"ls -a {folders} 2>/dev/null | grep -c -e {name} -e '^passwd$'")).observation
    seen["/etc/shadow"] = env.step(bash("cat /etc/shadow")).observation
print(json.dumps(seen))
"""


@needs_sandbox
def test_escape_host_files_outside_the_allowlist_are_unreadable_from_any_working_directory():
    token = secrets.token_hex(16)
    name = f"trajforge-escape-{token[:8]}"
    planted_dirs = [Path("/opt", name), Path("/var/lib", name), Path("/srv", name), Path("/", name),
                    Path.home() / name, REPO.parent / name]
    etc_secret = Path("/etc", name)  # a host file that other users may not read
    try:
        planted = [_plant(d, token) for d in planted_dirs]
        etc_secret.write_text(token)
        etc_secret.chmod(0o600)
        files = [str(p) for p in planted] + [str(etc_secret), str(REPO / "pyproject.toml")]
        folders = " ".join(str(d.parent) for d in [*planted_dirs, etc_secret])
        for cwd in (Path("/", name), REPO.parent):  # the old denylist depended on the working directory
            run = subprocess.run([sys.executable, "-c", _READ_FROM_A_SANDBOX, " ".join(files), folders, name],
                                 cwd=cwd,
                                 capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
            assert run.returncode == 0, run.stderr
            seen = json.loads(run.stdout.splitlines()[-1])
            for path in files:
                observation, exit_code = seen[path]
                assert exit_code != 0 and "No such file or directory" in observation, (cwd, path, observation)
                assert token not in observation
            assert seen["ls"] == "1\n"
            # The host's shadow is never read: every password field inside is locked.
            shadow = [line.split(":") for line in seen["/etc/shadow"].splitlines()]
            assert "root" in {fields[0] for fields in shadow}
            assert {fields[1] for fields in shadow} == {"*"}
    finally:
        etc_secret.unlink(missing_ok=True)
        for d in planted_dirs:
            shutil.rmtree(d, ignore_errors=True)


@needs_sandbox
def test_escape_memory_cap_holds(sandboxed):
    # 4 processes of 150 MiB each, each within its address-space limit, in an episode capped at
    # memory_bytes + disk_bytes = 320 MiB: the cgroup's OOM killer ends some; the peak stays under.
    env = sandboxed(memory_bytes=256 << 20, disk_bytes=64 << 20, step_timeout=30)
    hog = "import time; b = bytes([1]) * (150 << 20); time.sleep(3)"
    r = env.step(bash(f"for i in 1 2 3 4; do (python3 -c '{hog}'; echo exit=$?) & done; wait"))
    exits = [line for line in r.observation.splitlines() if line.startswith("exit=")]
    assert len(exits) == 4 and "exit=137" in exits, r.observation
    assert env.sandbox.memory_peak() <= (256 + 64) << 20
    assert env.step(bash("echo alive")).observation == "alive\n"


def test_memory_controller_is_required(tmp_path):
    v1_pids, v2 = tmp_path / "pids", tmp_path / "unified"
    v1_pids.mkdir()
    v2.mkdir()
    (v2 / "cgroup.subtree_control").write_text("cpu io\n")
    mountinfo = (f"39 31 0:36 / {v1_pids} rw,relatime - cgroup cgroup rw,pids\n"
                 f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n")
    roots = cgroup_roots(mountinfo)
    assert roots == {"pids": (v1_pids, 1)}
    with pytest.raises(SandboxUnavailable, match="memory"):
        _Cgroup("trajforge-test", SandboxConfig(), roots)
    assert not (v1_pids / "trajforge-test").exists()
    (v2 / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert cgroup_roots(mountinfo) == {"pids": (v1_pids, 1), "memory": (v2, 2)}


@needs_sandbox
def test_hanging_check_script_is_killed_at_its_timeout():
    env = make_env("os", step_timeout=3, check_timeout=1)
    try:
        env.reset(os_task(evaluation={"check": "sleep 30 & setsid sleep 30 & sleep 30"}))
        started = time.monotonic()
        end = env.step("Act: finish")
        assert end.done and end.info["success"] is False and end.info["checks"][0]["exit_code"] is None
        assert time.monotonic() - started < 6
    finally:
        name = env.sandbox.name if env.sandbox else None
        env.close()
    assert name is None or sandbox_leftovers(name) == []
