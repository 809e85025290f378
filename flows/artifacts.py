"""Prefect artifacts of the flow runs, made from the report dicts the stages return (no counting here).

Keys are stable per flow (`build-sources`, `synth-outcomes`, `release-files`, ...), so the UI's
Artifacts page shows each table's history across runs; every run has its own copy under its
Artifacts tab.
"""
from __future__ import annotations

from pathlib import Path
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)


def _markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def source_rows(report: dict) -> list[dict]:
    """Per source and stage: read -> written | quarantined | duplicates, and the total."""
    rows = [{"source": name, **{k: entry.get(k, 0) for k in ("read", "written", "quarantined", "duplicates")}}
            for name, entry in sorted(report["sources"].items())]
    total = report["total"]
    return rows + [{"source": "total", **{k: total.get(k, 0) for k in ("read", "written", "quarantined", "duplicates")}}]


def build_artifacts(report: dict, out: str) -> None:
    """Summary, tables (sources, quarantine reasons, duplicates, negatives) and a link to report.html."""
    sources = source_rows(report)
    reasons = [{"source": name, "reason": reason, "records": n}
               for name, entry in sorted(report["sources"].items()) for reason, n in sorted(entry["reasons"].items())]
    duplicates = report.get("duplicates", {})
    negatives = report.get("negatives", {})
    create_table_artifact(sources, key="build-sources", description="Records per source and stage")
    create_table_artifact(reasons or [{"source": "-", "reason": "-", "records": 0}], key="build-quarantine",
                          description="Quarantined records per source and reason")
    create_table_artifact([{"source": s, "duplicates": n} for s, n in duplicates.get("by_source", {}).items()]
                          or [{"source": "-", "duplicates": 0}], key="build-duplicates",
                          description=f"Duplicates removed per source ({duplicates.get('total', 0)} in total)")
    create_table_artifact([{"negative_type": t, "records": n} for t, n in negatives.get("by_type", {}).items()]
                          or [{"negative_type": "-", "records": 0}], key="build-negatives",
                          description="Negative trajectories per type")
    total = report["total"]
    summary = "\n\n".join([
        f"# Build `{out}`",
        f"**{total['written']}** records written of {total['read']} read; {total['quarantined']} quarantined, "
        f"{total.get('duplicates', 0)} duplicates removed; {negatives.get('total', 0)} negatives, "
        f"{negatives.get('preference_pairs', 0)} preference pairs, {report.get('grpo_prompts', 0)} GRPO prompts.",
        _markdown_table(["source", "read", "written", "quarantined", "duplicates"],
                        [list(row.values()) for row in sources]),
    ])
    create_markdown_artifact(summary, key="build-summary", description="Build summary")
    html = Path(out, "report.html").resolve()
    if html.exists():
        create_link_artifact(html.as_uri(), link_text="report.html", key="build-report",
                             description="The build report (plots, duplicate clusters) on the worker's disk")


def outcome_rows(report: dict) -> list[dict]:
    """Every episode (tasks x samples) by outcome: kept record, success not selected, or a failure reason."""
    rows = [{"outcome": "record", "episodes": report["records"]},
            {"outcome": "not_selected", "episodes": report["unselected"]}]
    rows += [{"outcome": reason, "episodes": n} for reason, n in report["failure_reasons"].items()]
    return rows


def synth_artifacts(report: dict, out: str) -> None:
    """Outcomes, success rate of the env and tokens spent."""
    episodes = report["episodes"]
    successes = report["records"] + report["unselected"]
    env = {"env": report["env"], "tasks": report["tasks"], "samples_per_task": report["samples_per_task"],
           "episodes": episodes, "successful_episodes": successes,
           "episode_success_rate": round(successes / episodes, 4) if episodes else 0.0,
           "tasks_with_record": report["tasks_with_record"],
           "task_success_rate": round(report["tasks_with_record"] / report["tasks"], 4) if report["tasks"] else 0.0}
    llm = report["llm"]
    usage = report.get("usage", {})
    create_table_artifact(outcome_rows(report), key="synth-outcomes",
                          description=f"{report['tasks']} tasks x {report['samples_per_task']} samples by outcome")
    create_table_artifact([env], key="synth-success", description="Success rate per env")
    create_table_artifact([{"model": llm["model"], "calls": llm["calls"], "cache_hits": llm["cache_hits"],
                            "retries": llm["retries"], **{k: usage.get(k, 0) for k in
                                                          ("prompt_tokens", "completion_tokens", "total_tokens")}}],
                          key="synth-tokens", description="Model API calls and tokens")
    summary = "\n\n".join([
        f"# Synthesis `{report['env']}` -> `{out}`",
        f"**{report['tasks_with_record']}/{report['tasks']}** tasks with a record "
        f"({env['task_success_rate']:.0%}); {successes}/{episodes} successful episodes; "
        f"{report['failures']} failures.",
        f"Model `{llm['model']}`: {llm['calls']} calls, {llm['cache_hits']} cache hits, {llm['retries']} retries, "
        f"{usage.get('total_tokens', 0)} tokens.",
        _markdown_table(["outcome", "episodes"], [[r["outcome"], r["episodes"]] for r in outcome_rows(report)]),
    ])
    create_markdown_artifact(summary, key="synth-summary", description="Synthesis summary")


def release_artifacts(result: dict, repo: str, revision: str) -> None:
    """Commit, tag and the files verified (or, for a dry run, the plan)."""
    changes = [{"path": p, "change": change} for change in ("added", "changed", "deleted") for p in result[change]]
    counts = f"{len(result['added'])} added, {len(result['changed'])} changed, {len(result['deleted'])} deleted"
    if result["dry_run"]:
        summary = f"# Release plan for `{repo}@{revision}` (dry run)\n\n{counts}."
    else:
        tag = f", tag `{result['tag']}`" if result.get("tag") else ""
        summary = (f"# Release `{repo}@{revision}`\n\ncommit `{result['commit']}`{tag}; {result['verified']} files "
                   f"verified against the manifest; {counts}.")
        create_table_artifact([{"path": p} for p in result["files"]], key="release-files",
                              description=f"Files verified at commit {result['commit']}")
    create_table_artifact(changes or [{"path": "-", "change": "none"}], key="release-changes",
                          description="Files added, changed and deleted by this release")
    create_markdown_artifact(summary, key="release-summary", description="Release summary")


class Progress:
    """A progress artifact updated as a stage advances (at most every `step` percent)."""

    def __init__(self, key: str, description: str, step: float = 5.0):
        self.step = step
        self._shown = 0.0
        self._id: UUID = create_progress_artifact(0.0, key=key, description=description, _sync=True)

    def __call__(self, done: int, total: int) -> None:
        percent = 100.0 * done / total if total else 100.0
        if percent - self._shown >= self.step or (done == total and self._shown < 100.0):
            self._shown = percent
            update_progress_artifact(self._id, percent, _sync=True)
