"""The whole `trajforge build` at scale, against the I/O floor of the same files, in one run.

Usage: python bench/bench_build.py N [--fixtures DIR] [--seed S] [--work DIR] [--keep] [--runner threads] [--timeout S]
                                     [--timeline S] [--phases]

The corpus is N trajectories scaled from the real fixture rows, in the upstream layouts: AgentInstruct
rows as Parquet files `db-NNNNN.parquet` ({conversations[{from, loss, value}], id}) and AgentTraj-L rows as
one JSON array per env (`<env>_train.json`). Every original gets 30 % of the lower-case words of its
free text (task, thoughts, observations; not the shared instructions, nor lines with an action, code or
an answer) replaced by words of the fixtures' vocabulary, so originals are distinct from one another and
the dedup has real work. Then 8 % of N are planted exact copies of an original (a new id) and 4 % near
copies (1 word in 150 of the free text changed, planted only on originals with >= 150 such words, so the
true shingle Jaccard stays near 0.93). `--seed` draws another corpus of the same shape (other bases, words,
edits and copies): the build's figures on a corpus it was not tuned on.

Measured in the same run:
- the interpreter (the bench's, which runs the build's `trajforge` too): its version and executable,
  whether libpython is a shared library or is in the executable, and the CPU time of a fixed loop of
  pure Python (JSON, a regex, dicts): the build's per-record work is Python, and on the same machine
  a CPython linked to a shared libpython and built without PGO and LTO (pyenv's default) took ~10 %
  more CPU and wall time for a 1M build than a distribution's (docs/scale.md), which the I/O floor
  does not show;
- the I/O floor: pyarrow reads the same upstream files (Parquet, and the JSON arrays through `json` into
  Arrow) and writes the same rows as zstd Parquet, before and after the build, each time at least 3
  times and until ~15 s of it are measured (`floor_runs`; 3 times at 1M, whose one run on each side
  moved the ratio by ~6 %; ~5 times at 100k, whose ~3 s floor moved by a third from one run to the
  next); the ratio is to the median of all those runs. The files are read once beforehand, so that
  every run finds them in the page cache;
- `trajforge build` as a subprocess of the real CLI (`--source NAME=PATH`), its wall time and the peak
  RSS and PSS of its process tree (sampled every 0.2 s, PSS only where it could set a new peak, at
  most once a second: `TreeSampler`), its CPU by process (the command, Prefect's temporary server,
  the fork server, the workers), the PSS of each kind of process at the peak and when the peak was,
  and, with `--timeline S`, the cores it kept busy in each S seconds (where a build leaves a core idle) and the
  tree's highest RSS in each (where its memory peaks: RSS, read at every sample, where PSS is not);
  with `--phases`, the build runs with `-v` and its log lines are timed as they come: when the flow
  began (the temporary server answered), when its first unit and its map ended, when each step of
  the global stages and the writers ended, and the stretch from the last shard to the command's exit;
- the whole machine's cores over the build (`MachineCores`, from the kernel's counters): the time they
  were busy with the build's processes, busy with anything else (the kernel's own threads, such as
  the writeback of dirty pages, and any other process: on a quiet machine a few core-seconds), idle,
  and idle while a process waited on the disk; what a build leaves on the table, and whether the
  machine was quiet;
- from the build's outputs: rows/s, recall of the planted copies (the share of planted copies found in
  the duplicates map pointing into their own family) and false merges (map rows linking two families);
  and, for a corpus of the default fixtures, whether every published file is byte-identical to the
  digest kept for that N and seed (`bench/digests/generated-N.json`, `generated-N-seedS.json` for
  another seed; bench/build_digest.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_FIXTURES = Path(os.environ.get("TRAJFORGE_FIXTURES", REPO / "tests" / "fixtures")) / "raw"

EXACT_SHARE, NEAR_SHARE = 0.08, 0.04
MUTATE_SHARE = 1.0
NEAR_EDIT_EVERY, NEAR_MIN_WORDS = 150, 100
ROWS_PER_PARQUET = 50_000
# The family of a generated row is in its upstream id (kept in the record id and the duplicates map).
FAMILY = re.compile(r"-g(\d+)c(\d+)")
_WORD = re.compile(r"\b[a-z]{3,}\b")
_FROZEN_LINE = re.compile(r"Action|Final Answer|```|\[|\]|\(|\)|=|\{|\}")


def base_rows(raw: Path) -> dict[str, list[dict]]:
    """Real rows by upstream file kind: 'agentinstruct:db' -> rows, 'agenttraj_l:webshop' -> rows."""
    rows: dict[str, list[dict]] = {}
    for f in sorted((raw / "agentinstruct").glob("*.parquet")):
        split = f.name.split(".")[0].split("-")[0]
        rows.setdefault(f"agentinstruct:{split}", []).extend(pq.read_table(f).to_pylist())
    for f in sorted((raw / "agenttraj_l").glob("*_train.json")):
        rows.setdefault(f"agenttraj_l:{f.name.removesuffix('_train.json')}", []).extend(json.loads(f.read_text()))
    return rows


def _action_words(row: dict) -> set[str]:
    """Words of every action of the row (the text after `Action` in an assistant turn): an observation
    that lists the action space keeps them, so the edited actions stay valid."""
    words: set[str] = set()
    for turn in row["conversations"]:
        if turn["from"] == "gpt" and "Action" in turn["value"]:
            words.update(_WORD.findall(turn["value"][turn["value"].index("Action"):]))
    return words


def template(row: dict) -> list[tuple[int, list[str]]]:
    """Per turn after the instructions and acknowledgement: its text cut into fixed pieces (even
    positions) and editable words (odd positions). Editable: lower-case words of a thought (before
    `Action`) or of an observation line without code, brackets or an answer, that no action uses."""
    frozen = _action_words(row)
    out = []
    for k, turn in enumerate(row["conversations"][2:], 2):
        text = turn["value"]
        cut = text.index("Action") if turn["from"] == "gpt" and "Action" in text else len(text)
        pieces, pos, offset = [], 0, 0
        for line in text[:cut].split("\n"):
            if not _FROZEN_LINE.search(line):
                for w in _WORD.finditer(line):
                    if w.group() not in frozen:
                        pieces += [text[pos:offset + w.start()], w.group()]
                        pos = offset + w.end()
            offset += len(line) + 1
        pieces.append(text[pos:])
        out.append((k, pieces))
    return out


def _vary(row: dict, tpl: list[tuple[int, list[str]]], rng, vocab, share: float = MUTATE_SHARE,
          edits: int = 0) -> dict:
    """The row with `share` of its editable words (or exactly `edits` of them) replaced."""
    turns = [dict(t) for t in row["conversations"]]
    slots = [(k, j) for k, pieces in tpl for j in range(1, len(pieces), 2)]
    if edits:
        chosen = rng.choice(len(slots), size=min(edits, len(slots)), replace=False) if slots else []
    else:
        chosen = np.flatnonzero(rng.random(len(slots)) < share)
    new = dict(zip(chosen.tolist() if hasattr(chosen, "tolist") else chosen,
                   vocab[rng.integers(len(vocab), size=len(chosen))].tolist()))
    i = 0
    for k, pieces in tpl:
        pieces = list(pieces)
        for j in range(1, len(pieces), 2):
            if i in new:
                pieces[j] = new[i]
            i += 1
        turns[k]["value"] = "".join(pieces)
    return {**row, "conversations": turns}


def _editable(tpl) -> int:
    return sum(len(pieces) // 2 for _, pieces in tpl)


def _with_id(row: dict, kind: str, family: int, copy: int) -> dict:
    key = "id" if kind == "agentinstruct" else "item_id"
    return {**row, key: f"{row[key]}-g{family}c{copy}"}


def generate(raw: Path, n: int, out: Path, seed: int = 0) -> dict:
    """Write the corpus under out/<source>/; returns counts of what was planted."""
    rng = np.random.default_rng(seed)
    bases = base_rows(raw)
    vocab = np.array(sorted({w for rows in bases.values() for r in rows for t in r["conversations"]
                             for w in _WORD.findall(t["value"])}))
    kinds = sorted(bases)
    n_exact, n_near = int(n * EXACT_SHARE), int(n * NEAR_SHARE)
    n_orig = n - n_exact - n_near
    files: dict[str, list[dict]] = {k: [] for k in kinds}
    writers: dict[str, object] = {}
    counts = {"originals": 0, "exact": 0, "near": 0}
    parquet_part: dict[str, int] = {}

    def flush(kind: str, final: bool = False) -> None:
        source, split = kind.split(":")
        rows = files[kind]
        if source == "agentinstruct":
            while len(rows) >= ROWS_PER_PARQUET or (final and rows):
                part = parquet_part.get(kind, 0)
                path = out / source / f"{split}-{part:05d}.parquet"
                path.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.Table.from_pylist(rows[:ROWS_PER_PARQUET]), path, compression="zstd")
                parquet_part[kind] = part + 1
                del rows[:ROWS_PER_PARQUET]
        else:
            fh = writers.get(kind)
            if fh is None:
                path = out / source / f"{split}_train.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                fh = writers[kind] = open(path, "w")
                fh.write("[")
                fh.first = True  # type: ignore[attr-defined]
            for r in rows:
                fh.write(("" if fh.first else ",") + json.dumps(r, ensure_ascii=False))
                fh.first = False
            rows.clear()
            if final:
                fh.write("]")
                fh.close()

    originals: list[tuple[str, dict]] = []
    # Copies are drawn from a sliding window of recent originals so the generator's memory stays flat.
    window = 5000
    plan = np.array([0] * n_orig + [1] * n_exact + [2] * n_near)
    rng.shuffle(plan)
    templates = {kind: [template(r) for r in rows] for kind, rows in bases.items()}
    # Half the originals are AgentInstruct rows, the other half spread over the AgentTraj-L envs.
    instruct = [k for k in kinds if k.startswith("agentinstruct:")]
    traj = [k for k in kinds if not k.startswith("agentinstruct:")]
    family = 0
    for what in plan:
        if what == 0 or not originals:
            group = instruct if family % 2 == 0 or not traj else traj
            kind = group[(family // 2) % len(group)]
            b = int(rng.integers(len(bases[kind])))
            row = _with_id(_vary(bases[kind][b], templates[kind][b], rng, vocab), kind.split(":")[0], family, 0)
            originals.append((kind, row))
            if len(originals) > window:
                originals.pop(0)
            files[kind].append(row)
            family += 1
            counts["originals"] += 1
        else:
            kind, orig = originals[int(rng.integers(len(originals)))]
            source = kind.split(":")[0]
            key = "id" if source == "agentinstruct" else "item_id"
            fam = int(FAMILY.search(orig[key]).group(1))
            copy_no = counts["exact"] + counts["near"] + 1
            tpl = template(orig) if what == 2 else []
            if what == 2 and _editable(tpl) < NEAR_MIN_WORDS:
                what = 1
            row = orig if what == 1 else _vary(orig, tpl, rng, vocab,
                                               edits=max(1, _editable(tpl) // NEAR_EDIT_EVERY))
            base_id = orig[key].rsplit("-g", 1)[0]
            files[kind].append({**row, key: f"{base_id}-g{fam}c{copy_no}"})
            counts["exact" if what == 1 else "near"] += 1
        if len(files[kind]) >= 2000:
            flush(kind)
    for kind in kinds:
        flush(kind, final=True)
    return counts


# The floor is run on each side of the build at least FLOOR_MIN_RUNS times (at 1M, one ~37 s run on
# each side moved between 34 and 41 s within an hour, and the ratio with it), and again until this
# many seconds of it are measured, at most FLOOR_MAX_RUNS times.
FLOOR_SECONDS, FLOOR_MIN_RUNS, FLOOR_MAX_RUNS = 15.0, 3, 7


def floor_runs(corpus: Path, scratch: Path) -> tuple[list[float], int]:
    """The seconds of each `io_floor` run, at least FLOOR_MIN_RUNS and until FLOOR_SECONDS of it are
    measured, and the rows."""
    seconds, rows = io_floor(corpus, scratch)
    runs = [seconds]
    while (len(runs) < FLOOR_MIN_RUNS or sum(runs) < FLOOR_SECONDS) and len(runs) < FLOOR_MAX_RUNS:
        runs.append(io_floor(corpus, scratch)[0])
    return runs, rows


def _runs(runs: list[float]) -> str:
    if len(runs) == 1:
        return f"{runs[0]:.2f} s"
    return f"{statistics.median(runs):.2f} s (median of {len(runs)}: {', '.join(f'{r:.2f}' for r in runs)})"


def io_floor(corpus: Path, scratch: Path) -> tuple[float, int]:
    """Seconds to read every upstream file with pyarrow and write its rows as zstd Parquet (into
    `scratch`, removed afterwards); rows."""
    start, rows = time.perf_counter(), 0
    scratch.mkdir(parents=True, exist_ok=True)
    for f in sorted(corpus.rglob("*")):
        if f.suffix == ".parquet":
            table = pq.read_table(f)
        elif f.suffix == ".json":
            table = pa.Table.from_pylist(json.loads(f.read_text()))
        else:
            continue
        rows += table.num_rows
        pq.write_table(table, scratch / f"{f.parent.name}-{f.stem}.parquet", compression="zstd")
        del table
    seconds = time.perf_counter() - start
    shutil.rmtree(scratch)
    return seconds, rows


# The fixed pure-Python loop `python_speed` times: turns of an upstream row parsed from JSON, matched
# with a regex and rebuilt as dicts, as normalize does (not our code: the same loop from run to run).
_TURNS = json.dumps([{"from": "gpt" if i % 2 else "human", "value": "Thought: I should look again. " * 8
                      + f"Action: click[item {i}]"} for i in range(12)])
_THOUGHT_ACTION = re.compile(r"Thought:\s*(.*?)\s*Action:\s*(.*)", re.S)


def python_speed(rounds: int = 10_000) -> float:
    """CPU seconds of `rounds` rounds of a fixed pure-Python loop in this interpreter."""
    start = time.process_time()
    for _ in range(rounds):
        turns = []
        for row in json.loads(_TURNS):
            match = _THOUGHT_ACTION.search(row["value"])
            turns.append({"role": "assistant" if row["from"] == "gpt" else "user", "content": row["value"].strip(),
                          "thought": match and match.group(1), "action": match and match.group(2)})
    return time.process_time() - start


def interpreter() -> str:
    """The running CPython: version, executable, and how libpython is linked (a shared library mapped
    into the process, or in the executable), as far as Linux's /proc says."""
    try:
        maps = Path("/proc/self/maps").read_text()
        linked = "shared libpython" if "libpython" in maps else "libpython in the executable"
    except OSError:
        linked = "libpython linkage unknown"
    return f"{sys.implementation.name} {sys.version.split()[0]} ({os.path.realpath(sys.executable)}, {linked})"


