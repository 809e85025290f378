"""The ingest stages of a build, as plain functions (no Prefect here).

A build is split in units, one per (source, file): `process_unit` reads, normalizes and validates
one file and writes its records and quarantine entries to a staging folder. `finalize` merges the
units in a fixed order, makes ids unique, and writes the dataset, the quarantine and the report.
Units are independent and picklable, so a flow can run them on threads or on a cluster.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from trajforge.pipeline.assemble import (
    OUTPUTS,
    KeysWriter,
    first_task_rows,
    global_duplicates,
    key_table,
    unique_ids,
    unit_pools,
    with_unique_ids,
    write_unit,
)
from trajforge.pipeline.atomic import StreamingParquet, remove_stale_temp_files, write_json, write_parquet
from trajforge.pipeline.envs.tasks import load_tasks
from trajforge.pipeline.evaluation.splits import declared_held_out
from trajforge.pipeline.ingest.normalize import NormalizeConfig, NormalizeError, normalize_row
from trajforge.pipeline.ingest.validate import ValidateConfig, check_record, merge_env_figures, tally_env
from trajforge.pipeline.publish.card import hub_revision, write_card
from trajforge.pipeline.publish.manifest import (
    GENERATOR,
    build_id,
    code_version,
    file_sha256,
    remove_earlier_files,
    set_manifest_aside,
    write_manifest,
)
from trajforge.pipeline.publish.report import report_extras, stage_counts, write_html
from trajforge.pipeline.publish.shards import (
    ShardConfig,
    read_marker,
    unit_fingerprint,
    unit_marker,
    write_config_from_file,
    write_marker,
)
from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.pipeline.quality.derived import grpo_env_row, reference_answer
from trajforge.pipeline.quality.negatives import NegativesConfig
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.quality.search_steps import stage_step_rows
from trajforge.pipeline.quarantine import quarantine_entry, shown
from trajforge.pipeline.stages import Dropped, StageTally, in_order, merge_tallies
from trajforge.schemas import arrow_schema
from trajforge.sources import RawRow, SourceFile, get_source, iter_rows, looks_like

log = logging.getLogger("trajforge.build")

@dataclass(frozen=True)
class BuildConfig:
    rendering: str = NormalizeConfig.rendering
    max_turn_chars: int = NormalizeConfig.max_turn_chars
    max_total_chars: int = ValidateConfig.max_total_chars
    # The most turns (all roles) a record may have; longer ones are quarantined as too_long.
    max_record_turns: int = ValidateConfig.max_turns
    # What a step the env refused inside an episode does: mask | drop | keep (pipeline/ingest/validate.py).
    invalid_steps: str = ValidateConfig.invalid_steps
    progress_every: int = 1000
    shards: ShardConfig = ShardConfig()
    dedup: DedupConfig = DedupConfig()
    negatives: NegativesConfig = NegativesConfig()
    # A file of evaluation tasks; trajectories whose task shares a word n-gram with one are quarantined.
    decontaminate: str | None = None
    decontaminate_ngram: int = 8
    # The declared eval splits (pipeline/evaluation/splits.py) are held out of every build unless this is off.
    decontaminate_splits: bool = True
    # Task texts of those splits that this build may train on all the same (RFT trains on its round
    # tasks and evaluates on the rest of the split); a build that spares any says so in its report.
    decontaminate_except: tuple[str, ...] = ()
    # Task files (pipeline.envs.tasks formats) whose tasks become `grpo_env` rows, beside the
    # trajectories' own resettable tasks.
    rl_tasks: tuple[str, ...] = ()

    def __post_init__(self):
        ValidateConfig(invalid_steps=self.invalid_steps)  # a bad value fails here, not mid-build

    @property
    def normalize(self) -> NormalizeConfig:
        return NormalizeConfig(rendering=self.rendering, max_turn_chars=self.max_turn_chars)

    @property
    def validate(self) -> ValidateConfig:
        return ValidateConfig(max_total_chars=self.max_total_chars, max_turns=self.max_record_turns,
                              invalid_steps=self.invalid_steps)


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
    # The unit's key table (pipeline/assemble.py), staged next to its records.
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
    """The stages every row of a unit goes through, in order, bound to the unit's source and config."""
    return [("read", read_stage),
            ("normalize", partial(normalize_stage, source=source, file=file, config=config.normalize)),
            ("validate", partial(validate_stage, config=config.validate, envs=envs))]


