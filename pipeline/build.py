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
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.publish.card import hub_revision, write_card
from trajforge.pipeline.quality.dedup import Contamination, DedupConfig, decontaminate, deduplicate, read_eval_tasks
from trajforge.pipeline.quality.derived import grpo_env_rows, grpo_prompts, preference_pairs
from trajforge.pipeline.publish.manifest import (GENERATOR, build_id, code_version, file_sha256,
                                                remove_earlier_files, set_manifest_aside, write_manifest)
from trajforge.pipeline.quality.negatives import NegativesConfig, make_negatives
from trajforge.pipeline.ingest.normalize import NormalizeConfig, NormalizeError, normalize_row
from trajforge.pipeline.publish.report import report_extras, stage_counts, write_html
from trajforge.pipeline.publish.shards import ShardConfig, write_config
from trajforge.pipeline.synth.tasks import load_tasks
from trajforge.pipeline.ingest.validate import ValidateConfig, merge_env_figures, tally_env, validate_record
from trajforge.schemas import arrow_schema
from trajforge.sources import RawRow, SourceFile, get_source, iter_rows

log = logging.getLogger("trajforge.build")

# Raw input kept in the quarantine is cut to this many characters (a 10 MB string stays traceable
# without bloating the quarantine).
MAX_QUARANTINE_RAW = 100_000


@dataclass(frozen=True)
class BuildConfig:
    rendering: str = NormalizeConfig.rendering
    max_turn_chars: int = NormalizeConfig.max_turn_chars
    max_total_chars: int = ValidateConfig.max_total_chars
    progress_every: int = 1000
    shards: ShardConfig = ShardConfig()
    dedup: DedupConfig = DedupConfig()
    negatives: NegativesConfig = NegativesConfig()
    # A file of evaluation tasks; trajectories whose task shares a word n-gram with one are quarantined.
    decontaminate: str | None = None
    decontaminate_ngram: int = 8
    # Task files (pipeline.tasks formats) whose tasks become `grpo_env` rows, beside the
    # trajectories' own resettable tasks.
    rl_tasks: tuple[str, ...] = ()

    @property
    def normalize(self) -> NormalizeConfig:
        return NormalizeConfig(rendering=self.rendering, max_turn_chars=self.max_turn_chars)

    @property
    def validate(self) -> ValidateConfig:
        return ValidateConfig(max_total_chars=self.max_total_chars)


@dataclass
class UnitResult:
    """What one unit wrote and counted; small enough to pass between processes."""
    source: str
    source_file: str
    records_path: str
    quarantine_path: str
    read: int = 0
    written: int = 0
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    # Provenance for the card and the build id: the input's content and its Hub commit, if any.
    input_sha256: str = ""
    revision: str | None = None
    # Per env: records validated, trained actions checked/valid by grammar, quarantined by rule.
    envs: dict[str, dict] = field(default_factory=dict)
    # Something about the file itself worth a line in the report (an empty file).
    note: str | None = None


def unit_key(source: str, file: SourceFile) -> str:
    digest = hashlib.sha1(str(file.path.resolve()).encode()).hexdigest()[:8]
    return f"{source}__{file.path.stem}__{digest}"