def read_through(corpus: Path) -> int:
    """Read every file of `corpus` once (its bytes, returned), so that the first floor finds it in the
    page cache as the build and the second floor do (at 1M, the floor with the corpus evicted from the
    cache took 60.9 s, 53.3 s right after)."""
    size = 0
    for f in sorted(corpus.rglob("*")):
        if f.is_file():
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    size += len(chunk)
    return size


class TreeSampler:
    """Peak RSS and PSS of a process tree, and each process's CPU seconds (by pid).

    RSS and CPU are read at every sample (~20 us a process). The tree's processes are listed anew
    once a second (`LIST_EVERY_S`), not at every sample: psutil finds a process's children by reading
    every process of the machine (~1.3 ms), 2 s of CPU in a 1M build at every sample (a process that
    lives less than a second may go uncounted; a build's live for the whole build or a step of it).
    PSS is read from `smaps_rollup`, for which the kernel walks the process's page tables under its mmap lock (~5-10 ms
    for a 1.7 GB process; the build's own mmap and munmap wait behind it): reading it from every
    process five times a second made a 100k build ~13 % slower. So PSS is read, of every process,
    only when a read could set a new peak: the tree's PSS is estimated at every sample as each
    process's RSS less what its RSS overstated its PSS by at its last read (the pages it shares:
    ~0.45 GiB of the tree's once the workers run), and read when that estimate comes within
    `PSS_MARGIN` of the peak, or `PSS_REFRESH_S` after the last read, while the RSS sum is above the
    peak (each process's PSS is at most its RSS, so below it no read can raise the peak). The
    refresh bounds what the estimate misses: a process's PSS moves without its RSS moving whenever
    another process of the tree forks, ends or writes to a page they share (a PSS kept from an
    earlier read put the fork server at 0.27 GiB of a 100k build's peak, against 0.18-0.21 GiB read
    anew). With at most one read a second (`PSS_EVERY_S`), a 1M build takes 60-120 reads and a 100k
    build 16-36 (more where the host is slow and the build runs longer: 96-120 and 18-36 on a host
    whose builds took 1.2-1.8 times the CPU), where a read at every new high of the RSS sum and at
    least once a second took ~200 at 1M (8-10 s of the bench's CPU, most of it the kernel's
    page-table walks; `MachineCores` reports it). Replayed on a 100k and a 1M build whose PSS was
    read at every sample (docs/scale-history.md), the rule finds the same peak."""

    # How often the tree's processes are listed.
    LIST_EVERY_S = 1.0
    # PSS is read when its estimate comes this close to the peak, and at least this often, but not
    # more often than this: a read walks each process's page tables in the kernel (~10 ms for a 1 GiB
    # worker), and read at every sample where the estimate allowed it (~50 times in a 100k build)
    # the reads made the build ~3 % slower, its workers' CPU included.
    PSS_MARGIN = 32 << 20
    PSS_REFRESH_S = 5.0
    PSS_EVERY_S = 1.0

    def __init__(self, proc: psutil.Process):
        self.proc, self.cpu, self.roles = proc, {}, {}
        self.peak_rss = self.peak_pss = self.pss_reads = 0
        # Where the peak PSS was: by role (`_role`), and when (seconds since the first sample).
        self.peak_pss_by_role: dict[str, int] = {}
        self.peak_pss_at = 0.0
        self._last_pss_read = self._last_listing = float("-inf")
        self._procs: list[psutil.Process] = []
        # pid -> what its RSS overstated its PSS by at its last PSS read (the pages it shares).
        self._shared: dict[int, int] = {}
        # (seconds since the first sample, CPU seconds of the tree so far, the tree's RSS) at every sample.
        self.series: list[tuple[float, float, int]] = []
        self._start = time.perf_counter()

    def _role(self, p: psutil.Process) -> str:
        """What a process of a build's tree is: the command, Prefect's temporary server, the fork
        server (its parent is the command), a worker (forked by the fork server), or other."""
        if p.pid == self.proc.pid:
            return "command"
        cmdline = " ".join(p.cmdline())
        if "uvicorn" in cmdline:
            return "server"
        if "multiprocessing.forkserver" in cmdline:
            return "fork server" if p.ppid() == self.proc.pid else "worker"
        return "other"

    def sample(self) -> None:
        now = time.perf_counter()
        if now - self._last_listing >= self.LIST_EVERY_S:
            try:
                self._procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.Error:
                pass
            self._last_listing = now
        rss, alive, estimate = 0, [], 0
        for p in self._procs:
            try:
                with p.oneshot():
                    own, times = p.memory_info().rss, p.cpu_times()
                    if p.pid not in self.roles:
                        self.roles[p.pid] = self._role(p)
                rss += own
                estimate += max(0, own - self._shared.get(p.pid, 0))
                self.cpu[p.pid] = times.user + times.system
                alive.append(p)
            except psutil.Error:
                pass
        if rss > self.peak_pss and now - self._last_pss_read >= self.PSS_EVERY_S and (
                estimate > self.peak_pss - self.PSS_MARGIN or now - self._last_pss_read >= self.PSS_REFRESH_S):
            by_role: dict[str, int] = {}
            for p in alive:
                try:
                    memory = p.memory_full_info()
                except psutil.Error:
                    continue
                by_role[self.roles[p.pid]] = by_role.get(self.roles[p.pid], 0) + memory.pss
                self._shared[p.pid] = memory.rss - memory.pss
            pss = sum(by_role.values())
            if pss > self.peak_pss:
                self.peak_pss, self.peak_pss_by_role, self.peak_pss_at = pss, by_role, now - self._start
            self._last_pss_read = now
            self.pss_reads += 1
        self.peak_rss = max(self.peak_rss, rss)
        self.series.append((now - self._start, sum(self.cpu.values()), rss))

    def cpu_by_role(self) -> dict[str, tuple[int, float]]:
        """role -> (processes, CPU seconds)."""
        out: dict[str, tuple[int, float]] = {}
        for pid, seconds in self.cpu.items():  # a pid's role is set in the sample that first reads its CPU
            n, total = out.get(self.roles[pid], (0, 0.0))
            out[self.roles[pid]] = (n + 1, total + seconds)
        return out

    def busy_cores(self, window: float) -> list[tuple[float, float, int]]:
        """(start, cores busy on average, the tree's highest RSS) of each `window` seconds of the
        samples: where a build leaves cores idle (start-up, a step's tail, a stage in the flow
        alone), and where its memory peaks."""
        out, first = [], 0
        for i, (t, cpu, _) in enumerate(self.series):
            t0, cpu0, _ = self.series[first]
            if t - t0 >= window or (i == len(self.series) - 1 and t > t0):
                out.append((t0, (cpu - cpu0) / (t - t0), max(rss for _, _, rss in self.series[first:i + 1])))
                first = i
        return out


