"""report.json of a build, from the stages' tallies and the outputs' counts.

Every count of records comes from a `StageTally` (pipeline/stages.py): per file, the unit's map
stages' tallies and its share of each global stage's tally (pipeline/build/global_stages.py), in
stage order. A file read `read` records (the first stage's in) and wrote `written` (the last
stage's kept); what a stage dropped is `quarantined` (by reason) or, for a stage whose outcome is
the duplicates map, `duplicates`; so read = written + quarantined + duplicates holds by
construction. Sources add up their files, the total its sources; the `stages` section is each
stage's tally over the whole build.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from trajforge.pipeline.build.global_stages import DUPLICATES, StageRun
from trajforge.pipeline.stages import StageTally, merge_tallies

if TYPE_CHECKING:
    from trajforge.pipeline.build.units import UnitResult

COUNTED = ("read", "written", "quarantined")


def counts_of(tallies: list[StageTally], duplicate_stages: set[str]) -> dict:
    """read, written, quarantined, duplicates and the quarantine reasons of one unit's stages."""
    reasons: Counter[str] = Counter()
    duplicates = 0
    for tally in tallies:
        if tally.stage in duplicate_stages:
            duplicates += sum(tally.dropped.values())
        else:
            reasons.update(tally.dropped)
    return {"read": tallies[0].seen if tallies else 0, "written": tallies[-1].kept if tallies else 0,
            "quarantined": sum(reasons.values()), "duplicates": duplicates, "reasons": dict(reasons)}


def _add(entry: dict, counts: dict) -> None:
    for key in (*COUNTED, "duplicates"):
        entry[key] += counts[key]
    for reason, n in counts["reasons"].items():
        entry["reasons"][reason] = entry["reasons"].get(reason, 0) + n


def _empty() -> dict:
    return {"read": 0, "written": 0, "quarantined": 0, "duplicates": 0, "reasons": {}}


def source_counts(units: list[UnitResult], runs: list[StageRun]) -> dict:
    """Per source (and per file of it) and in total: read, written, quarantined, duplicates, reasons."""
    duplicate_stages = {run.stage.name for run in runs if run.stage.outcome == DUPLICATES}
    sources: dict[str, dict] = {}
    for u, unit in enumerate(units):
        tallies = [*map(StageTally.from_dict, unit.stages), *(run.unit_tallies[u] for run in runs)]
        counts = counts_of(tallies, duplicate_stages)
        entry = sources.setdefault(unit.source, {**_empty(), "files": {}})
        _add(entry, counts)
        file = entry["files"].setdefault(unit.source_file, {key: 0 for key in (*COUNTED, "duplicates")})
        for key in (*COUNTED, "duplicates"):
            file[key] += counts[key]
        if unit.note:
            file["note"] = unit.note
    total = _empty()
    for entry in sources.values():
        _add(total, entry)
    return {"sources": sources, "total": total}


def stage_tallies(units: list[UnitResult], runs: list[StageRun]) -> list[StageTally]:
    """Every stage of the build in order with its tally: the map stages summed over the units, then
    the global ones as they reported themselves."""
    return [*merge_tallies([[StageTally.from_dict(entry) for entry in unit.stages] for unit in units]),
            *(run.tally for run in runs)]


def summary_lines(report: dict) -> list[str]:
    """The short human summary printed at the end of a build."""
    lines = [f"{'source':<14}{'read':>8}{'written':>9}{'quarant.':>10}{'dups':>7}  reasons"]
    for name, entry in sorted(report["sources"].items()):
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(entry["reasons"].items())) or "-"
        lines.append(f"{name:<14}{entry['read']:>8}{entry['written']:>9}{entry['quarantined']:>10}"
                     f"{entry.get('duplicates', 0):>7}  {reasons}")
    t = report["total"]
    lines.append(f"{'total':<14}{t['read']:>8}{t['written']:>9}{t['quarantined']:>10}{t.get('duplicates', 0):>7}")
    lines += _stage_line(report.get("stages", []))
    shards = [f"{name} {len(paths)}" for name, paths in report.get("outputs", {}).items()
              if name not in ("quarantine", "duplicates")]
    if shards:
        lines.append("shards: " + ", ".join(shards))
    return lines + [f"warning: {w}" for w in report.get("warnings", [])]


def _stage_line(stages: list[dict]) -> list[str]:
    if not stages:
        return []
    steps = [f"{s['stage']} {s['kept']}" + (f" (-{s['in'] - s['kept']})" if s["in"] > s["kept"] else "") for s in stages]
    return ["stages: " + " -> ".join(steps)]
