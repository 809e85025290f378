"""What a build did, for people: counts added to report.json, and report.html with PNG plots.

The counts per source and stage come from the build's tallies (pipeline/build/report.py) and the
outputs' sections from their registry (pipeline/build/outputs.py); `report_extras` adds duplicate
clusters and the shape of the data; `write_html` draws the plots with matplotlib (Agg, no display
needed) next to report.html.
"""
from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from trajforge.pipeline.atomic import atomic_path, write_text

PLOT_DIR = "report_files"


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), loaded at the first plot: it takes ~1 s,
    and every worker process of a build imports this module without drawing anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def value_counts(values: pl.Series) -> dict:
    """{value: count} of a column, by value: a report's counts section."""
    return dict(sorted(values.value_counts().iter_rows()))


def _cross_source_clusters(duplicates: pl.DataFrame) -> list[dict]:
    """The clusters (a kept record and the records dropped for it) of more than one source, by kept id."""
    crossing = duplicates.filter((pl.col("source") != pl.col("kept_source")).any().over("kept_id"))
    members: dict[str, list[dict]] = defaultdict(list)
    for d in crossing.select("id", "source", "kept_id", "kept_source", "match").iter_rows(named=True):
        members[d["kept_id"]].append(d)
    return [{"kept_id": kept_id, "size": len(dups) + 1, "sources": sorted({dups[0]["kept_source"], *(d["source"] for d in dups)}),
             "dropped": sorted(d["id"] for d in dups), "match": sorted({d["match"] for d in dups})}
            for kept_id, dups in sorted(members.items())]


def _summary(values: np.ndarray) -> dict:
    """min, median (as `statistics.median`: the mean of the middle two of an even count) and max."""
    if not len(values):
        return {"min": 0, "median": 0, "max": 0}
    ordered = np.sort(values)
    middle = len(ordered) // 2
    median = int(ordered[middle]) if len(ordered) % 2 else (int(ordered[middle - 1]) + int(ordered[middle])) / 2
    return {"min": int(ordered[0]), "median": median, "max": int(ordered[-1])}


def report_extras(report: dict, duplicates: pl.DataFrame, turns: np.ndarray, chars: np.ndarray) -> None:
    """Dedup and data-shape sections of report.json (in place). `duplicates` is the duplicates map
    (pipeline/build/second_half.py `write_duplicates`); `turns` and `chars` are per written
    trajectory: its number of turns and of characters."""
    cross = duplicates.filter(pl.col("source") != pl.col("kept_source"))
    report["duplicates"] = {
        "total": duplicates.height,
        "by_match": value_counts(duplicates["match"]),
        "by_source": value_counts(duplicates["source"]),
        "cross_source": value_counts(cross.select(pl.format("{} -> {}", "source", "kept_source")).to_series()),
        "clusters": duplicates["kept_id"].n_unique(),
        "cross_source_clusters": _cross_source_clusters(duplicates),
    }
    report["shape"] = {"turns": _summary(turns), "chars": _summary(chars)}


VALIDATION_HEADER = ["env", "grammar", "records", "actions checked", "valid by grammar", "quarantined by rule"]


def validation_rows(figures: dict[str, dict]) -> list[list]:
    """One row per env of `report["validation_by_env"]`, for the html report and the card."""
    rows = []
    for env, e in sorted(figures.items()):
        checked, valid = e["actions_checked"], e["actions_valid"]
        share = f"{valid} ({valid / checked:.1%})" if checked else "-"
        rules = ", ".join(f"{rule} {n}" for rule, n in sorted(e["quarantined"].items())) or "-"
        rows.append([env, "yes" if e["grammar"] else "none", e["records"], e["actions_checked"], share, rules])
    return rows


GROUNDING_HEADER = ["env", "records kept with masked steps", "steps masked", "refused by rule",
                    "grammar-only by rule", "unconfirmed by rule"]
GROUNDING_NOTE = ("Each trained step checked against what the environment answered (pipeline/ingest/validate.py): "
                  "refused (the env said so; masked, loss false, when the episode goes on), grammar-only (our "
                  "grammar breaks, the env answered normally: kept and trained), unconfirmed (the grammar breaks "
                  "and no observation follows: quarantined as invalid_action). A refused step is counted under "
                  "the grammar rule it breaks, or else under the env's refusal reply.")


def _by_rule(counts: dict[str, int]) -> str:
    return ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items())) or "-"


