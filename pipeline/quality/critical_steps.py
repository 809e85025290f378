"""Critical-step selection (ATLaS, Chen et al., ACL Findings 2025): which assistant turns matter.

ATLaS has an oracle LLM read an expert trajectory and name its critical steps, each for one of
four reasons: plan creation (the agent lays out subgoals from what it has seen), critical
observation (it picks out the information that decides what to do next), critical action (an
action that moves the task decisively towards success) and self-correction (it notices an error
and changes course). Fine-tuning with loss on those steps only (~30% of them) beat loss on all.

This stage asks a model, through the synthesis backend (`pipeline.llm`: same server, request
cache, retries and reason codes), for the critical steps of every record and writes the answer
into the turns: `critical` (true/false on every judged assistant turn), `critical_category` and
`critical_reason` on the critical ones (schema 1.1.0). The trainer's `loss_on: critical` then
puts loss on those turns only.

The steps shown to the selector are the assistant turns that carry loss (demo turns and
acknowledgements are context, not steps). Layout of an output folder:

    OUT/<same relative path as the input>.parquet   the records, annotated
    OUT/select_failures.parquet                     records the selector could not judge, with a reason
    OUT/report.json                                 per env: records, steps, critical share, categories
    OUT/.select/requests.sqlite                     the LLM request cache
    OUT/.select/selections.sqlite                   finished selections, so a rerun makes no call

A record the selector could not judge keeps `critical: null` (it is written, never lost) and gets
one failure row. Answers that do not parse are asked again (`max_format_retries`); those failures
are journaled. LLM errors (`llm_error:*`) are not journaled, so the next run tries again.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_json, write_parquet
from trajforge.pipeline.llm.answers import FormatError, ask_parsed
from trajforge.pipeline.llm.client import ChatBackend, LLMConfig, LLMError
from trajforge.pipeline.llm.job import ModelJob
from trajforge.schemas import arrow_schema
from trajforge.schemas.record import SCHEMA_VERSION

log = logging.getLogger("trajforge.critical_steps")

CATEGORIES = ("plan_creation", "critical_observation", "critical_action", "self_correction")

# Bump when the prompt or the parsing changes: journaled selections of another version are not reused.
SELECTOR_VERSION = "atlas-1"

SELECTOR_INSTRUCTIONS = """You judge which steps of an agent's trajectory are critical for its success.

The agent solved a task by alternating steps (its reasoning and one action) with observations from \
the environment. A step is critical when it belongs to one of these four categories:

- plan_creation: the agent sets out a plan or subgoals for the task from what it has observed.
- critical_observation: the agent picks out the piece of information in an observation that \
decides what it must do next.
- critical_action: an action that moves the task decisively towards success (the operation that \
does the work, or the final answer that completes it).
- self_correction: the agent notices that an earlier step went wrong and changes course.

Routine steps (looking around without purpose, repeating an action, formatting) are not critical. \
Usually a minority of the steps, about a third, is critical.

Answer with one JSON object and nothing else:
{"critical_steps": [{"step": <step number>, "category": "<one of the four categories>", \
"reason": "<one sentence>"}]}"""

RETRY_PROMPT = ("Your answer is not a JSON object of the form {\"critical_steps\": [{\"step\": N, \"category\": "
                "\"...\", \"reason\": \"...\"}]} with step numbers from the trajectory and categories from the "
                "four given. Answer again with that JSON object only.")

class SelectionError(FormatError):
    """An answer that is not a usable selection; `reason` is a code."""


def step_turns(conversations: list[dict]) -> list[int]:
    """Indexes (into the conversation) of the turns the selector judges: assistant turns with loss."""
    return [i for i, t in enumerate(conversations) if t["role"] == "assistant" and t["loss"]]


def trajectory_lines(record: dict, max_observation_chars: int = 2000) -> list[str]:
    """The task and the trajectory for a model to read: numbered steps (the trained assistant turns),
    other agent turns as context, observations cut at `max_observation_chars`."""
    conversations = record["conversations"]
    steps = {turn: number for number, turn in enumerate(step_turns(conversations), 1)}
    lines = [f"Task: {record['task']}", ""]
    for i, turn in enumerate(conversations):
        if turn["role"] == "system":
            continue
        text = turn["content"].strip()
        if i in steps:
            lines.append(f"### Step {steps[i]}\n{text}")
        elif turn["role"] == "assistant":
            lines.append(f"### Agent (context, not a step)\n{text}")
        else:
            if len(text) > max_observation_chars:
                text = text[:max_observation_chars] + " [...]"
            lines.append(f"### Observation\n{text}")
    return lines


def selector_messages(record: dict, max_observation_chars: int = 2000) -> list[dict]:
    """The selector's prompt: the task and the trajectory with numbered steps."""
    lines = trajectory_lines(record, max_observation_chars)
    steps = len(step_turns(record["conversations"]))
    lines += ["", f"The trajectory has {steps} steps. Which of them are critical?"]
    return [{"role": "system", "content": SELECTOR_INSTRUCTIONS}, {"role": "user", "content": "\n\n".join(lines)}]


_JSON_OBJECT = re.compile(r"\{.*\}", re.S)


