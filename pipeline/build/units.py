"""The map half of a build: one unit per (source, file), each row through the map stages.

`process_unit` reads, normalizes and validates one file and writes its records, their key table
(pipeline/build/assemble.py) and its quarantine entries to the staging folder; each map stage counts
what it kept and dropped in a `StageTally` (pipeline/stages.py). Units are independent and
picklable, so a flow can run them on threads or on a cluster; `finalize` (pipeline/build/second_half.py)
merges them.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from trajforge.pipeline.atomic import StreamingTable
from trajforge.pipeline.build.assemble import KeysWriter
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.ingest.normalize import NormalizeConfig, NormalizeError, normalize_row
from trajforge.pipeline.ingest.validate import ValidateConfig, check_record, tally_env
from trajforge.pipeline.publish.manifest import file_sha256
from trajforge.pipeline.quarantine import quarantine_entry, shown
from trajforge.pipeline.stages import Dropped, StageTally, cyclic_gc_paused
from trajforge.schemas import arrow_schema
from trajforge.sources import RawRow, SourceFile, get_source, iter_rows, looks_like
from trajforge.sources.locate import hub_revision

log = logging.getLogger("trajforge.build")


@dataclass
class UnitResult:
    """What one unit wrote and counted; small enough to pass between processes."""
    source: str
    source_file: str
    records_path: str
    quarantine_path: str
    # The map stages' tallies (`StageTally.as_dict()`), in stage order: read, normalize, validate, stage.
    stages: list[dict] = field(default_factory=list)
    # Provenance for the card and the build id: the input's content and its Hub commit, if any.
    input_sha256: str = ""
    revision: str | None = None
    # Per env: records validated, trained actions checked/valid by grammar, quarantined by rule.
    envs: dict[str, dict] = field(default_factory=dict)
    # Something about the file itself worth a line in the report (an empty file).
    note: str | None = None
    # The other source whose layout the file has (read as this source at the user's word, --source-as).
    looks_like: str | None = None
    # The unit's key table (pipeline/build/assemble.py), staged next to its records.
    keys_path: str = ""
    # The input file (a synthetic unit's tree-search data lies next to it: pipeline/quality/search_steps.py).
    input_path: str = ""

    @property
    def read(self) -> int:
        """Upstream rows read: what came into the first stage."""
        return self.stages[0]["in"] if self.stages else 0

    @property
    def written(self) -> int:
        """Records staged: what the last stage kept."""
        return self.stages[-1]["kept"] if self.stages else 0

    @property
    def reasons(self) -> dict[str, int]:
        """Rows quarantined by reason, over every stage."""
        return dict(sum((Counter(stage["dropped"]) for stage in self.stages), Counter()))

    @property
    def quarantined(self) -> int:
        return sum(self.reasons.values())


def unit_key(source: str, file: SourceFile) -> str:
    digest = hashlib.sha1(str(file.path.resolve()).encode()).hexdigest()[:8]
    return f"{source}__{file.path.stem}__{digest}"


def unit_files(staging: Path, key: str) -> dict[str, Path]:
    """Where the unit `key` stages its records (an Arrow IPC file: the second half reads it in
    several passes, so it is cheap to read), its quarantine entries and its key table, by their
    `UnitResult` field."""
    return {"records_path": staging / f"{key}.records.arrow", "quarantine_path": staging / f"{key}.quarantine.parquet",
            "keys_path": staging / f"{key}.keys.parquet"}


# -- the map stages: one record at a time, each returns it (in its next form) or why it dropped it

def read_stage(raw: RawRow) -> RawRow | Dropped:
    """The reader's own verdict on a row: decoded, or why not (truncated, malformed JSON, ...)."""
    if raw.error:
        return Dropped(raw.error, raw.detail or "")
    return raw


def normalize_stage(raw: RawRow, source, file: SourceFile, config: NormalizeConfig) -> dict | Dropped:
    """The upstream row as a record of our schema."""
    try:
        return normalize_row(raw.row, source, file.split, file.label, raw.index, config)
    except NormalizeError as exc:
        upstream_id = raw.row.get("id", raw.row.get("item_id"))
        return Dropped(exc.reason, exc.detail, str(upstream_id) if isinstance(upstream_id, (str, int)) else None)


def validate_stage(record: dict, config: ValidateConfig, envs: dict[str, dict]) -> dict | Dropped:
    """A positive record that breaks no rule, as validation writes it (refused steps masked, per
    `invalid_steps`); negatives pass unchecked (their faults are the point). Positives also count
    into `envs`, the per-env validation figures of the unit."""
    if record["kind"] != "positive":
        return record
    checked = check_record(record, config)
    tally_env(envs, record, checked)
    if checked.violation is not None:
        return Dropped(checked.violation.reason, checked.violation.detail, record["source_id"])
    return checked.record


MapStage = Callable[[object], object]  # one item in; its next form, or a Dropped
# The stage that writes the records to the unit's staging file (Arrow may refuse a row).
WRITE_STAGE = "stage"


