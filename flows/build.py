"""The build flow: sources -> normalize/validate per file -> merged dataset, shards, card, manifest.

Only composition lives here; the stages are plain functions in pipeline/.

- Scale-out: the build runs in a subflow whose task runner is a parameter (`processes`, `threads`,
  or `dask` / `ray` on a local cluster or at a cluster address; `auto`: threads for a small input,
  processes otherwise), so a deployment can pick it too. `pipeline.build.build_in_process` is the
  same build without Prefect, which the CLI runs for a small input when no Prefect server is set.
  The per-file units and the per-unit steps of the second half (pools, outputs) run on it; the
  global stages (dedup, ids) run in the flow on the units' compact key tables.
- Resume: a unit is done once its completion marker (written after its staged files) names the
  same input fingerprint; its result is also persisted by Prefect under `<out>/.staging/results`.
  A rerun after a crash, even a SIGKILL, redoes only the units and shards that had not finished.
  (SIGTERM and Ctrl-C: flows/stopping.py.)
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import shutil
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import wait
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

from trajforge.flows.artifacts import Progress, build_artifacts
from trajforge.flows.config import AUTO, BuildRun, auto_runner, build_run, stage_config
from trajforge.flows.names import build_run_name
from trajforge.flows.settings_memo import remember_settings_context
from trajforge.flows.stopping import end_with_owner
from trajforge.flows.workers import fork_server_available, preload
from trajforge.pipeline.build import (
    BuildConfig,
    UnitResult,
    finalize,
    resume_unit,
    staging_folder,
    unit_bar,
    units_done,
)
from trajforge.pipeline.publish.manifest import code_version
from trajforge.pipeline.registry import Registry
from trajforge.pipeline.stages import release_freed_memory
from trajforge.sources import DEFAULT_SOURCES, SourceError, SourceFile, check_layout, get_source

# The CLI offers the names of flows.config.RUNNERS without loading Prefect; the two must agree (tested).
TASK_RUNNERS = Registry("runner")


def _start_worker(env: dict[str, str], owner_pid: int) -> None:
    """A worker process's initializer: this run's Prefect API, so that it starts no server of its own;
    its end once the flow's process (`owner_pid`) has ended, however that ended; and, where the runner
    was told this run's API, one Prefect client to it for the worker's life (`SyncClientContext`,
    which a task run's engine takes where one is open). Without it each task run makes two, and each
    loads the CA bundle into a new TLS context (~28 ms of CPU, even for a plain-HTTP API) and opens
    a new connection."""
    os.environ.update(env)
    end_with_owner(owner_pid)
    remember_settings_context()
    if "PREFECT_API_URL" not in env:
        # The worker's own settings are the fork server's, from before this run: a client from them
        # could reach another (or a new) server. Task runs then make their own, from the run's settings.
        return
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # The environment set above does not reach settings Prefect has already loaded (the fork server's).
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        SyncClientContext().__enter__()  # left open: the process ends with it


def process_workers(workers: int) -> int:
    """Worker processes of the `processes` runner: more than cores only add memory (an interpreter
    and a batch each)."""
    return max(1, min(workers, os.cpu_count() or 1))


class ForkedProcessPoolTaskRunner(ProcessPoolTaskRunner):
    """Prefect's ProcessPoolTaskRunner whose workers are forked from the fork server
    (flows/workers.py), with the build's modules loaded, rather than spawned as new interpreters
    that import them each (~3 s of CPU a worker, before its first unit). Where there is no fork
    server, it is Prefect's runner as it is."""

    def __enter__(self):
        super().__enter__()
        # Each submit sends the run's settings: dumped once a run, not once a task (flows/settings_memo.py).
        remember_settings_context()
        if fork_server_available():
            # Not started here: each task run in a worker enters a copy of its flow's runner too
            # (and submits nothing). Prefect's executor has started no process yet (a
            # ProcessPoolExecutor starts them at its first submit): the same one, on the fork server.
            preload()
            spawning = self._executor
            self._executor = ProcessPoolExecutor(max_workers=self._max_workers,
                                                 mp_context=multiprocessing.get_context("forkserver"),
                                                 initializer=spawning._initializer, initargs=spawning._initargs)
            spawning.shutdown(wait=False)
        return self


@TASK_RUNNERS.register("processes")
def _processes(address: str | None, workers: int, env: dict[str, str]):
    # Units are CPU-bound Python (parsing, normalizing, MinHash): processes use every core, threads
    # only one (the GIL).
    return ForkedProcessPoolTaskRunner(max_workers=process_workers(workers),
                                       initializer=_start_worker, initargs=(env, os.getpid()))


@TASK_RUNNERS.register("threads")
def _threads(address: str | None, workers: int, env: dict[str, str]):
    return ThreadPoolTaskRunner(max_workers=workers)


@TASK_RUNNERS.register("dask")
def _dask(address: str | None, workers: int, env: dict[str, str]):
    from prefect_dask import DaskTaskRunner

    if address:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1,
                                          "dashboard_address": None, "env": env})


