"""The dataset card (README.md) generated from a build.

The YAML front matter is what the Hub and `datasets.load_dataset` read: `configs` (data files per
config and split), `dataset_info` (features and sizes per config), licenses, task categories and
size category. It is produced with the same classes `datasets` uses to read it back, so the
folder loads locally exactly as it will from the Hub. The body is for people: counts, what was
quarantined or deduplicated, the schema, and where every record came from.

A combined dataset inherits each upstream license, so the card names them per source as the
upstream cards state them, rather than one license for the whole.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
from huggingface_hub import DatasetCardData

from trajforge.pipeline.atomic import write_text
from trajforge.pipeline.publish.report import (
    GROUNDING_HEADER,
    GROUNDING_NOTE,
    STEPS_HEADER,
    STEPS_NOTE,
    VALIDATION_HEADER,
    grounding_rows,
    steps_rows,
    validation_rows,
)
from trajforge.pipeline.publish.shards import layout
from trajforge.schemas import load_schema
from trajforge.sources import REGISTRY

DEFAULT_CONFIG = "sft"
# Hub license ids; anything else is published as "other" with the stated text in the body.
HUB_LICENSES = {"apache-2.0", "mit", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0", "cc-by-nc-sa-4.0",
                "cc0-1.0", "odc-by", "llama3", "unknown", "other"}
SIZE_CATEGORIES = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
                   (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M")]


def hub_license_id(stated: str) -> str:
    token = stated.split()[0].lower() if stated.strip() else "unknown"
    return token if token in HUB_LICENSES else "other"


def size_category(rows: int) -> str:
    return next((name for limit, name in SIZE_CATEGORIES if rows < limit), "n>100M")


def shard_stats(path: Path) -> dict:
    """What the card says of one shard: `rows`, uncompressed `num_bytes` and file `size` from its
    Parquet metadata, and the (source, license) pairs of its records (`licenses`). A build's
    writers take them as they write each shard (`render_card`'s `shards`)."""
    meta = pq.read_metadata(path)
    licenses = []
    if {"source", "license"} <= set(meta.schema.to_arrow_schema().names):
        # Polars reads and dedups the pairs ~3x cheaper than joined Arrow strings (every shard is read).
        licenses = [list(pair) for pair in pl.read_parquet(path, columns=["source", "license"]).unique().iter_rows()]
    return {"rows": meta.num_rows, "num_bytes": sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)),
            "size": path.stat().st_size, "licenses": licenses}


def _shards_stats(out: Path, files: dict[str, dict[str, list[str]]], known: dict[str, dict] | None) -> dict[str, dict]:
    """`shard_stats` of every shard of `files` (relative path -> stats): those `known`, the others read."""
    known = known or {}
    return {rel: known.get(rel) or shard_stats(out / rel)
            for splits in files.values() for paths in splits.values() for rel in paths}


def _split_stats(stats: dict[str, dict], paths: list[str]) -> tuple[int, int, int]:
    """(rows, uncompressed bytes, file bytes) of a split's shards."""
    return (sum(stats[rel]["rows"] for rel in paths), sum(stats[rel]["num_bytes"] for rel in paths),
            sum(stats[rel]["size"] for rel in paths))


def source_licenses(stats: dict[str, dict]) -> dict[str, list[str]]:
    """source -> the license texts its records carry (set from each Source, as its card states)."""
    found: dict[str, set[str]] = defaultdict(set)
    for shard in stats.values():
        for source, license_text in shard["licenses"]:
            found[source].add(license_text)
    return {s: sorted(v) for s, v in sorted(found.items())}


def load_card_classes() -> None:
    """Load the `datasets` classes the card is made with (`card_data`), ahead of it: a build does so
    while its workers write the shards (~0.2-0.3 s of one core), not after them, with the cores idle."""
    import datasets.info  # noqa: F401
    import datasets.utils.metadata  # noqa: F401