def map_stages(source, file: SourceFile, config: BuildConfig, envs: dict[str, dict]) -> list[tuple[str, MapStage]]:
    """The stages every row of a unit goes through, in order, bound to the unit's source and config
    (by closures: a partial's keyword arguments cost a dict a call)."""
    normalize, validate = config.normalize, config.validate
    return [("read", read_stage),
            ("normalize", lambda raw: normalize_stage(raw, source, file, normalize)),
            ("validate", lambda record: validate_stage(record, validate, envs))]


def run_stages(item, stages: list[tuple[str, MapStage]], tallies: list[StageTally], unit: str, index: int,
               rows: int = 1):
    """`item`, row `index` of `unit`, through each stage in order, each counting it (as `rows` rows)
    in its tally; the last stage's output, or the first Dropped. An exception no stage foresaw drops
    the item as `internal_error` of that stage instead of ending the build."""
    for (name, stage), tally in zip(stages, tallies):
        try:
            item = stage(item)
        except Exception as exc:
            item = _internal_error(f"{unit} row {index} ({name})", exc)
        if isinstance(item, Dropped):
            tally.drop(item.reason, rows)
            return item
        tally.keep(rows)
    return item


def _internal_error(what: str, exc: BaseException, source_id: str | None = None) -> Dropped:
    """An unexpected exception as a drop: its type and message in the detail, its traceback in the log."""
    log.warning("%s: internal error", what, exc_info=exc)
    return Dropped("internal_error", f"{type(exc).__name__}: {exc}"[:1000], source_id)


def process_unit(source_name: str, file: SourceFile, staging: Path, config: BuildConfig = BuildConfig(),
                 input_sha256: str | None = None) -> UnitResult:
    """Read one file of one source, run every row through the map stages, stage the results
    (`input_sha256`: the file's, when the caller hashed it already).

    Every row ends as a staged record or a quarantine entry (the first stage that dropped it,
    with its reason), whatever it holds; each stage's tally counts what it kept and dropped.
    """
    source = get_source(source_name)
    name = file.label
    unit = f"{source_name}/{name}"
    key = unit_key(source_name, file)
    envs: dict[str, dict] = {}
    stages = map_stages(source, file, config, envs)
    tallies = [StageTally(stage) for stage, _ in stages]
    writing = StageTally(WRITE_STAGE)
    files = unit_files(staging, key)
    quarantine = StreamingTable(files["quarantine_path"], arrow_schema("quarantine"))

    def reject(index: int, dropped: Dropped, raw: str | None) -> None:
        quarantine.append(quarantine_entry(source_name, name, index, dropped.source_id, dropped.reason,
                                           dropped.detail, raw))

    def refused(record: dict, exc: Exception) -> None:
        index = json.loads(record["meta"]).get("source_index", -1)
        dropped = _internal_error(f"{unit} row {index} (writing)", exc, record["source_id"])
        writing.drop(dropped.reason)
        reject(index, dropped, shown(record))

    def written(rows: list[dict], staged: pa.Table) -> None:
        writing.keep(len(rows))
        keys.extend(rows, staged)

    keys = KeysWriter(files["keys_path"], config)
    records = StreamingTable(files["records_path"], arrow_schema("trajectory"), on_refused=refused, on_written=written)
    rows = iter_rows(file.path, name)
    with cyclic_gc_paused():
        next_index = 0
        while True:
            try:
                raw = next(rows)
            except StopIteration:
                break
            except Exception as exc:  # a reader bug: the rest of the file is one drop of the read stage, the build goes on
                dropped = _internal_error(f"{unit} reading from row {next_index}", exc)
                tallies[0].drop(dropped.reason)
                reject(next_index, replace(dropped, detail=dropped.detail + f"; rows from {next_index} on were not read"),
                       None)
                break
            next_index = raw.index + raw.rows
            record = run_stages(raw, stages, tallies, unit, raw.index, raw.rows)
            if isinstance(record, Dropped):
                reject(raw.index, record, raw.raw_text if raw.raw_text is not None or raw.row is None else shown(raw.row))
                continue
            records.append(record)
            if tallies[-1].kept % config.progress_every == 0:
                log.info("%s/%s: %d records so far", source_name, name, tallies[-1].kept)
    records.close()
    quarantine.close()
    keys.close()
    foreign = looks_like(source_name, file.path)
    result = UnitResult(source_name, name, str(records.path), str(quarantine.path), keys_path=str(keys.path),
                        stages=[tally.as_dict() for tally in [*tallies, writing]], envs=envs,
                        input_sha256=input_sha256 or file_sha256(file.path), revision=hub_revision(file.path), input_path=str(file.path),
                        note="empty file: no records" if file.path.stat().st_size == 0 else None,
                        looks_like=foreign[0] if foreign else None)
    log.info("%s/%s: read %d, valid %d, quarantined %d %s", source_name, name, result.read, result.written,
             result.quarantined, result.reasons or "")
    return result


def units_done(done: int, total: int, unit: UnitResult) -> str:
    """The log line of a build after each unit."""
    return f"units done: {done}/{total} ({unit.source}/{unit.source_file})"


def unit_bar(total: int):
    """A progress bar of the units on a terminal (stderr); nothing elsewhere (a log file, a worker)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="source files", unit="file", disable=None, leave=False)