@TASK_RUNNERS.register("ray")
def _ray(address: str | None, workers: int, env: dict[str, str]):
    from prefect_ray import RayTaskRunner

    if address:
        return RayTaskRunner(address=address)
    return RayTaskRunner(init_kwargs={"num_cpus": workers, "include_dashboard": False,
                                      "runtime_env": {"env_vars": env}})

def make_task_runner(runner: str = "processes", address: str | None = None, workers: int = BuildRun.workers,
                     api_url: str | None = None):
    """The task runner for the units: processes or threads here, or a Dask / Ray cluster (local when no address).

    Workers of a local cluster are told the Prefect API of this run (`api_url`): without it each
    worker process of an embedded-mode run starts its own temporary server (a minute each on a
    small machine). Workers of a remote cluster need PREFECT_API_URL in their own environment.
    """
    return TASK_RUNNERS[runner](address, workers, {"PREFECT_API_URL": api_url} if api_url else {})


def step_tasks(runner: str, address: str | None, workers: int) -> int | None:
    """Tasks per step of the second half: one per worker on a local runner (each takes the step's
    calls one at a time: `on_task_runner`); None on a cluster at an address, whose size is not known
    here (`build_units` asks the entered runner: `cluster_workers`)."""
    if address:
        return None
    return process_workers(workers) if runner == "processes" else workers


def cluster_workers(task_runner) -> int | None:
    """Workers of a cluster at an address as its runner tells them once entered (the flow's): a Dask
    cluster's threads, a Ray cluster's CPUs; None where it does not say (a task per call then)."""
    kind = type(task_runner).__name__
    if kind == "DaskTaskRunner":  # its client: made at its first submit (the units'), else here
        return sum(task_runner.client.nthreads().values()) or None
    if kind == "RayTaskRunner":
        import ray

        return int(ray.cluster_resources().get("CPU", 0)) or None
    return None


def _worth_retrying(task, task_run, state) -> bool:
    """A SourceError (missing path, offline, 401/403/404 from the Hub) fails the same way again."""
    return not isinstance(state.result(raise_on_failure=False), SourceError)


@task(name="resolve-source", retries=2, retry_delay_seconds=5, retry_condition_fn=_worth_retrying)
def resolve_source(name: str, location: str | None, check: bool = True) -> list[SourceFile]:
    """List a source's data files; downloads from the Hub when `location` is a repo id or None.
    `check`: refuse files in another source's layout (ForeignLayout), unless the user said otherwise."""
    files = get_source(name).files(location)
    if check:
        check_layout(name, files)
    return files


def _unit_cache_key(context, parameters: dict) -> str:
    """Cheap identity of a unit for Prefect's cache (the marker checks the content hash)."""
    file: SourceFile = parameters["file"]
    stat = file.path.stat()
    payload = [parameters["name"], str(file.path.resolve()), stat.st_size, stat.st_mtime_ns,
               asdict(parameters["config"]), parameters["staging"], code_version()]
    return "unit-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@task(name="process-unit", cache_key_fn=_unit_cache_key, persist_result=True)
def process_unit_task(name: str, file: SourceFile, staging: str, config: BuildConfig) -> UnitResult:
    result, earlier = resume_unit(name, file, Path(staging), config)
    if earlier:
        get_run_logger().info("%s/%s: done in an earlier run, skipped", name, file.label)
    return result


class StepCallsLost(RuntimeError):
    """A step of the second half whose tasks all returned, but not every call once (a task that died
    after claiming calls, and was run again by its cluster, does not return them)."""


@task(name="unit-step", cache_policy=NO_CACHE, persist_result=False)
def unit_step(function, calls_file: str, claims: str) -> tuple[list[tuple[int, object]], tuple[float, float]]:
    """Per-unit steps of the second half of a build (units' pools, units' outputs, band screens,
    the shards and the quarantine): the step's calls (`calls_file`: their order, the largest first,
    and the calls), each claimed by this task (`claim`) before it runs, one after the other, so that
    a task that is done early takes the next call. Returns (index, result) of the calls it ran and
    when the task ran (start and end, wall clock), which the flow logs per step."""
    start = time.time()
    # What the worker freed in its units or in the step before goes back to the system first: kept,
    # the map's and each step's pages stay with the worker through the rest of the build. Once a
    # step, not after every call: a call reuses the pages the one before it freed, and handing them
    # back after each call made ~50 % more page faults at 100k (~1-2 s more CPU).
    release_freed_memory()
    with open(calls_file, "rb") as f:
        order, calls = pickle.load(f)
    return [(i, function(*calls[i])) for i in order if claim(claims, i)], (start, time.time())


