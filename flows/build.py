"""The build flow: sources -> normalize/validate per file -> merged dataset, quarantine, report.

Only composition lives here; the stages are plain functions in pipeline/.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.task_runners import ThreadPoolTaskRunner

from pipeline.build import BuildConfig, UnitResult, finalize, process_unit, summary_lines
from sources import DEFAULT_SOURCES, SourceFile, get_source


@task(name="resolve-source", retries=2, retry_delay_seconds=5)
def resolve_source(name: str, location: str | None) -> list[SourceFile]:
    """List a source's data files; downloads from the Hub when `location` is a repo id or None."""
    return get_source(name).files(location)


@task(name="process-unit")
def process_unit_task(name: str, file: SourceFile, staging: str, config: BuildConfig) -> UnitResult:
    return process_unit(name, file, Path(staging), config)


@task(name="finalize")
def finalize_task(units: list[UnitResult], out: str, config: BuildConfig) -> dict:
    return finalize(units, Path(out), config)


@flow(name="build-dataset", task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=True)
def build_dataset(sources: dict[str, str | None] | None = None, out: str = "build",
                  rendering: str = "native") -> dict:
    """Build the dataset. `sources` maps a source name to a local path or Hub repo id (None: its Hub repo)."""
    logger = get_run_logger()
    sources = sources or {name: None for name in DEFAULT_SOURCES}
    config = BuildConfig(rendering=rendering)
    out_dir = Path(out)
    staging = out_dir / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    files = {name: resolve_source(name, location) for name, location in sources.items()}
    total = sum(len(f) for f in files.values())
    futures = [process_unit_task.submit(name, file, str(staging), config)
               for name, source_files in files.items() for file in source_files]
    units = []
    for done, future in enumerate(futures, 1):
        units.append(future.result())
        logger.info("units done: %d/%d (%s/%s)", done, total, units[-1].source, units[-1].source_file)
    report = finalize_task(units, str(out_dir), config)
    for line in summary_lines(report):
        logger.info(line)
    return report
