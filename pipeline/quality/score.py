"""Scoring trajectories: a reward model or an LLM judge gives every record a score; `min_score` filters.

AgentOhana scores every ingested trajectory with AgentRater before training; this stage does the same
with one of three scorers, behind one interface (`Scorer.ascore(records) -> scores`):

    rm      an outcome reward model (`trajforge train rm`): its scalar for the whole conversation
    prm     a process reward model (`trajforge train prm`): the lowest P(good) over the trained steps
    judge   an LLM as judge (AgentRater-style rubric, 0-5) over any OpenAI-compatible server, through
            the synthesis backend (request cache, retries, reason codes) with a call budget

Each scorer has its own scale (an RM logit, a probability, a 0-5 rating): pick `min_score` on it.
A record scored below `min_score` moves to the quarantine with reason `low_score` (detail: the score,
the threshold and the scorer); a record the judge could not rate keeps a null score, is written and
counted under `unscored`, never dropped. Layout of an output folder:

    OUT/data/<config>/<same file>.parquet   the records with a `score` column
    OUT/quarantine/quarantine.parquet       the input build's quarantine rows + the low_score ones
    OUT/duplicates.parquet                  the input build's duplicate map, as it was
    OUT/report.json                         score distribution per source and env, counts, and for a
                                            build the totals again: read = written + quarantined + duplicates
    OUT/.score/                             the judge's request cache and ratings journal (a rerun makes no call)

`rank_candidates(scorer, candidates)` orders candidate trajectories (best-of-N, tree search) best first.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_json, write_parquet
from trajforge.pipeline.llm.answers import FormatError, ask_parsed
from trajforge.pipeline.llm.client import LLMConfig, LLMError
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.quality.critical_steps import input_files, rewrite_records, trajectory_key, trajectory_lines
from trajforge.pipeline.quarantine import quarantine_entry, shown
from trajforge.pipeline.registry import Registry
from trajforge.pipeline.synth.salvage import CallBudget
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.score")

SCORED_SCHEMA = arrow_schema("trajectory").append(pa.field("score", pa.float64()))

# Bump when the rubric or the parsing changes: journaled ratings of another version are not reused.
JUDGE_VERSION = "agentrater-1"

JUDGE_INSTRUCTIONS = """You rate an AI agent's trajectory as training data for agents.

The agent worked on a task by alternating steps (its reasoning and one action) with observations \
from the environment. Rate the whole trajectory from 0 to 5:

- 5: the task is solved; every step is valid, follows from what the agent observed, and moves the task on.
- 4: the task is solved, with a minor flaw: a redundant step or thin reasoning.
- 3: the task is probably solved, with a notable flaw: a detour, an error the agent recovers from, \
an answer only partly supported by the observations.
- 2: major flaws: invalid, repeated or hallucinated actions, reasoning that ignores the observations, \
an answer the trajectory does not support.
- 1: the task is not solved.
- 0: unusable: off task, broken format, incoherent.

Answer with one JSON object and nothing else: {"rating": <integer 0-5>, "reason": "<one sentence>"}"""

RETRY_PROMPT = ("Your answer is not a JSON object of the form {\"rating\": N, \"reason\": \"...\"} with N an "
                "integer from 0 to 5. Answer again with that JSON object only.")


def conversation(record: dict) -> list[dict]:
    """A record's turns as chat messages, with the loss flags a process reward model reads."""
    return [{"role": t["role"], "content": t["content"], "loss": t["loss"]} for t in record["conversations"]]


class Scorer(Protocol):
    name: str

    async def ascore(self, records: list[dict]) -> list[dict]:
        """Per record {"score": float | None, "reason": why there is none}."""
        ...

    async def aclose(self) -> None: ...


class ModelScorer:
    """A trained reward model (`training.reward_model.RewardModel` or
    `training.process_reward_model.ProcessRewardModel`) as a scorer."""

    def __init__(self, name: str, model):
        self.name = name
        self.model = model

    async def ascore(self, records: list[dict]) -> list[dict]:
        scores = self.model.score([conversation(r) for r in records])
        return [{"score": s, "reason": None if s is not None else "no_step"} for s in scores]

    async def aclose(self) -> None:
        return None


_JSON_OBJECT = re.compile(r"\{.*\}", re.S)