def parse_selection(text: str, n_steps: int) -> dict[int, tuple[str, str]]:
    """{step number (1-based): (category, reason)} from the selector's answer, or SelectionError."""
    match = _JSON_OBJECT.search(text or "")
    if match is None:
        raise SelectionError("no_json", f"no JSON object in the answer ({len(text or '')} chars)")
    try:
        data = json.loads(match.group(0))
    except json.JSONDecodeError as exc:
        raise SelectionError("bad_json", str(exc)) from None
    items = data.get("critical_steps") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise SelectionError("bad_json", "no `critical_steps` list")
    selection: dict[int, tuple[str, str]] = {}
    for item in items:
        step, category, reason = _selected_step(item, n_steps)
        selection[step] = (category, reason)
    return selection


def _selected_step(item: object, n_steps: int) -> tuple[int, str, str]:
    """(step, category, reason) of one entry of `critical_steps`, or SelectionError."""
    if not isinstance(item, dict):
        raise SelectionError("bad_json", f"a step entry is not an object: {item!r}"[:200])
    step, category = item.get("step"), item.get("category")
    if isinstance(step, str) and step.strip().isdigit():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= n_steps:
        raise SelectionError("bad_step", f"step {step!r} is not one of 1..{n_steps}")
    category = re.sub(r"[\s-]+", "_", str(category or "").strip().lower())
    if category not in CATEGORIES:
        raise SelectionError("bad_category", f"category {item.get('category')!r}")
    reason = item.get("reason")
    return step, category, reason.strip() if isinstance(reason, str) else ""


def apply_selection(record: dict, selection: dict[int, tuple[str, str]]) -> dict:
    """The record with every judged step flagged; other turns get null (not judged)."""
    steps = {turn: number for number, turn in enumerate(step_turns(record["conversations"]), 1)}
    conversations = []
    for i, turn in enumerate(record["conversations"]):
        out = {**turn, "critical": None, "critical_category": None, "critical_reason": None}
        if i in steps:
            category, reason = selection.get(steps[i], (None, None))
            out.update(critical=category is not None, critical_category=category, critical_reason=reason)
        conversations.append(out)
    return {**record, "schema_version": SCHEMA_VERSION, "conversations": conversations}