class MachineCores:
    """The machine's core-seconds between `__init__` and `spent` (psutil's system-wide CPU times:
    every core, every process, the kernel), split as the build's tree used them and the rest."""

    def __init__(self):
        self.start, self.own_start = psutil.cpu_times(), time.process_time()

    def spent(self, tree_cpu: float) -> dict[str, float]:
        """Core-seconds since the start: `build` (the tree's CPU, `tree_cpu`), `other` (busy, not
        with the tree: the kernel's threads, other processes, this bench's sampling (`sampling`,
        also given apart) and the time the host took (`steal`, also given apart)), `idle` and
        `io wait` (idle while a process waits on the disk)."""
        end = psutil.cpu_times()
        delta = {field: getattr(end, field) - getattr(self.start, field) for field in end._fields}
        busy = sum(delta.values()) - delta["idle"] - delta["iowait"] - delta.get("guest", 0) - delta.get("guest_nice", 0)
        return {"build": tree_cpu, "other": busy - tree_cpu, "idle": delta["idle"], "io wait": delta["iowait"],
                "sampling": time.process_time() - self.own_start, "steal": delta.get("steal", 0.0)}


# Log lines of `trajforge build -v` that end a phase (`--phases`): the phase's name, matched where the line says it.
PHASE_LINES = [("the flow began", re.compile(r"Beginning flow run")),
               ("the first unit", re.compile(r"Task run 'process-unit-.*Finished")),
               ("the map", re.compile(r"units done: (\d+)/\1 ")),
               ("step {}", re.compile(r"step ([a-z-]+): ")),
               ("the flow ended", re.compile(r"Flow run 'build .*Finished"))]