def claim(claims: str, index: int) -> bool:
    """Whether this task is the first to claim call `index` of a step: the claim is a file in the
    step's claims folder, made with O_CREAT | O_EXCL (atomic on a local filesystem and on NFS >= 3,
    for the threads of a process, its processes and a cluster's workers alike)."""
    try:
        os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def largest_first(sizes: list[int]) -> list[int]:
    """The calls (by index) by their expected work, the largest first (ties: in call order), so that
    no large call starts last and runs alone."""
    return sorted(range(len(sizes)), key=lambda i: -sizes[i])


def on_task_runner(function, calls: list[tuple], sizes: list[int] | None = None, meanwhile=None, *,
                   claims: Path, tasks: int | None = None) -> list:
    """`finalize`'s `map_units` on the flow's task runner, results in call order; `meanwhile()` runs
    here once the calls are submitted.

    A step's files go in a folder of its own under `claims` (on a filesystem the workers share: the
    build's staging folder), removed after it. With `tasks`, the step is `tasks` tasks that each read
    the whole call list, largest first by `sizes` (none: in call order), from one file written here,
    and claim the calls one at a time (`unit_step`): a worker that is done early takes the next call,
    whatever the estimates. Tasks are few because each costs Prefect ~0.1-0.3 s of CPU in the worker
    and in the flow; the calls go in a file rather than as the tasks' parameters, which Prefect walks
    (looking for futures) and pickles once a task. Without `tasks`: a task per call (a cluster at an address, its size unknown here)."""
    step = unit_step.with_options(name=function.__name__.replace("_", "-"))
    order = largest_first(sizes) if sizes else list(range(len(calls)))
    folder = claims / uuid.uuid4().hex
    start = time.time()
    if tasks is None:
        futures = [step.submit(function, *_step_file(folder / str(i), [0], [calls[i]])) for i in order]
        indices = [[i] for i in order]
    else:
        futures = [step.submit(function, *_step_file(folder, order, calls))
                   for _ in range(max(1, min(tasks, len(calls))))]
        indices = None
    try:
        if meanwhile is not None:
            meanwhile()
        wait(futures)
        returned = [future.result() for future in futures]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if indices is not None:  # a task per call: each ran its call 0 of its own file
        returned = [([(i, result) for (_, result) in done], span) for i, (done, span) in zip(order, returned)]
    results = _in_call_order(step.name, len(calls), [done for done, _ in returned])
    _log_step(step.name, len(calls), [span for _, span in returned], time.time() - start)
    return results


def _step_file(folder: Path, order: list[int], calls: list[tuple]) -> tuple[str, str]:
    """The calls file and claims folder of a step's task(s): the order and the calls, pickled once."""
    folder.mkdir(parents=True, exist_ok=True)
    calls_file = folder / "calls.pickle"
    if not calls_file.exists():
        with open(calls_file, "wb") as f:
            pickle.dump((order, calls), f, protocol=pickle.HIGHEST_PROTOCOL)
    claims = folder / "claims"
    claims.mkdir(exist_ok=True)
    return str(calls_file), str(claims)


def _in_call_order(name: str, calls: int, returned: list[list[tuple[int, object]]]) -> list:
    """The tasks' (index, result) pairs as the results in call order; StepCallsLost unless every
    call ran exactly once."""
    results: list = [None] * calls
    runs = [0] * calls
    for done in returned:
        for i, result in done:
            results[i] = result
            runs[i] += 1
    wrong = [i for i, n in enumerate(runs) if n != 1]
    if wrong:
        raise StepCallsLost(f"step {name}: {len(wrong)} of {calls} calls did not run exactly once "
                            f"(calls {wrong[:10]}{' ...' if len(wrong) > 10 else ''}: ran "
                            f"{[runs[i] for i in wrong[:10]]} times); the build stops rather than write "
                            "outputs without them")
    return results


def _log_step(name: str, calls: int, spans: list[tuple[float, float]], wall: float) -> None:
    """A step's wall time, its tasks' summed wall time, and how long its last task ran alone (its
    tail: the time another worker waited)."""
    ends = sorted(end for _, end in spans)
    alone = ends[-1] - ends[-2] if len(ends) > 1 else 0.0
    get_run_logger().info("step %s: %d calls in %d tasks, %.2f s, tasks %.2f s, last alone %.2f s",
                          name, calls, len(spans), wall, sum(end - start for start, end in spans), alone)


