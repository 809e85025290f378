"""report.html of an evaluation, with matplotlib plots in report_files/ (the build report's helpers)."""
from __future__ import annotations

import html
from pathlib import Path

from trajforge.pipeline.atomic import write_text
from trajforge.pipeline.evaluation.metrics import OUTCOMES
from trajforge.pipeline.publish.report import _STYLE, _empty, _save, _table, pyplot

COLORS = {"model": "#4c72b0", "oracle": "#55a868", "random": "#8c8c8c"}
OUTCOME_COLORS = dict(zip(OUTCOMES, ["#55a868", "#c44e52", "#dd8452", "#8172b3", "#ccb974", "#64b5cd", "#937860",
                                     "#da8bc3", "#dddddd"]))


def _figures(report: dict) -> dict[str, dict[str, dict]]:
    """env -> {model | oracle | random: figures}."""
    return {env: {**({"model": e["model"]} if "model" in e else {}), **e["policies"]} for env, e in report["envs"].items()}


def plot_success(report: dict, out: Path) -> str:
    figures = _figures(report)
    fig, ax = pyplot().subplots(figsize=(8, 4))
    if not figures:
        _empty(ax, "no env evaluated")
        return _save(fig, out, "success.png")
    envs = list(figures)
    who = [w for w in ("model", "oracle", "random") if any(w in f for f in figures.values())]
    width = 0.8 / len(who)
    for i, w in enumerate(who):
        xs, ys, low, high = [], [], [], []
        for x, env in enumerate(envs):
            s = figures[env].get(w)
            if not s or s["success_rate"] is None:
                continue
            xs.append(x + (i - (len(who) - 1) / 2) * width)
            ys.append(s["success_rate"])
            low.append(s["success_rate"] - s["success_ci95"][0])
            high.append(s["success_ci95"][1] - s["success_rate"])
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, color=COLORS[w], label=w)
    ax.set_xticks(range(len(envs)), envs)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success rate (95% Wilson interval)")
    ax.set_title(f"Success per env: {report['label']} against the oracle (ceiling) and random (floor)")
    ax.legend(fontsize=8)
    return _save(fig, out, "success.png")


def plot_outcomes(report: dict, out: Path) -> str:
    figures = _figures(report)
    bars = [(f"{env} {w}", s["outcomes"]) for env, f in figures.items() for w, s in f.items()]
    fig, ax = pyplot().subplots(figsize=(8, 1.2 + 0.45 * max(1, len(bars))))
    if not bars:
        _empty(ax, "no episodes")
        return _save(fig, out, "outcomes.png")
    left = [0] * len(bars)
    for o in OUTCOMES:
        values = [counts.get(o, 0) for _, counts in bars]
        if any(values):
            ax.barh([b for b, _ in bars], values, left=left, color=OUTCOME_COLORS[o], label=o)
            left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("episodes")
    ax.set_title("How the episodes ended")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return _save(fig, out, "outcomes.png")


def plot_pass_at_k(report: dict, out: Path) -> str:
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    curves = {env: e["model"]["pass_at_k"] for env, e in report["envs"].items() if "model" in e}
    if not any(len(c) > 1 for c in curves.values()):
        _empty(ax, "pass@k needs more than one sample per task (--n)")
        return _save(fig, out, "pass_at_k.png")
    for env, curve in curves.items():
        ks = [int(k) for k in curve]
        ax.plot(ks, list(curve.values()), marker="o", label=env)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("pass@k (unbiased estimator)")
    return _save(fig, out, "pass_at_k.png")


def _pct(s: dict | None, key: str = "success_rate", ci: str = "success_ci95") -> str:
    if not s or s.get(key) is None:
        return "-"
    return f"{s[key]:.3f} [{s[ci][0]:.3f}, {s[ci][1]:.3f}]"


def write_html(out: Path, report: dict, rows: list[dict]) -> list[Path]:
    """report.html and its plots; returns the files written."""
    plots = {"Success per env, with the calibration policies": plot_success(report, out),
             "Outcomes": plot_outcomes(report, out), "pass@k": plot_pass_at_k(report, out)}
    table = []
    for env, e in report["envs"].items():
        for who, s in [("model", e.get("model")), *e["policies"].items()]:
            if s is None:
                continue
            pak = ", ".join(f"@{k} {v:.3f}" for k, v in s["pass_at_k"].items())
            reasons = ", ".join(f"{o} {n}" for o, n in s["outcomes"].items())
            table.append([env, e["split"], report["label"] if who == "model" else who, s["episodes"], _pct(s),
                          _pct(s, "mean_score", "score_ci95"), pak or "-", s["mean_turns"], s["mean_tokens"], reasons])
    flags = [f"<p class='bad'>{html.escape(env)}: the oracle scores "
             f"{e['policies']['oracle']['success_rate']} on {html.escape(e['split'])}: the env, its scorer or its "
             f"task file is broken; its numbers mean little.</p>" for env, e in report["envs"].items() if e.get("broken")]
    flags += [f"<p class='bad'>{html.escape(w)}</p>" for w in report.get("warnings", [])]
    not_run = [[env, why] for env, why in report["not_run"].items()]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>trajforge eval report</title>",
             f"<style>{_STYLE}</style></head><body><h1>trajforge eval: {html.escape(str(report['label']))}</h1>",
             f"<p>Model <code>{html.escape(str(report['model']))}</code>, {report['n']} sample(s) per task, "
             f"at most {report['agent']['max_turns']} turns. Each env also runs the oracle (the tasks' reference "
             f"solutions: the ceiling) and a random policy (the floor) through the same agent loop.</p>", *flags,
             _table(["env", "split", "policy", "episodes", "success [95% CI]", "mean score [95% CI]", "pass@k",
                     "mean turns", "mean tokens", "outcomes"], table)]
    if not_run:
        parts += ["<h2>Not run here</h2>", _table(["env", "why"], not_run)]
    for title, src in plots.items():
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{html.escape(src)}' alt='{html.escape(title)}'>")
    parts.append(f"<p>{len(rows)} episodes in <code>episodes.parquet</code>.</p></body></html>")
    path = out / "report.html"
    write_text(path, "\n".join(parts))
    return [path, *(out / src for src in plots.values())]