def shown(value) -> str:
    """A value as JSON text for the quarantine; never fails, whatever the value holds."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
        text.encode("utf-8")
    except (RecursionError, ValueError, TypeError, UnicodeEncodeError):
        # Too deep for the encoder, or text no UTF-8 file can hold: show it escaped.
        text = ascii(value) if _depth_at_most(value, 200) else f"<{type(value).__name__} nested too deep to show>"
    return text


def _depth_at_most(value, limit: int) -> bool:
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _storable(text: str | None) -> str | None:
    """Text Arrow can store: an unpaired surrogate (from an exception message, say) escaped."""
    if text is None or text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def quarantine_entry(source: str, source_file: str, index: int, source_id: str | None, reason: str,
                     detail: str, raw: str | None) -> dict:
    if raw is not None and len(raw) > MAX_QUARANTINE_RAW:
        raw = raw[:MAX_QUARANTINE_RAW] + "...[cut]"
    return {"source": source, "source_file": source_file, "index": index, "source_id": _storable(source_id),
            "reason": reason, "detail": _storable(detail), "raw": _storable(raw)}


def temp_name(path: Path) -> Path:
    """Where `path` is written before its rename: hidden, and named by the writing process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_stale_temp_files(out: Path) -> list[Path]:
    """Delete the temp files a killed earlier run left under `out` (ours are renamed or gone)."""
    mine = f".tmp-{os.getpid()}"
    stale = [p for p in out.rglob(".*.tmp-*") if p.is_file() and not p.name.endswith(mine)] if out.exists() else []
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temp files of an earlier, interrupted run", len(stale))
    return stale