def card_data(out: Path, files: dict[str, dict[str, list[str]]], licenses: dict[str, list[str]],
              stats: dict[str, dict]) -> DatasetCardData:
    # `datasets` loads in ~1.5 s (pandas, its Arrow formatting); only the card needs it, and every
    # worker process of a build imports this module.
    from datasets import DatasetInfo, Features, SplitDict, SplitInfo
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs

    default = DEFAULT_CONFIG if DEFAULT_CONFIG in files else next(iter(sorted(files)), None)
    infos, configs, largest = DatasetInfosDict(), MetadataConfigs(), 0
    for name, splits in sorted(files.items()):
        features = Features.from_arrow_schema(pq.read_schema(out / next(iter(splits.values()))[0]))
        split_dict, download, dataset, total = SplitDict(), 0, 0, 0
        for split, paths in sorted(splits.items()):
            rows, num_bytes, size = _split_stats(stats, paths)
            split_dict.add(SplitInfo(name=split, num_bytes=num_bytes, num_examples=rows))
            download, dataset, total = download + size, dataset + num_bytes, total + rows
        largest = max(largest, total)
        infos[name] = DatasetInfo(config_name=name, features=features, splits=split_dict,
                                  download_size=download, dataset_size=dataset)
        configs[name] = {"data_files": [{"split": split, "path": f"data/{name}/{split}-*.parquet"}
                                        for split in sorted(splits)],
                         **({"default": True} if name == default else {})}
    license_ids = sorted({hub_license_id(text) for texts in licenses.values() for text in texts}) or ["unknown"]
    data = DatasetCardData(license=license_ids if len(license_ids) > 1 else license_ids[0], language=["en"],
                           task_categories=["text-generation"], size_categories=[size_category(largest)],
                           tags=["agent", "trajectories", "react", "tool-use", "trajforge"],
                           pretty_name="trajforge agent trajectories")
    configs.to_dataset_card_data(data)
    infos.to_dataset_card_data(data)
    return data


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _schema_lines() -> list[str]:
    schema = load_schema("trajectory")
    rows = []
    for name, node in schema["properties"].items():
        types = node.get("type")
        kind = "/".join(types) if isinstance(types, list) else types
        if "enum" in node:
            kind += ": " + ", ".join(f"`{v}`" for v in node["enum"])
        rows.append([f"`{name}`", kind, node.get("description", "").replace("|", "\\|")])
    turn = schema["properties"]["conversations"]["items"]["properties"]
    return (_table(["field", "type", "meaning"], rows)
            + ["", "Each turn of `conversations` holds " + ", ".join(f"`{k}`" for k in turn) + "."])


def _where(units: list[dict]) -> str:
    """The Hub revisions the units were read at, and the local files by content."""
    revisions = sorted({u["revision"] for u in units if u.get("revision")})
    local = [u for u in units if not u.get("revision")]
    where = ", ".join(f"`{r}`" for r in revisions)
    if local:
        # A local copy has no Hub revision: name its files by content instead.
        where += (", " if where else "") + "local files " + ", ".join(
            f"`{u['source_file']}` (sha256 `{u['sha256']}`)" for u in sorted(local, key=lambda u: u["source_file"]))
    return where or "-"


def _stated_license(source: str, units: list[dict], licenses: dict[str, list[str]]) -> str:
    """The license the source's files state (else the registered one), and that of what they look like."""
    registered = REGISTRY.get(source)
    stated = "; ".join(licenses.get(source, [])) or (registered.license if registered else "see records")
    foreign = sorted({u["looks_like"] for u in units if u.get("looks_like")})
    if foreign:
        # Read at the user's word (--source-as): say what the files look like, and its license.
        stated += (f" ({source}'s license); {sum(bool(u.get('looks_like')) for u in units)} of {len(units)} "
                   "files look like " + " and ".join(f"{other} ({REGISTRY[other].license})" for other in foreign)
                   + f" and were read as {source} at the builder's word (`--source-as {source}`)")
    return stated


def _provenance_rows(provenance: list[dict], licenses: dict[str, list[str]]) -> list[list]:
    by_source: dict[str, list[dict]] = defaultdict(list)
    for unit in provenance:
        by_source[unit["source"]].append(unit)
    rows = []
    for source in sorted(set(by_source) | set(licenses)):
        units = by_source.get(source, [])
        registered = REGISTRY.get(source)
        repo = (f"[{registered.hub_repo}](https://huggingface.co/datasets/{registered.hub_repo})"
                if registered else "-")
        rows.append([source, repo, _where(units), _stated_license(source, units, licenses)])
    return rows


def _grounding_lines(figures: dict | None) -> list[str]:
    rows = grounding_rows(figures or {})
    if not rows:
        return []
    return ["### Steps grounded in the environment's answers", "", GROUNDING_NOTE, ""] + _table(GROUNDING_HEADER, rows) + [""]


def _dedup_lines(dup: dict | None) -> list[str]:
    if not dup:
        return []
    how = ", ".join(f"{n} {match}" for match, n in sorted(dup.get("by_match", {}).items()))
    lines = ["## Deduplication", "", f"{dup.get('total', 0)} records dropped as duplicates"
             + (f" ({how})" if how else "") + "; `duplicates.parquet` maps each to the id that was kept.", ""]
    if dup.get("by_source"):
        lines += _table(["source", "dropped"], [[s, n] for s, n in sorted(dup["by_source"].items())]) + [""]
    if dup.get("cross_source"):
        lines += _table(["across sources (dropped -> kept)", "records"],
                        [[pair, n] for pair, n in sorted(dup["cross_source"].items())]) + [""]
    return lines


def _negative_lines(neg: dict | None) -> list[str]:
    if not neg or not neg.get("by_type"):
        return []
    return (["## Negatives", "", f"{neg.get('total', 0)} negative trajectories, "
             f"{neg.get('preference_pairs', 0)} preference pairs.", ""]
            + _table(["negative_type", "records"], [[f"`{t}`", n] for t, n in sorted(neg["by_type"].items())]) + [""])