def phase_of(line: str) -> str | None:
    """The phase a log line of `trajforge build -v` ends (`PHASE_LINES`), if any."""
    for name, pattern in PHASE_LINES:
        if (found := pattern.search(line)) is not None:
            return name.format(*found.groups())  # a name without a field ignores the groups
    return None


def run_build(corpus: Path, out: Path, runner: str, timeout: float,
              phases: list[tuple[str, float]] | None = None) -> tuple[float, TreeSampler, int]:
    """(wall seconds, the process tree's sampler (peak RSS and PSS, CPU by process), return code) of `trajforge build`;
    with `phases` (a list), the build logs its steps (`-v`) and each phase's end goes into it, (name, seconds).

    CPU seconds are every process of the tree's, sampled with the memory (the workers are forked by
    a fork server, which the build does not wait for, so the build's own children times miss them;
    a process's last < 0.2 s before it ends is not counted); on a shared machine they say more
    than the wall time."""
    cmd = [str(Path(sys.executable).parent / "trajforge"), "build", "--out", str(out), "--runner", runner,
           *[a for d in sorted(corpus.iterdir()) for a in ("--source", f"{d.name}={d}")],
           *(["-v"] if phases is not None else [])]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps = psutil.Process(proc.pid)
    sampler = TreeSampler(ps)
    tail: list[str] = []

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail.append(line)
            del tail[:-40]
            if phases is not None and (phase := phase_of(line)) is not None:
                phases.append((phase, time.perf_counter() - start))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    while proc.poll() is None:
        sampler.sample()
        if time.perf_counter() - start > timeout:
            for p in [*ps.children(recursive=True), ps]:
                p.kill()
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=5)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write("".join(tail))
    return wall, sampler, proc.returncode