def parse_rating(text: str) -> float:
    """The rating (0-5) in the judge's answer, or FormatError naming what is wrong (`no_json`, `bad_rating`)."""
    match = _JSON_OBJECT.search(text or "")
    try:
        data = json.loads(match.group(0)) if match else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise FormatError("no_json")
    rating = data.get("rating")
    if isinstance(rating, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", rating):
        rating = float(rating)
    if isinstance(rating, bool) or not isinstance(rating, (int, float)) or not 0 <= rating <= 5:
        raise FormatError("bad_rating")
    return float(rating)


class JudgeScorer:
    """An LLM judge with an AgentRater-style rubric (JUDGE_INSTRUCTIONS). Every answer is journaled by
    (rubric version, model, sampling, trajectory), so a rerun asks nothing it asked before; LLM errors
    are not journaled (the next run asks again). `max_calls` bounds the requests sent (cache hits are free)."""

    name = "judge"

    def __init__(self, llm: LLMConfig, state: Path, concurrency: int, backend: str = "openai",
                 max_calls: int | None = None, max_format_retries: int = 1, max_tokens: int | None = None):
        self.job = ModelJob.open(state, backend, llm, "ratings", concurrency)
        self.backend = CallBudget(self.job.backend, max_calls)
        self.max_format_retries = max_format_retries
        self.max_tokens = max_tokens

    async def rate(self, record: dict) -> dict:
        messages = [{"role": "system", "content": JUDGE_INSTRUCTIONS},
                    {"role": "user", "content": "\n\n".join(trajectory_lines(record) + ["", "Your rating?"])}]
        try:
            rating = await ask_parsed(self.backend, messages, parse_rating, RETRY_PROMPT, self.max_format_retries,
                                      self.max_tokens)
        except LLMError as exc:
            return {"score": None, "reason": f"llm_error:{exc.reason}"}
        except FormatError as exc:
            return {"score": None, "reason": exc.reason}
        return {"score": rating, "reason": None}

    async def rate_journaled(self, record: dict) -> dict:
        key = trajectory_key(JUDGE_VERSION, self.backend.model, self.backend.params, record)
        return await self.job.journaled(key, lambda: self.rate(record),
                                        keep=lambda answer: not (answer["reason"] or "").startswith("llm_error"))

    async def ascore(self, records: list[dict]) -> list[dict]:
        return list(await asyncio.gather(*(self.rate_journaled(r) for r in records)))

    def stats(self) -> dict:
        stats = self.backend.stats
        return {"model": self.backend.model, "sampling": self.backend.params, "calls": stats.calls,
                "cache_hits": stats.cache_hits, "retries": stats.retries, "ratings_resumed": self.job.counts["resumed"],
                "budget": self.backend.max_calls, "refused_by_budget": self.backend.refused}

    async def aclose(self) -> None:
        await self.job.close()


@dataclass
class ScoreConfig:
    inputs: str                        # a build folder, a synth folder, or one Parquet file of records
    out: str
    scorer: str = "rm"                 # rm | prm | judge
    model: str = ""                    # the trained model's folder (rm, prm) or the judge model's name
    min_score: float | None = None     # records scored below it go to the quarantine (low_score)
    config_name: str = "sft"
    batch_size: int = 64
    max_length: int | None = None      # rm / prm: tokens per trajectory (rm keeps the end, prm the start)
    llm: LLMConfig | None = None       # judge: server, sampling, concurrency (model is `model`)
    backend: str = "openai"
    max_calls: int | None = None       # judge: requests sent at most in this run
    max_tokens: int | None = None


def _rm(config: ScoreConfig) -> ModelScorer:
    from trajforge.training.reward_model import RewardModel

    return ModelScorer("rm", RewardModel.load(config.model, config.max_length))


def _prm(config: ScoreConfig) -> ModelScorer:
    from trajforge.training.process_reward_model import ProcessRewardModel

    return ModelScorer("prm", ProcessRewardModel.load(config.model, config.max_length))


def _judge(config: ScoreConfig) -> JudgeScorer:
    llm = LLMConfig(**{**asdict(config.llm or LLMConfig()), "model": config.model})
    return JudgeScorer(llm, Path(config.out) / ".score", config.batch_size, config.backend, config.max_calls,
                       max_tokens=config.max_tokens)


SCORERS: Registry[Any] = Registry("scorer", {"rm": _rm, "prm": _prm, "judge": _judge})


def distribution(scores: list[float]) -> dict:
    if not scores:
        return {"n": 0}
    ordered = sorted(scores)
    quantile = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "mean": round(statistics.fmean(ordered), 4), "min": round(ordered[0], 4),
            "p10": round(quantile(0.1), 4), "median": round(statistics.median(ordered), 4),
            "p90": round(quantile(0.9), 4), "max": round(ordered[-1], 4)}


def _build_totals(root: Path, dropped: Counter[str]) -> dict | None:
    """The input build's totals with the low_score records moved from written to quarantined."""
    try:
        total = json.loads((root / "report.json").read_text())["total"]
    except (OSError, ValueError, KeyError):
        return None
    moved = sum(dropped.values())
    reasons = dict(total.get("reasons", {}))
    if moved:
        reasons["low_score"] = reasons.get("low_score", 0) + moved
    return {**total, "written": total["written"] - moved, "quarantined": total["quarantined"] + moved,
            "reasons": dict(sorted(reasons.items()))}