def _steps_lines(counts: dict | None) -> list[str]:
    if not counts:
        return []
    return ["## Step-level data", "", STEPS_NOTE, ""] + _table(STEPS_HEADER, steps_rows(counts)) + [""]


def _config_lines(stats: dict[str, dict], files: dict[str, dict[str, list[str]]], notes: dict[str, str]) -> list[str]:
    rows = [[f"`{name}`" + (" (default)" if name == DEFAULT_CONFIG else ""), split,
             _split_stats(stats, paths)[0], len(paths), notes.get(name, "")]
            for name, splits in sorted(files.items()) for split, paths in sorted(splits.items())]
    return _table(["config", "split", "rows", "shards", "what"], rows)


def _count_lines(report: dict) -> list[str]:
    """Records per source, then the quarantine's reasons."""
    counted = ["read", "written", "quarantined", "duplicates"]
    lines = _table(["source", *counted],
                   [[name, *(e[c] for c in counted)] for name, e in sorted(report["sources"].items())]
                   + [["**total**", *(report["total"][c] for c in counted)]])
    lines += ["", "Per source, read = written + quarantined + duplicates."]
    lines += ["", "## Quarantine", ""]
    reasons = report["total"].get("reasons", {})
    lines += (_table(["reason", "records"], [[f"`{r}`", n] for r, n in sorted(reasons.items())]) if reasons
              else ["Nothing was quarantined."])
    return lines + ["", "The quarantined records, with their raw input and a reason code, are in `quarantine/`.", ""]


def _held_out_lines(held_out: dict | None) -> list[str]:
    lines = ["## Held-out evaluation tasks", ""]
    if not (held_out or {}).get("splits"):
        return lines + ["No eval split was held out of this build.", ""]
    return (lines + ["Trajectories of these eval splits' tasks were quarantined as `contaminated` (trajforge "
                     "`pipeline/evaluation/splits.py`; split name and fingerprint of its task files):", ""]
            + _table(["eval split", "fingerprint"], [[f"`{n}`", f"`{f}`"] for n, f in sorted(held_out["splits"].items())])
            + [""])


def _validation_lines(by_env: dict | None) -> list[str]:
    if not by_env:
        return []
    return (["## Validation per environment", "",
             "Every trained action is checked against its environment's action grammar, and every "
             "episode against its env's end rule (trajforge `pipeline/ingest/grammars.py`).", ""]
            + _table(VALIDATION_HEADER, validation_rows(by_env)) + [""])


def render_card(out: Path, report: dict, provenance: list[dict], build: str, code: str,
                notes: dict[str, str], shards: dict[str, dict] | None = None) -> str:
    """The full README.md text for the build in `out`; `notes`: config name -> what it holds;
    `shards`: the `shard_stats` of shards already known (relative path -> stats), the others are read."""
    files = layout(out)
    stats = _shards_stats(out, files, shards)
    licenses = source_licenses(stats)
    # Files read as one source at the builder's word that look like another's: the other's license
    # is stated too, since the card cannot tell which one holds.
    looked_like = {u["looks_like"] for u in provenance if u.get("looks_like")}
    data = card_data(out, files, {**licenses, **{f"looks like {o}": [REGISTRY[o].license] for o in looked_like}}, stats)
    lines = ["---", data.to_yaml(), "---", "", "# trajforge agent trajectories", "",
             "Agent trajectories from public datasets, normalized to one ReAct record schema by "
             "[trajforge](https://github.com/trajforge/trajforge): every input record is either in a "
             "config below, in the quarantine (with a reason), or in the duplicate map.", "",
             f"- build id: `{build}`", f"- code version: `{code}`", "", "## Configs", ""]
    lines += _config_lines(stats, files, notes)
    lines += ["", "```python", "from datasets import load_dataset",
              'ds = load_dataset("<this repo or folder>", "sft", split="train")', "```", "", "## Counts", ""]
    lines += _count_lines(report)
    lines += _held_out_lines(report.get("held_out"))
    lines += _validation_lines(report.get("validation_by_env"))
    lines += _grounding_lines(report.get("validation_by_env"))
    lines += _dedup_lines(report.get("duplicates")) + _negative_lines(report.get("negatives"))
    lines += _steps_lines(report.get("search_steps"))
    lines += ["## Schema", "", f"Record schema `trajectory` {load_schema('trajectory').get('version', '')} "
              "(JSON Schema in the trajforge repository, `schemas/trajectory.schema.json`).", ""]
    lines += _schema_lines()
    lines += ["", "## Sources, licenses and provenance", "",
              "Each record keeps its upstream license in its `license` column; use of a record is governed "
              "by the license of its source.", ""]
    lines += _table(["source", "upstream repo", "revision", "license (as its card states)"],
                    _provenance_rows(provenance, licenses))
    return "\n".join(lines) + "\n"


def write_card(out: Path, report: dict, provenance: list[dict], build: str, code: str,
               notes: dict[str, str], shards: dict[str, dict] | None = None) -> Path:
    path = out / "README.md"
    write_text(path, render_card(out, report, provenance, build, code, notes, shards))
    return path