def write_parquet(rows: list[dict], schema: pa.Schema, path: Path) -> None:
    """Write atomically: a temp name, then rename, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp, compression="zstd")
    os.replace(tmp, path)


class StreamingParquet:
    """Append rows in batches to a Parquet file written under a temp name, renamed on close.

    A unit's memory stays one batch deep however large the upstream file is. A batch that Arrow
    refuses is written row by row: each row it still refuses goes to `on_refused(row, exc)`
    (the unit quarantines it), and the rest of the batch is kept.
    """

    def __init__(self, path: Path, schema: pa.Schema, batch_rows: int = 1000, on_refused=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.schema, self.batch_rows = path, schema, batch_rows
        self.on_refused = on_refused
        self.tmp = temp_name(path)
        self.writer = pq.ParquetWriter(self.tmp, schema, compression="zstd")
        self.pending: list[dict] = []
        self.count = 0

    def append(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        try:
            table = pa.Table.from_pylist(self.pending, schema=self.schema)
        except Exception:
            if self.on_refused is None:
                raise
            table = pa.Table.from_pylist(self._convertible(self.pending), schema=self.schema)
        self.writer.write_table(table)
        self.count += table.num_rows
        self.pending = []

    def _convertible(self, rows: list[dict]) -> list[dict]:
        kept = []
        for row in rows:
            try:
                pa.Table.from_pylist([row], schema=self.schema)
            except Exception as exc:
                self.on_refused(row, exc)
                continue
            kept.append(row)
        return kept

    def close(self) -> None:
        self._flush()
        self.writer.close()
        os.replace(self.tmp, self.path)


def _record_or_rejection(raw: RawRow, source, file: SourceFile, config: BuildConfig,
                         envs: dict[str, dict]) -> tuple[dict | None, tuple | None]:
    """(record, None), or (None, (source_id, reason, detail)) for a row that cannot be one.

    Positive records also count into `envs`, the per-env validation figures of the unit.
    """
    if raw.error:
        return None, (None, raw.error, raw.detail or "")
    upstream_id = raw.row.get("id", raw.row.get("item_id"))
    try:
        record = normalize_row(raw.row, source, file.split, file.label, raw.index, config.normalize)
    except NormalizeError as exc:
        return None, (str(upstream_id) if isinstance(upstream_id, (str, int)) else None, exc.reason, exc.detail)
    violation = validate_record(record, config.validate) if record["kind"] == "positive" else None
    if record["kind"] == "positive":
        tally_env(envs, record, violation)
    if violation is not None:
        return None, (record["source_id"], violation.reason, violation.detail)
    return record, None


def _internal_error(what: str, exc: BaseException) -> str:
    """The quarantine detail of an unexpected exception; its traceback goes to the log."""
    log.warning("%s: internal error", what, exc_info=exc)
    return f"{type(exc).__name__}: {exc}"[:1000]


def process_unit(source_name: str, file: SourceFile, staging: Path, config: BuildConfig = BuildConfig()) -> UnitResult:
    """Read one file of one source, normalize and validate every row, stage the results.

    Every row ends as a staged record or a quarantine entry, whatever it holds: an exception
    that no rule foresaw quarantines the row as `internal_error` (type in the detail, traceback
    in the log) instead of ending the build.
    """
    source = get_source(source_name)
    name = file.label
    key = unit_key(source_name, file)
    reasons: Counter[str] = Counter()
    envs: dict[str, dict] = {}
    counts = Counter()
    quarantine = StreamingParquet(staging / f"{key}.quarantine.parquet", arrow_schema("quarantine"))

    def reject(index: int, source_id: str | None, reason: str, detail: str, raw: str | None, rows: int = 1) -> None:
        reasons[reason] += rows
        counts["quarantined"] += rows
        quarantine.append(quarantine_entry(source_name, name, index, source_id, reason, detail, raw))

    def refused(record: dict, exc: Exception) -> None:
        index = json.loads(record["meta"]).get("source_index", -1)
        reject(index, record["source_id"], "internal_error",
               _internal_error(f"{source_name}/{name} row {index} (writing)", exc), shown(record))

    records = StreamingParquet(staging / f"{key}.records.parquet", arrow_schema("trajectory"), on_refused=refused)
    rows = iter_rows(file.path, name)
    next_index = 0
    while True:
        try:
            raw = next(rows)
        except StopIteration:
            break
        except Exception as exc:  # a reader bug: the rest of the file is one entry, the build goes on
            reject(next_index, None, "internal_error",
                   _internal_error(f"{source_name}/{name} reading from row {next_index}", exc)
                   + f"; rows from {next_index} on were not read", None)
            break
        counts["read"] += raw.rows
        next_index = raw.index + raw.rows
        try:
            record, rejection = _record_or_rejection(raw, source, file, config, envs)
        except Exception as exc:
            record, rejection = None, (None, "internal_error", _internal_error(f"{source_name}/{name} row {raw.index}", exc))
        if rejection is not None:
            text = raw.raw_text if raw.raw_text is not None or raw.row is None else shown(raw.row)
            reject(raw.index, *rejection, text, raw.rows)
            continue
        records.append(record)
        counts["staged"] += 1
        if counts["staged"] % config.progress_every == 0:
            log.info("%s/%s: %d records so far", source_name, name, counts["staged"])
    records.close()
    quarantine.close()
    result = UnitResult(source_name, name, str(records.path), str(quarantine.path),
                        read=counts["read"], written=records.count, quarantined=counts["quarantined"],
                        reasons=dict(reasons), envs=envs, input_sha256=file_sha256(file.path), revision=hub_revision(file.path),
                        note="empty file: no records" if file.path.stat().st_size == 0 else None)
    log.info("%s/%s: read %d, valid %d, quarantined %d %s", source_name, name, result.read, result.written,
             result.quarantined, result.reasons or "")
    return result


def unique_ids(records: Iterable[dict]) -> list[dict]:
    """Give a repeated id a stable `~n` suffix (n = 2, 3, ... in build order); never overwrite."""
    seen: Counter[str] = Counter()
    out = []
    for record in records:
        seen[record["id"]] += 1
        if seen[record["id"]] > 1:
            meta = json.loads(record["meta"])
            meta["id_repeat"] = seen[record["id"]]
            record = {**record, "id": f"{record['id']}~{seen[record['id']]}",
                      "meta": json.dumps(meta, sort_keys=True)}
        out.append(record)
    return out


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


def finalize(units: list[UnitResult], out: Path, config: BuildConfig = BuildConfig()) -> dict:
    """Merge staged units (in the given order) into the dataset, quarantine and report.

    The manifest of an earlier build in `out` is set aside first and the new one written last, so
    a folder with a manifest always holds the files of the build it names. Files of the earlier
    build that this one does not write are removed; nothing else in `out` is touched.
    """
    remove_stale_temp_files(out)
    earlier = set_manifest_aside(out)
    records: list[dict] = []
    quarantine: list[dict] = []
    for unit in units:
        records.extend(pq.read_table(unit.records_path).to_pylist())
        quarantine.extend(pq.read_table(unit.quarantine_path).to_pylist())
    records = unique_ids(records)
    # Decontamination, dedup and the derived datasets (pipeline/quality/dedup.py, negatives.py, derived.py).
    contaminated: list[dict] = []
    if config.decontaminate:
        index = Contamination(read_eval_tasks(Path(config.decontaminate)), config.decontaminate_ngram)
        records, removed = decontaminate(records, index)
        contaminated = [quarantine_entry(r["source"], r["source_file"], json.loads(r["meta"]).get("source_index", -1),
                                         r["source_id"], "contaminated", detail, shown(r))
                        for r, detail in removed]
        quarantine.extend(contaminated)
    records, duplicates = deduplicate(records, config.dedup)
    negatives = make_negatives(records, config.negatives)
    pairs, unpaired = preference_pairs(negatives, records)
    grpo = grpo_prompts(records)
    grpo_env, unrunnable_tasks = grpo_env_rows([t for path in config.rl_tasks for t in load_tasks(path)], records)
    derived = {name: write_config(out, name, {"train": pa.Table.from_pylist(rows, schema=arrow_schema(schema))},
                                  config.shards)
               for name, rows, schema in [("negatives", negatives, "trajectory"), ("preference", pairs, "preference"),
                                          ("grpo", grpo, "grpo"), ("grpo_env", grpo_env, "grpo_env")]}
    duplicates_path = out / "duplicates.parquet"
    write_parquet(duplicates, arrow_schema("duplicates"), duplicates_path)
    sft = write_config(out, "sft", {"train": pa.Table.from_pylist(records, schema=arrow_schema("trajectory"))},
                       config.shards)
    quarantine_path = out / "quarantine" / "quarantine.parquet"
    write_parquet(quarantine, arrow_schema("quarantine"), quarantine_path)
    report = merge_counts(units)
    report["generator"] = GENERATOR
    report["config"] = asdict(config)
    report["outputs"] = {"sft": sft["train"],
                         "quarantine": [str(quarantine_path.relative_to(out))]}
    report["renderings"] = dict(Counter(r["rendering"] for r in records))
    report["domains"] = dict(sorted(Counter(r["domain"] for r in records).items()))
    report["envs"] = dict(sorted(Counter(r["env"] for r in records).items()))
    report["kinds"] = dict(Counter(r["kind"] for r in records))
    report["validation_by_env"] = merge_env_figures([u.envs for u in units])
    stage_counts(report, contaminated, duplicates)
    report["outputs"].update({name: files.get("train", []) for name, files in derived.items()},
                             duplicates=[str(duplicates_path.relative_to(out))])
    report_extras(report, records, duplicates, negatives, len(pairs), unpaired, len(grpo))
    report["grpo_env"] = {"rows": len(grpo_env), "unrunnable_tasks": unrunnable_tasks}
    if not records:
        report["warnings"] = ["no record made it into data/sft: every input record was quarantined or a duplicate"]
    for warning in report.get("warnings", []):
        log.warning(warning)
    html_files = write_html(out, report, records, duplicates)
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    owned = [path for paths in report["outputs"].values() for path in paths]
    owned += [p.relative_to(out).as_posix() for p in html_files] + ["report.json"]
    write_release_files(out, report, units, config, owned)
    remove_earlier_files(out, earlier - set(owned) - {"README.md"})
    return report


def write_release_files(out: Path, report: dict, units: list[UnitResult], config: BuildConfig,
                        files: list[str]) -> str:
    """Dataset card and manifest, last: they describe the files written before them (`files`,
    relative to `out`; the card is added). Returns the build id."""
    code = code_version()
    build = build_id([(u.source, u.source_file, u.input_sha256) for u in units], asdict(config), code)
    provenance = [{"source": u.source, "source_file": u.source_file, "sha256": u.input_sha256,
                   "revision": u.revision} for u in units]
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
    return lines + [f"warning: {w}" for w in report.get("warnings", [])]