async def score_async(config: ScoreConfig, scorer: Scorer | None = None) -> dict:
    out = Path(config.out)
    root, files = input_files(config.inputs, config.config_name)
    if out.resolve() == root.resolve():
        raise ValueError(f"--out {out} would overwrite the input records; choose another folder")
    scorer = scorer or SCORERS[config.scorer](config)
    tally = _ScoreTally(scorer.name, config.min_score)

    async def score_batch(path: Path, batch: list[dict]) -> list[dict]:
        return tally.kept(batch, await scorer.ascore(batch))

    try:
        records_read, written = await rewrite_records(files, root, out, SCORED_SCHEMA, config.batch_size, score_batch)
    finally:
        llm = scorer.stats() if isinstance(scorer, JudgeScorer) else None
        await scorer.aclose()

    earlier = root / "quarantine" / "quarantine.parquet"
    rows = (pq.read_table(earlier).to_pylist() if earlier.is_file() else []) + tally.quarantined
    write_parquet(rows, arrow_schema("quarantine"), out / "quarantine" / "quarantine.parquet")
    if (root / "duplicates.parquet").is_file():
        shutil.copyfile(root / "duplicates.parquet", out / "duplicates.parquet")
    report = {
        "scorer": scorer.name, "model": config.model, "min_score": config.min_score,
        "inputs": [str(p) for p in files], "records": records_read, "written": written, **tally.counts(),
    }
    if llm is not None:
        report["llm"] = llm
    totals = _build_totals(root, tally.dropped) if config.config_name == "sft" else None
    if totals is not None:
        report["total"] = totals
    write_json(out / "report.json", report)
    log.info("score: %d records, %d written, %d low_score, %d unscored", records_read, written,
             report["low_score"], report["unscored"])
    return report


class _ScoreTally:
    """The scores so far by source and env, the unscored records by reason, and the low_score ones
    moved to the quarantine."""

    def __init__(self, scorer: str, min_score: float | None):
        self.scorer = scorer
        self.min_score = min_score
        self.by: dict[str, dict[str, list[float]]] = {"source": defaultdict(list), "env": defaultdict(list)}
        self.unscored: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.quarantined: list[dict] = []

    def kept(self, batch: list[dict], results: list[dict]) -> list[dict]:
        """The batch's records to write, with their score; the low_score ones go to the quarantine."""
        kept = []
        for record, result in zip(batch, results):
            score = result["score"]
            if score is None:
                self.unscored[result["reason"]] += 1
            else:
                self.by["source"][record["source"]].append(score)
                self.by["env"][record["env"]].append(score)
            if score is not None and self.min_score is not None and score < self.min_score:
                self.dropped[record["source"]] += 1
                self.quarantined.append(quarantine_entry(
                    record["source"], record["source_file"], json.loads(record["meta"]).get("source_index", -1),
                    record["source_id"], "low_score",
                    f"{self.scorer} score {score:.4g} < min_score {self.min_score:g}", shown(record)))
            else:
                kept.append({**record, "score": score})
        return kept

    def counts(self) -> dict:
        """The report's counts and score distributions."""
        by, dropped, unscored = self.by, self.dropped, self.unscored
        return {
            "low_score": sum(dropped.values()), "low_score_by_source": dict(sorted(dropped.items())),
            "unscored": sum(unscored.values()), "unscored_reasons": dict(sorted(unscored.items())),
            "scores": distribution([s for scores in by["source"].values() for s in scores]),
            "by_source": {k: distribution(v) for k, v in sorted(by["source"].items())},
            "by_env": {k: distribution(v) for k, v in sorted(by["env"].items())},
        }


def score_records(config: ScoreConfig) -> dict:
    """Score every record (blocking); see the module docstring for the outputs."""
    return asyncio.run(score_async(config))


def summary_lines(report: dict) -> list[str]:
    """The score distribution per source and env, for people."""
    lines = [f"{kind} {name}: n={d['n']} mean={d.get('mean')} median={d.get('median')} min={d.get('min')} "
             f"max={d.get('max')}" for kind in ("source", "env") for name, d in report[f"by_{kind}"].items()]
    lines.append(f"{report['records']} records scored by {report['scorer']}: {report['written']} written, "
                 f"{report['low_score']} to the quarantine as low_score (min_score {report['min_score']}), "
                 f"{report['unscored']} unscored {report['unscored_reasons'] or ''}".rstrip())
    if "llm" in report:
        lines.append(f"{report['llm']['calls']} LLM calls, {report['llm']['cache_hits']} cache hits, "
                     f"{report['llm']['ratings_resumed']} ratings from the journal")
    return lines


def rank_candidates(scorer, candidates: list[list[dict]]) -> list[tuple[int, float | None]]:
    """(index, score) of each candidate conversation, best first (unscored last); `scorer` is anything
    with `score(conversations)`, a trained `RewardModel` or `ProcessRewardModel`."""
    scores = scorer.score(candidates)
    return sorted(enumerate(scores), key=lambda item: (item[1] is None, -(item[1] or 0.0)))