@flow(name="build-units")
def build_units(files: list[tuple[str, SourceFile]], staging: str, out: str, config: BuildConfig,
                step_tasks: int | None = None) -> dict:
    """The build on this flow's task runner: every unit is processed there (results in input
    order, deterministic), then the global stages run here on the key tables and the per-unit
    steps of the second half (pools, outputs) go back to the runner, in `step_tasks` tasks per step
    (None: as many as the cluster's workers, `cluster_workers`, else a task per call). Returns the report."""
    units = process_units(files, staging, config)
    tasks = step_tasks or cluster_workers(FlowRunContext.get().task_runner)
    # A step's claims are in a folder of their own, removed after it; any here are a crashed run's.
    claims = Path(staging) / "claims"
    shutil.rmtree(claims, ignore_errors=True)
    report = finalize(units, Path(out), config, map_units=partial(on_task_runner, tasks=tasks, claims=claims))
    shutil.rmtree(claims, ignore_errors=True)
    return report


def _expected_bytes(file: SourceFile) -> int:
    """A unit's expected work: the uncompressed size of a Parquet file, the size of any other."""
    if file.path.suffix == ".parquet":
        meta = pq.read_metadata(file.path)
        return sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    return file.path.stat().st_size


def process_units(files: list[tuple[str, SourceFile]], staging: str, config: BuildConfig) -> list[UnitResult]:
    """Run every unit on the flow's task runner, the largest first (so that no large unit starts
    last and runs alone); results come back in input order (deterministic)."""
    logger = get_run_logger()
    unit = process_unit_task.with_options(result_storage=Path(staging) / "results")
    futures: list = [None] * len(files)
    for i in sorted(range(len(files)), key=lambda i: -_expected_bytes(files[i][1])):
        futures[i] = unit.submit(files[i][0], files[i][1], staging, config)
    progress = Progress("build-progress", f"Source files normalized and validated (of {len(files)})")
    units = []
    with unit_bar(len(files)) as bar:
        for done, future in enumerate(futures, 1):
            units.append(future.result())
            progress(done, len(futures))
            bar.update()
            logger.info(units_done(done, len(futures), units[-1]))
    return units


@flow(name="build-dataset", log_prints=True, flow_run_name=build_run_name)
def build_dataset(sources: dict[str, str | None] | None = None, out: str | None = None, rendering: str | None = None,
                  runner: str | None = None, address: str | None = None, workers: int | None = None,
                  shard_rows: int | None = None, decontaminate: str | None = None,
                  dedup_threshold: float | None = None, synthetic: str | None = None,
                  rl_tasks: list[str] | None = None, stages: dict | None = None,
                  source_as: list[str] | None = None, config: dict | None = None) -> dict:
    """Build the dataset. `sources` maps a source name to a local path or Hub repo id (None: its Hub repo).

    `config` is a build config (the shape of `flows.config.BuildRun`, as in configs/build.yaml);
    the other parameters override it where given (flows/config.py: BUILD places each), and what
    neither sets keeps the dataclasses' default. `stages` is the stages' configuration
    (`pipeline.build.BuildConfig` as a nested mapping, the `stages` section of a config).

    `synthetic` is the output folder of the synthesis flow, read as one more source (`synthetic`).

    `runner`/`address` choose where the units run (processes, threads, or a Dask / Ray cluster;
    `auto`: threads for a small input, processes otherwise); the output is byte-identical whichever
    is used. `shard_rows` caps the rows per Parquet shard (default: by size).
    `decontaminate` is a file of evaluation tasks whose trajectories are quarantined;
    `dedup_threshold` the Jaccard similarity from which two trajectories are near duplicates.
    `rl_tasks` are task files whose tasks join the `grpo_env` config.
    `source_as` names the sources whose files are read as that source although they look like
    another's (`--source-as`); any other source in another's layout fails the run (ForeignLayout).
    """
    run = build_run(dict(sources=sources, out=out, rendering=rendering, runner=runner, address=address,
                         workers=workers, shard_rows=shard_rows, decontaminate=decontaminate,
                         dedup_threshold=dedup_threshold, rl_tasks=rl_tasks, stages=stages, source_as=source_as),
                    "build config", config)
    sources = dict(run.sources or dict.fromkeys(DEFAULT_SOURCES))
    if synthetic:
        sources["synthetic"] = synthetic
    settings = stage_config(run.stages, "stages")
    out_dir = Path(run.out)
    staging = staging_folder(out_dir)
    files = [(name, f) for name, location in sources.items()
             for f in resolve_source(name, location, check=name not in run.source_as)]
    runner = auto_runner(sum(f.path.stat().st_size for _, f in files)) if run.runner == AUTO else run.runner
    api_url = str(FlowRunContext.get().client.api_url)
    report = build_units.with_options(task_runner=make_task_runner(runner, run.address, run.workers, api_url))(
        files, str(staging), str(out_dir), settings, step_tasks(runner, run.address, run.workers))
    # The CLI prints the summary table; deployment runs have report.json, report.html and the artifacts.
    build_artifacts(report, run.out)
    return report