def quality(out: Path, counts: dict) -> dict:
    """Recall of the planted copies and false merges, from the duplicates map."""
    dups = pq.read_table(out / "duplicates.parquet", columns=["id", "kept_id", "match"]).to_pylist()
    found, false = 0, 0
    for d in dups:
        a, b = FAMILY.search(d["id"]), FAMILY.search(d["kept_id"])
        if a is None or b is None or a.group(1) != b.group(1):
            false += 1
        else:
            found += 1
    # A copy of an original that fails validation is quarantined with it: not a duplicate to find.
    quarantined = sum(1 for sid in pq.read_table(out / "quarantine" / "quarantine.parquet", columns=["source_id"])
                      .column("source_id").to_pylist() if sid and (m := FAMILY.search(sid)) and m.group(2) != "0")
    planted = counts["exact"] + counts["near"] - quarantined
    return {"planted": planted, "found": found, "recall": found / max(1, planted), "false_merges": false,
            "duplicates": len(dups)}


def bytes_line(out: Path, n: int, fixtures: Path, seed: int = 0) -> str | None:
    """How the build's published files compare with the digest kept for a corpus of `n` drawn with
    `seed` (sha256, bench/build_digest.py), where the corpus is made of the default fixtures; None
    otherwise."""
    from bench.build_digest import REFERENCES, comparison, digests

    if fixtures.resolve() != (REPO / "tests" / "fixtures" / "raw").resolve():
        return None
    reference = REFERENCES / (f"generated-{n}.json" if seed == 0 else f"generated-{n}-seed{seed}.json")
    if not reference.exists():
        return (f"published files: no digest kept for {n} at seed {seed} "
                f"(python bench/build_digest.py {out} > {reference.relative_to(REPO)})")
    lines = comparison(digests(out), json.loads(reference.read_text()))
    return f"published files: {lines[-1]} to {reference.relative_to(REPO)}" + "".join(f"\n  {line}" for line in lines[:-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("n", type=int, help="trajectories in the corpus")
    p.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    p.add_argument("--seed", type=int, default=0, help="the corpus's random draw (0, the default, and 1 have digests kept in bench/digests)")
    p.add_argument("--work", type=Path, default=None, help="folder for the corpus and the build (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--runner", default="processes")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--timeline", type=float, default=0, metavar="S",
                   help="also print the cores the build's processes kept busy, and their highest RSS, in windows of S seconds")
    p.add_argument("--phases", action="store_true",
                   help="run the build with -v and print when each of its phases ended (its log lines timed)")
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_build_"))
    try:
        corpus = work / "corpus"
        if (work / "planted.json").exists():
            counts = json.loads((work / "planted.json").read_text())
            # A work folder kept from before seeds were chosen holds the default draw.
            if (held := counts.pop("seed", 0)) != args.seed:
                sys.exit(f"{work} holds the corpus of seed {held}, not {args.seed}: give this one its own --work")
        else:
            t0 = time.perf_counter()
            counts = generate(args.fixtures, args.n, corpus, args.seed)
            (work / "planted.json").write_text(json.dumps({**counts, "seed": args.seed}))
            print(f"corpus: {args.n} trajectories in {time.perf_counter() - t0:.0f} s, {counts}")
        size = read_through(corpus)
        print(f"interpreter: {interpreter()}; fixed Python loop {python_speed():.2f} s of CPU")
        before, rows = floor_runs(corpus, work / "floor")
        print(f"I/O floor: {rows} rows, {size / 1e6:.0f} MB upstream, {_runs(before)}; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        out = work / "build"
        shutil.rmtree(out, ignore_errors=True)
        cores = MachineCores()
        phases: list[tuple[str, float]] | None = [] if args.phases else None
        wall, tree, rc = run_build(corpus, out, args.runner, args.timeout, phases)
        cpu_s = sum(tree.cpu.values())
        spent = cores.spent(cpu_s)
        # The floor again after the build: a shared machine's speed drifts over minutes (the same
        # floor ran 29-41 s within an hour at 1M), so the build is set against the floor on both sides of it.
        after, _ = floor_runs(corpus, work / "floor")
        floor_s = statistics.median(before + after)
        print(f"I/O floor after the build: {_runs(after)}; the floor {floor_s:.2f} s (median of both sides' runs)")
        line = (f"build ({args.runner}): rc {rc}, wall {wall:.1f} s = {wall / floor_s:.2f}x the floor, CPU "
                f"{cpu_s:.0f} s ({cpu_s / rows * 1e3:.3f} ms a record), peak RSS {tree.peak_rss / 2**30:.2f} GiB (PSS {tree.peak_pss / 2**30:.2f} "
                f"GiB, {tree.pss_reads} reads), {rows / wall:.0f} rows/s")
        if rc == 0:
            report = json.loads((out / "report.json").read_text())
            q = quality(out, counts)
            line += (f"; read {report['total']['read']}, written {report['total']['written']}, quarantined "
                     f"{report['total']['quarantined']}; duplicates {q['duplicates']}, recall {q['recall']:.4f} "
                     f"({q['found']}/{q['planted']}), false merges {q['false_merges']}")
        print(line)
        if rc == 0 and (same := bytes_line(out, args.n, args.fixtures, args.seed)) is not None:
            print(same)
        print("CPU by process: " + ", ".join(f"{role} {seconds:.1f} s" + (f" ({n})" if n > 1 else "")
                                             for role, (n, seconds) in sorted(tree.cpu_by_role().items())))
        print(f"the machine's {os.cpu_count()} cores over the build ({os.cpu_count() * wall:.0f} core-s): "
              f"the build {spent['build']:.1f} s, other work {spent['other']:.1f} s (this bench's sampling "
              f"{spent['sampling']:.1f}, steal {spent['steal']:.1f}), idle {spent['idle']:.1f} s, "
              f"waiting on the disk {spent['io wait']:.1f} s")
        print(f"PSS at its peak ({tree.peak_pss_at:.0f} s into the build): " + ", ".join(
            f"{role} {pss / 2**30:.2f} GiB" for role, pss in sorted(tree.peak_pss_by_role.items())))
        if phases is not None:
            ended = dict(reversed(phases))  # each phase's first line
            shards = ended.get("step write-file")
            in_order = sorted(ended.items(), key=lambda kv: kv[1])
            tail = f"; from the last shard to the exit {wall - shards:.2f} s" if shards is not None else ""
            print("phases, s from the build's start: " + ", ".join(f"{name} {at:.1f}" for name, at in in_order)
                  + f", exit {wall:.1f}{tail}")
        if args.timeline:
            windows = tree.busy_cores(args.timeline)
            print(f"cores busy and the tree's highest RSS (GiB), {args.timeline:g} s windows from the build's start:")
            for i in range(0, len(windows), 8):
                print("  " + " ".join(f"{t:.0f}:{cores:.2f}/{rss / 2**30:.2f}" for t, cores, rss in windows[i:i + 8]))
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