def run_stages(item, stages: list[tuple[str, MapStage]], tallies: list[StageTally], where: str, rows: int = 1):
    """`item` through each stage in order, each counting it (as `rows` rows) in its tally; the last
    stage's output, or the first Dropped. An exception no stage foresaw drops the item as
    `internal_error` of that stage instead of ending the build."""
    for (name, stage), tally in zip(stages, tallies):
        try:
            item = stage(item)
        except Exception as exc:
            item = _internal_error(f"{where} ({name})", exc)
        if isinstance(item, Dropped):
            tally.drop(item.reason, rows)
            return item
        tally.keep(rows)
    return item


def _internal_error(what: str, exc: BaseException, source_id: str | None = None) -> Dropped:
    """An unexpected exception as a drop: its type and message in the detail, its traceback in the log."""
    log.warning("%s: internal error", what, exc_info=exc)
    return Dropped("internal_error", f"{type(exc).__name__}: {exc}"[:1000], source_id)


def process_unit(source_name: str, file: SourceFile, staging: Path, config: BuildConfig = BuildConfig()) -> UnitResult:
    """Read one file of one source, run every row through the map stages, stage the results.

    Every row ends as a staged record or a quarantine entry (the first stage that dropped it,
    with its reason), whatever it holds; each stage's tally counts what it kept and dropped.
    """
    source = get_source(source_name)
    name = file.label
    key = unit_key(source_name, file)
    envs: dict[str, dict] = {}
    stages = map_stages(source, file, config, envs)
    tallies = [StageTally(stage) for stage, _ in stages]
    writing = StageTally(WRITE_STAGE)
    quarantine = StreamingParquet(staging / f"{key}.quarantine.parquet", arrow_schema("quarantine"))

    def reject(index: int, dropped: Dropped, raw: str | None) -> None:
        quarantine.append(quarantine_entry(source_name, name, index, dropped.source_id, dropped.reason,
                                           dropped.detail, raw))

    def refused(record: dict, exc: Exception) -> None:
        index = json.loads(record["meta"]).get("source_index", -1)
        dropped = _internal_error(f"{source_name}/{name} row {index} (writing)", exc, record["source_id"])
        writing.drop(dropped.reason)
        reject(index, dropped, shown(record))

    def written(rows: list[dict]) -> None:
        writing.keep(len(rows))
        keys.extend(rows)

    keys = KeysWriter(staging / f"{key}.keys.parquet", config)
    records = StreamingParquet(staging / f"{key}.records.parquet", arrow_schema("trajectory"), on_refused=refused,
                               on_written=written)
    rows = iter_rows(file.path, name)
    next_index = 0
    while True:
        try:
            raw = next(rows)
        except StopIteration:
            break
        except Exception as exc:  # a reader bug: the rest of the file is one drop of the read stage, the build goes on
            dropped = _internal_error(f"{source_name}/{name} reading from row {next_index}", exc)
            tallies[0].drop(dropped.reason)
            reject(next_index, replace(dropped, detail=dropped.detail + f"; rows from {next_index} on were not read"),
                   None)
            break
        next_index = raw.index + raw.rows
        record = run_stages(raw, stages, tallies, f"{source_name}/{name} row {raw.index}", raw.rows)
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
                        input_sha256=file_sha256(file.path), revision=hub_revision(file.path), input_path=str(file.path),
                        note="empty file: no records" if file.path.stat().st_size == 0 else None,
                        looks_like=foreign[0] if foreign else None)
    log.info("%s/%s: read %d, valid %d, quarantined %d %s", source_name, name, result.read, result.written,
             result.quarantined, result.reasons or "")
    return result


def staging_folder(out: Path) -> Path:
    """`out/.staging` (made if missing), once the temp files of an interrupted run are gone from `out`."""
    staging = (out / ".staging").resolve()
    staging.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)
    return staging


def resume_unit(source_name: str, file: SourceFile, staging: Path,
                config: BuildConfig = BuildConfig()) -> tuple[UnitResult, bool]:
    """`process_unit`, unless an earlier run finished the unit on the same input and config (its
    marker, written after its staged files, says so): (the result, whether it was finished earlier)."""
    fingerprint = unit_fingerprint(source_name, file.path, file.split, asdict(config))
    marker = unit_marker(staging, unit_key(source_name, file))
    done = read_marker(marker, fingerprint)
    if done and all(Path(done.get(k) or "/nonexistent").exists() for k in ("records_path", "quarantine_path", "keys_path")):
        return UnitResult(**done), True
    result = process_unit(source_name, file, staging, config)
    write_marker(marker, fingerprint, asdict(result))
    return result, False