def grounding_rows(figures: dict[str, dict]) -> list[list]:
    """One row per env of `report["validation_by_env"]` that had a step refused, grammar-only or
    unconfirmed: for the html report and the card."""
    return [[env, e["records_masked"], e["steps_masked"], _by_rule(e["refused"]), _by_rule(e["grammar_only"]),
             _by_rule(e["unconfirmed"])]
            for env, e in sorted(figures.items()) if e["refused"] or e["grammar_only"] or e["unconfirmed"]]


# --- plots ----------------------------------------------------------------------------------

def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    with atomic_path(out / PLOT_DIR / name) as tmp:
        fig.savefig(tmp, dpi=100, format=Path(name).suffix[1:])
    pyplot().close(fig)
    return f"{PLOT_DIR}/{name}"


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _whole_numbers(*axes) -> None:
    """Ticks at whole numbers only: these axes count records, and 2.5 records means nothing."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def _barh(ax, counts: dict, title: str, color: str) -> None:
    if not counts:
        _empty(ax, f"{title}: none")
        return
    items = sorted(counts.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color=color)
    for y, (_, v) in enumerate(items):
        ax.text(v, y, f" {v}", va="center", fontsize=8)
    ax.set_title(title)
    _whole_numbers(ax.xaxis)


def plot_stages(report: dict, out: Path) -> str:
    sources = sorted(report["sources"])
    columns = [("written", "#4c72b0"), ("quarantined", "#dd8452"), ("duplicates", "#8c8c8c")]
    fig, ax = pyplot().subplots(figsize=(8, 1.2 + 0.6 * len(sources)))
    left = [0] * len(sources)
    for column, color in columns:
        values = [report["sources"][s].get(column, 0) for s in sources]
        ax.barh(sources, values, left=left, color=color, label=column)
        left = [a + b for a, b in zip(left, values)]
    for y, s in enumerate(sources):
        ax.text(left[y], y, f" read {report['sources'][s]['read']}", va="center", fontsize=8)
    ax.set_xlabel("records")
    ax.set_title("Where every input record went, per source")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_xlim(0, max(left) * 1.15 if max(left, default=0) else 1)
    _whole_numbers(ax.xaxis)
    return _save(fig, out, "stages.png")


def plot_quarantine(report: dict, out: Path) -> str:
    fig, ax = pyplot().subplots(figsize=(8, 1.5 + 0.35 * max(1, len(report["total"]["reasons"]))))
    _barh(ax, report["total"]["reasons"], "Quarantine reasons", "#dd8452")
    return _save(fig, out, "quarantine.png")


def plot_duplicates(duplicates: pl.DataFrame, out: Path) -> str:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    if duplicates.is_empty():
        _empty(ax, "no duplicates")
        return _save(fig, out, "duplicates.png")
    dropped = sorted(duplicates["source"].unique().to_list())
    kept = sorted(duplicates["kept_source"].unique().to_list())
    pairs = {(s, k): n for s, k, n in duplicates.group_by("source", "kept_source").len().iter_rows()}
    grid = [[pairs.get((s, k), 0) for k in kept] for s in dropped]
    ax.imshow(grid, cmap="Blues")
    top = max(max(row) for row in grid)
    ax.set_xticks(range(len(kept)), kept, rotation=20)
    ax.set_yticks(range(len(dropped)), dropped)
    for y, row in enumerate(grid):
        for x, n in enumerate(row):
            ax.text(x, y, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
    ax.set_xlabel("kept record's source")
    ax.set_ylabel("dropped record's source")
    ax.set_title("Duplicates: dropped -> kept, by source")
    return _save(fig, out, "duplicates.png")


def plot_mix(report: dict, out: Path) -> str:
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 5))
    _barh(a, report["domains"], "Domains", "#55a868")
    _barh(b, report["envs"], "Environments", "#64b5cd")
    return _save(fig, out, "mix.png")


def plot_lengths(turns: Sequence[int], chars: Sequence[int], out: Path) -> str:
    """Histograms of `turns` and `chars`: numpy arrays at scale (matplotlib checks a list's values
    one by one, ~2 s for a million)."""
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4))
    if len(turns):
        a.hist(turns, bins=30, color="#4c72b0")
        b.hist(chars, bins=30, color="#8172b3")
    a.set_title("Turns per trajectory")
    a.set_xlabel("turns")
    b.set_title("Characters per trajectory")
    b.set_xlabel("characters")
    for ax in (a, b):
        ax.set_ylabel("trajectories")
    _whole_numbers(a.xaxis, a.yaxis, b.yaxis)
    return _save(fig, out, "lengths.png")


def plot_negatives(report: dict, out: Path) -> str:
    by_type = report["negatives"]["by_type"]
    fig, ax = pyplot().subplots(figsize=(8, 1.5 + 0.35 * max(1, len(by_type))))
    _barh(ax, by_type, "Negatives per type", "#c44e52")
    return _save(fig, out, "negatives.png")


# --- html -----------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STEPS_HEADER = ["config", "rows read", "written", "dropped by reason"]
STEPS_NOTE = ("Step-level data of tree searches (`trajforge synth --search`), from the synthetic source's search "
              "outputs. A row is written when its task's trajectory is in `sft`; otherwise it is dropped under the "
              "reason the trajectory is not (contaminated, duplicate, its quarantine reason, or no_trajectory: the "
              "search found no success), or as invalid when it breaks its schema.")


def steps_rows(counts: dict[str, dict]) -> list[list]:
    """One row per step config of `report["search_steps"]`, for the html report and the card."""
    return [[name, c["read"], c["written"], ", ".join(f"{r} {n}" for r, n in c["dropped"].items()) or "-"]
            for name, c in sorted(counts.items())]


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.ok{color:#2a7a2a}.bad{color:#b22}"""