def trajectory_key(version: str, model: str, params: dict, record: dict) -> str:
    """Same prompt version, model, sampling and trajectory -> same judgement (the id is not part of it)."""
    blob = json.dumps({"v": version, "model": model, "params": params, "task": record["task"],
                       "turns": [[t["role"], t["content"], t["loss"]] for t in record["conversations"]]},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


async def select_record(backend: ChatBackend, record: dict, max_format_retries: int = 1,
                        max_tokens: int | None = None) -> dict:
    """{"status": "ok", "selection": {step: [category, reason]}} or {"status": "failed", reason, detail}."""
    n_steps = len(step_turns(record["conversations"]))
    if n_steps == 0:
        return {"status": "failed", "reason": "no_steps", "detail": "no assistant turn carries loss"}
    try:
        selection = await ask_parsed(backend, selector_messages(record), lambda answer: parse_selection(answer, n_steps),
                                     RETRY_PROMPT, max_format_retries, max_tokens)
    except LLMError as exc:
        return {"status": "failed", "reason": f"llm_error:{exc.reason}", "detail": exc.detail}
    except FormatError as exc:
        return {"status": "failed", "reason": exc.reason, "detail": exc.detail}
    return {"status": "ok", "selection": {str(k): list(v) for k, v in sorted(selection.items())}}


@dataclass
class SelectConfig:
    inputs: str                        # a build folder, a synth folder, or one Parquet file of records
    out: str
    llm: LLMConfig
    config_name: str = "sft"           # release config to annotate when `inputs` is a build folder
    backend: str = "openai"
    batch_size: int = 256              # records in flight at once; LLM calls are bounded by llm.concurrency
    max_format_retries: int = 1
    max_tokens: int | None = None
    envs: list[str] = field(default_factory=list)  # only records of these envs are judged (all when empty)


def input_files(inputs: str, config_name: str = "sft") -> tuple[Path, list[Path]]:
    """(root, files): the Parquet files of records to annotate and the folder their output paths are relative to."""
    path = Path(inputs)
    if path.is_file():
        return path.parent, [path]
    for folder in (path / "data" / config_name, path / "data" / "synthetic", path):
        files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        if files:
            return path, files
    raise FileNotFoundError(f"{inputs}: no records (data/{config_name}/*.parquet, data/synthetic/*.parquet, *.parquet)")


def _env_counts() -> dict:
    return {"records": 0, "judged": 0, "failed": 0, "steps": 0, "critical": 0, "categories": Counter()}


async def rewrite_records(files: list[Path], root: Path, out: Path, schema: pa.Schema, batch_size: int,
                          rewrite: Callable[[Path, list[dict]], Awaitable[list[dict]]]) -> tuple[int, int]:
    """Every file's records, `batch_size` at a time, through `rewrite(path, batch)` (the records to write),
    written under `out` at the path the file has under `root`; returns (records read, records written)."""
    read = written = 0
    for path in files:
        records = pq.read_table(path).to_pylist()
        kept: list[dict] = []
        for start in range(0, len(records), batch_size):
            kept += await rewrite(path, records[start:start + batch_size])
        write_parquet(kept, schema, out / path.relative_to(root))
        read, written = read + len(records), written + len(kept)
    return read, written


async def select_steps_async(config: SelectConfig) -> dict:
    out = Path(config.out)
    root, files = input_files(config.inputs, config.config_name)
    if out.resolve() == root.resolve():
        raise ValueError(f"--out {out} would overwrite the input records; choose another folder")
    job = ModelJob.open(out / ".select", config.backend, config.llm, "selections", concurrency=config.batch_size)
    tally = _SelectionTally()

    async def annotate(path: Path, batch: list[dict]) -> list[dict]:
        answers = await asyncio.gather(*(_select_journaled(job, config, r) for r in batch))
        return [tally.annotated(path, record, answer) for record, answer in zip(batch, answers)]

    try:
        await rewrite_records(files, root, out, arrow_schema("trajectory"), config.batch_size, annotate)
    finally:
        await job.close()
    return tally.write(out, files, job)


async def _select_journaled(job: ModelJob, config: SelectConfig, record: dict) -> dict:
    """The selector's answer for one record: skipped (not an env of the run), from the journal, or asked."""
    if config.envs and record["env"] not in config.envs:
        job.counts["skipped_env"] += 1
        return {"status": "skipped"}

    async def ask() -> dict:
        return await select_record(job.backend, record, config.max_format_retries, config.max_tokens)

    def final(answer: dict) -> bool:  # LLM errors are not: the next run asks again
        return not (answer["status"] == "failed" and answer["reason"].startswith("llm_error"))

    key = trajectory_key(SELECTOR_VERSION, job.backend.model, job.backend.params, record)
    return await job.journaled(key, ask, keep=final)


class _SelectionTally:
    """The records annotated so far, per env, and the failure rows of those the selector could not judge."""

    def __init__(self) -> None:
        self.per_env: dict[str, dict] = defaultdict(_env_counts)
        self.failures: list[dict] = []

    def annotated(self, path: Path, record: dict, answer: dict) -> dict:
        """The record with the answer's flags (as it came when skipped or failed), counted."""
        if answer["status"] == "skipped":  # written as it came, counted in `skipped_env`
            return record
        counts = self.per_env[record["env"]]
        counts["records"] += 1
        if answer["status"] != "ok":
            counts["failed"] += 1
            self.failures.append({"id": record["id"], "env": record["env"], "source_file": str(path),
                                  "reason": answer["reason"], "detail": answer["detail"][:1000]})
            return record
        record = apply_selection(record, {int(k): tuple(v) for k, v in answer["selection"].items()})
        steps = [t for t in record["conversations"] if t.get("critical") is not None]
        counts["judged"] += 1
        counts["steps"] += len(steps)
        counts["critical"] += sum(t["critical"] for t in steps)
        counts["categories"].update(t["critical_category"] for t in steps if t["critical"])
        return record

    def write(self, out: Path, files: list[Path], job: ModelJob) -> dict:
        """The failure rows and the report (returned)."""
        failures, per_env = self.failures, self.per_env
        write_parquet(failures, arrow_schema("select_failures"), out / "select_failures.parquet")
        envs = {env: {**counts, "categories": dict(sorted(counts["categories"].items())),
                      "critical_share": round(counts["critical"] / counts["steps"], 4) if counts["steps"] else None}
                for env, counts in sorted(per_env.items())}
        report = {
            "selector": SELECTOR_VERSION, "inputs": [str(p) for p in files],
            "records": sum(c["records"] for c in per_env.values()),
            "judged": sum(c["judged"] for c in per_env.values()),
            "failed": len(failures),
            "failure_reasons": dict(sorted(Counter(f["reason"] for f in failures).items())),
            "selections_run": job.counts["run"], "selections_resumed": job.counts["resumed"],
            "skipped_env": job.counts["skipped_env"], "envs": envs,
            "llm": job.llm_report(),
        }
        write_json(out / "report.json", report)
        log.info("select-steps: %d records, %d judged, %d failed %s; %d calls, %d cache hits", report["records"],
                 report["judged"], report["failed"], report["failure_reasons"], job.stats.calls, job.stats.cache_hits)
        return report


def select_steps(config: SelectConfig) -> dict:
    """Annotate every record (blocking); see the module docstring for the outputs."""
    return asyncio.run(select_steps_async(config))


def summary_lines(report: dict) -> list[str]:
    """The per-env critical share, for people."""
    lines = [f"{env}: {c['judged']}/{c['records']} records judged, {c['critical']}/{c['steps']} steps critical"
             f" ({c['critical_share'] if c['critical_share'] is not None else '-'})"
             for env, c in report["envs"].items()]
    reasons = ", ".join(f"{k}={v}" for k, v in report["failure_reasons"].items()) or "-"
    lines.append(f"{report['failed']} records not judged ({reasons}); {report['llm']['calls']} LLM calls, "
                 f"{report['llm']['cache_hits']} cache hits")
    return lines