def units_done(done: int, total: int, unit: UnitResult) -> str:
    """The log line of a build after each unit."""
    return f"units done: {done}/{total} ({unit.source}/{unit.source_file})"


def unit_bar(total: int):
    """A progress bar of the units on a terminal (stderr); nothing elsewhere (a log file, a worker)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="source files", unit="file", disable=None, leave=False)


def build_in_process(sources: dict[str, str | None], out: Path, config: BuildConfig = BuildConfig()) -> dict:
    """The whole build in this process, without Prefect: for inputs so small that starting a Prefect
    server and worker processes would take longer than the work. The same steps as the build flow
    (flows/build.py) in the same order, so the same bytes, resumed the same way after a stop.
    Returns the report."""
    staging = staging_folder(out)
    files = [(name, f) for name, location in sources.items() for f in get_source(name).files(location)]
    units = []
    with unit_bar(len(files)) as bar:
        for name, file in files:
            unit, earlier = resume_unit(name, file, staging, config)
            if earlier:
                log.info("%s/%s: done in an earlier run, skipped", name, file.label)
            units.append(unit)
            bar.update()
            log.info(units_done(len(units), len(files), unit))
    return finalize(units, out, config)


def merge_counts(units: list[UnitResult]) -> dict:
    """Per source and total: read, written, quarantined, reasons."""
    per_source: dict[str, dict] = {}
    for unit in units:
        entry = per_source.setdefault(unit.source, {"read": 0, "written": 0, "quarantined": 0, "reasons": {},
                                                    "files": {}})
        for key in ("read", "written", "quarantined"):
            entry[key] += getattr(unit, key)
        for reason, n in unit.reasons.items():
            entry["reasons"][reason] = entry["reasons"].get(reason, 0) + n
        entry["files"][unit.source_file] = {"read": unit.read, "written": unit.written,
                                            "quarantined": unit.quarantined, **({"note": unit.note} if unit.note else {})}
    total = {"read": 0, "written": 0, "quarantined": 0, "reasons": {}}
    for entry in per_source.values():
        for key in ("read", "written", "quarantined"):
            total[key] += entry[key]
        for reason, n in entry["reasons"].items():
            total["reasons"][reason] = total["reasons"].get(reason, 0) + n
    return {"sources": per_source, "total": total}


def finalize(units: list[UnitResult], out: Path, config: BuildConfig = BuildConfig(), map_units=in_order) -> dict:
    """Merge staged units (in the given order) into the dataset, quarantine and report.

    Global stages run on the units' key tables; the outputs are written by streaming each unit's
    staged records (pipeline/assemble.py): memory stays one batch of records plus the key tables.
    The per-unit steps (pools, outputs) go through `map_units(function, calls)`, which returns the
    results in the calls' order: `in_order` here, or a flow's task runner (processes, a Dask or Ray
    cluster). The output bytes do not depend on it.

    The manifest of an earlier build in `out` is set aside first and the new one written last, so
    a folder with a manifest always holds the files of the build it names. Files of the earlier
    build that this one does not write are removed; nothing else in `out` is touched.
    """
    remove_stale_temp_files(out)
    earlier = set_manifest_aside(out)
    keys = key_table(units, config)
    duplicates = global_duplicates(keys, units, config, map_units, out / ".staging")
    dropped = pl.Series("order", [d["order"] for d in duplicates], dtype=pl.Int64)
    keys = unique_ids(keys, keys["contaminated"].is_null() & ~keys["order"].is_in(dropped.implode()))
    duplicates = with_unique_ids(duplicates, keys)
    kept_keys = (keys.select("order", "unit", "row", "rendering", "domain", "env", "kind", "turns", "chars")
                 .filter(keys["contaminated"].is_null() & ~pl.col("order").is_in(dropped.implode())))
    kept_rows = [kept_keys.filter(pl.col("unit") == u)["row"].to_numpy() for u in range(len(units))]
    pools = EnvPools()
    for unit_pool in map_units(unit_pools, [(unit.records_path, rows) for unit, rows in zip(units, kept_rows)]):
        pools.merge(unit_pool)

    def by_unit(frame: pl.DataFrame, column: str) -> list[dict[int, object]]:
        found: list[dict[int, object]] = [{} for _ in units]
        for u, row, value in frame.select("unit", "row", column).iter_rows():
            found[u][row] = value
        return found

    repeats = by_unit(keys.filter(pl.col("repeat") > 1), "repeat")
    contaminated = by_unit(keys.filter(pl.col("contaminated").is_not_null()), "contaminated")
    # grpo_env: the task files' runnable tasks first, then each kept positive's resettable task
    # (derived.grpo_env_rows); a task file's task takes the first answer of a synthetic trajectory of it.
    tasks = [t for path in config.rl_tasks for t in load_tasks(path)]
    runnable = [t for t in tasks if not t.skip_reason]
    staged = out / ".staging" / "outputs"
    written = map_units(write_unit, [
        (unit.records_path, str(staged / f"{u:05d}"), kept_rows[u], repeats[u], contaminated[u], pools,
         config.negatives, frozenset(t.id for t in runnable)) for u, unit in enumerate(units)])
    synthetic_answers: dict[str, str] = {}
    for part in written:
        for task_id, answer in part.synthetic_answers.items():
            synthetic_answers.setdefault(task_id, answer)
    with StreamingParquet(staged / "grpo_env.parquet", arrow_schema("grpo_env")) as task_rows:
        for t in runnable:
            task_rows.append(grpo_env_row(t, "tasks", answer=reference_answer(t) or synthetic_answers.get(t.id)))
    record_rows = first_task_rows([part.paths["grpo_env_records"] for part in written],
                                  staged / "grpo_env_records.parquet")
    parts = {name: [(part.paths[name], part.nbytes[name], part.rows[name]) for part in written]
             for name in ("sft", "negatives", "preference", "grpo", "step_labels")}
    parts["grpo_env"] = [(str(task_rows.path), task_rows.nbytes, task_rows.count), record_rows]
    step_parts, step_counts = stage_step_rows(units, kept_rows, contaminated, staged)
    parts.update(step_parts)
    files = {name: write_config_from_file(out, name, "train", [Path(p) for p, _, _ in staged_parts],
                                          arrow_schema(OUTPUTS.get(name, name)),
                                          sum(n for _, n, _ in staged_parts), config.shards, map_units)
             for name, staged_parts in parts.items()}
    rows = {name: sum(r for _, _, r in staged_parts) for name, staged_parts in parts.items()}
    shutil.rmtree(staged)

    duplicates = [{k: v for k, v in d.items() if k not in ("order", "kept_order")} for d in duplicates]
    duplicates_path = out / "duplicates.parquet"
    write_parquet(duplicates, arrow_schema("duplicates"), duplicates_path)
    contaminated_rows = [entry for part in written for entry in part.contaminated]
    quarantine_path = out / "quarantine" / "quarantine.parquet"
    quarantine = StreamingParquet(quarantine_path, arrow_schema("quarantine"))
    for unit in units:
        for batch in pq.ParquetFile(unit.quarantine_path).iter_batches(batch_size=1000):
            for entry in batch.to_pylist():
                quarantine.append(entry)
    for entry in contaminated_rows:
        quarantine.append(entry)
    quarantine.close()

    report = merge_counts(units)
    report["generator"] = GENERATOR
    report["config"] = asdict(config)
    report["outputs"] = {"sft": files["sft"].get("train", []),
                         "quarantine": [str(quarantine_path.relative_to(out))]}
    for column, name in [("rendering", "renderings"), ("domain", "domains"), ("env", "envs"), ("kind", "kinds")]:
        report[name] = dict(sorted(Counter(kept_keys[column].to_list()).items()))
    report["validation_by_env"] = merge_env_figures([u.envs for u in units])
    stage_counts(report, contaminated_rows, duplicates)
    # Which eval splits (and which version of each) this build holds out: `trajforge eval` reads it.
    report["held_out"] = {"splits": declared_held_out().splits if config.decontaminate_splits else {},
                          "spared": len(config.decontaminate_except), "file": config.decontaminate,
                          "contaminated": len(contaminated_rows)}
    report["stages"] = [t.as_dict() for t in build_stages(units, len(contaminated_rows), duplicates)]
    report["outputs"].update({name: files[name].get("train", [])
                              for name in ("negatives", "preference", "grpo", "grpo_env", "step_labels")},
                             duplicates=[str(duplicates_path.relative_to(out))])
    turns, chars = kept_keys["turns"].to_list(), kept_keys["chars"].to_list()
    negatives_by_type = sum((Counter(part.negatives_by_type) for part in written), Counter())
    report_extras(report, duplicates, negatives_by_type, rows["preference"], sum(part.unpaired for part in written),
                  rows["grpo"], turns, chars)
    report["grpo_env"] = {"rows": rows["grpo_env"], "unrunnable_tasks": len(tasks) - len(runnable)}
    if step_counts:
        report["outputs"].update({name: files[name].get("train", []) for name in step_parts})
        report["search_steps"] = step_counts
    label_mix = sum((Counter(part.step_labels) for part in written), Counter())
    report["step_labels"] = {"rows": rows["step_labels"],
                             "steps": {f"{source}:{'good' if label else 'bad'}": n
                                       for (source, label), n in sorted(label_mix.items())}}
    if kept_keys.is_empty():
        report["warnings"] = ["no record made it into data/sft: every input record was quarantined or a duplicate"]
    for warning in report.get("warnings", []):
        log.warning(warning)
    html_files = write_html(out, report, duplicates, turns, chars)
    write_json(out / "report.json", report)
    owned = [path for paths in report["outputs"].values() for path in paths]
    owned += [p.relative_to(out).as_posix() for p in html_files] + ["report.json"]
    write_release_files(out, report, units, config, owned)
    remove_earlier_files(out, earlier - set(owned) - {"README.md"})
    return report


def build_stages(units: list[UnitResult], contaminated: int, duplicates: list[dict]) -> list[StageTally]:
    """Every stage of the build in order with its tally: the map stages summed over the units, then
    the global ones (decontaminate, exact dedup, near dedup); each takes in what the one before kept."""
    stages = merge_tallies([[StageTally.from_dict(entry) for entry in unit.stages] for unit in units])
    matches = Counter(d["match"] for d in duplicates)
    for name, reason, dropped in [("decontaminate", "contaminated", contaminated), ("dedup_exact", "exact", matches["exact"]),
                                  ("dedup_near", "near", matches["near"])]:
        stages.append(StageTally.of(name, stages[-1].kept if stages else 0, {reason: dropped}))
    return stages


def write_release_files(out: Path, report: dict, units: list[UnitResult], config: BuildConfig,
                        files: list[str]) -> str:
    """Dataset card and manifest, last: they describe the files written before them (`files`,
    relative to `out`; the card is added). Returns the build id."""
    code = code_version()
    build = build_id([(u.source, u.source_file, u.input_sha256) for u in units],
                     {**asdict(config), "held_out": report["held_out"]["splits"]}, code)
    provenance = [{"source": u.source, "source_file": u.source_file, "sha256": u.input_sha256,
                   "revision": u.revision, "looks_like": u.looks_like} for u in units]
    write_card(out, report, provenance, build, code)
    write_manifest(out, build, [*files, "README.md"])
    return build


def summary_lines(report: dict) -> list[str]:
    """The short human summary printed at the end of a build."""
    lines = [f"{'source':<14}{'read':>8}{'written':>9}{'quarant.':>10}{'dups':>7}  reasons"]
    for name, entry in sorted(report["sources"].items()):
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(entry["reasons"].items())) or "-"
        lines.append(f"{name:<14}{entry['read']:>8}{entry['written']:>9}{entry['quarantined']:>10}"
                     f"{entry.get('duplicates', 0):>7}  {reasons}")
    t = report["total"]
    lines.append(f"{'total':<14}{t['read']:>8}{t['written']:>9}{t['quarantined']:>10}{t.get('duplicates', 0):>7}")
    if report.get("stages"):
        steps = [f"{s['stage']} {s['kept']}" + (f" (-{s['in'] - s['kept']})" if s["in"] > s["kept"] else "")
                 for s in report["stages"]]
        lines.append("stages: " + " -> ".join(steps))
    shards = [f"{name} {len(paths)}" for name, paths in report.get("outputs", {}).items()
              if name not in ("quarantine", "duplicates")]
    if shards:
        lines.append("shards: " + ", ".join(shards))
    return lines + [f"warning: {w}" for w in report.get("warnings", [])]