def write_html(out: Path, report: dict, duplicates: pl.DataFrame, turns: Sequence[int], chars: Sequence[int]) -> list[Path]:
    """report.html and its PNGs under `out`; returns the files written (`turns`, `chars`: as in
    report_extras, or as numpy arrays: see plot_lengths)."""
    plots = {"Counts per source and stage": plot_stages(report, out),
             "Quarantine reasons": plot_quarantine(report, out),
             "Duplicate clusters across sources": plot_duplicates(duplicates, out),
             "Domain and environment mix": plot_mix(report, out),
             "Turns and length": plot_lengths(turns, chars, out),
             "Negatives per type": plot_negatives(report, out)}
    total = report["total"]
    balanced = all(e["read"] == e["written"] + e["quarantined"] + e.get("duplicates", 0)
                   for e in [*report["sources"].values(), total])
    rows = [[name, e["read"], e["written"], e["quarantined"], e.get("duplicates", 0)]
            for name, e in sorted(report["sources"].items())]
    rows.append(["total", total["read"], total["written"], total["quarantined"], total.get("duplicates", 0)])
    clusters = [[c["kept_id"], c["size"], ", ".join(c["sources"]), ", ".join(c["match"])]
                for c in report["duplicates"]["cross_source_clusters"]]
    neg = report["negatives"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>trajforge build report</title>",
        f"<style>{_STYLE}</style></head><body><h1>trajforge build report</h1>",
        f"<p>Records read: <b>{total['read']}</b>, written to <code>sft</code>: <b>{total['written']}</b>, "
        f"quarantined: <b>{total['quarantined']}</b>, duplicates dropped: <b>{total.get('duplicates', 0)}</b>. "
        f"Negatives: <b>{neg['total']}</b>, preference pairs: <b>{neg['preference_pairs']}</b>, "
        f"GRPO prompts: <b>{report['grpo_prompts']}</b>.</p>",
        f"<p class='{'ok' if balanced else 'bad'}'>read = written + quarantined + duplicates: "
        f"{'holds for every source' if balanced else 'DOES NOT HOLD'}</p>",
        _table(["source", "read", "written", "quarantined", "duplicates"], rows),
        "<h2>Validation per environment</h2><p>Every trained action checked against its env's grammar "
        "(pipeline/ingest/grammars.py); records quarantined per env by grammar rule or reason.</p>",
        _table(VALIDATION_HEADER, validation_rows(report.get("validation_by_env", {}))),
        f"<h3>Steps grounded in the environment's answers</h3><p>{html.escape(GROUNDING_NOTE)}</p>",
        _table(GROUNDING_HEADER, grounding_rows(report.get("validation_by_env", {}))),
    ]
    if report.get("search_steps"):
        parts += [f"<h2>Step-level data</h2><p>{html.escape(STEPS_NOTE)}</p>",
                  _table(STEPS_HEADER, steps_rows(report["search_steps"]))]
    for title, src in plots.items():
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{html.escape(src)}' alt='{html.escape(title)}'>")
        if title == "Duplicate clusters across sources" and clusters:
            parts.append(_table(["kept id", "cluster size", "sources", "match"], clusters))
    parts.append("</body></html>")
    path = out / "report.html"
    write_text(path, "\n".join(parts))
    return [path, *(out / src for src in plots.values())]
