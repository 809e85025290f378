"""`trajforge score`: a reward model or an LLM judge scores every record of the fixtures build;
--min-score moves the low ones to the quarantine and the counts still add up."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.openai_server import Reply, Server
from trajforge.pipeline.quality.critical_steps import step_turns
from trajforge.pipeline.quality.score import parse_rating


def read(folder: Path, config: str = "sft") -> list[dict]:
    return [r for p in sorted((folder / "data" / config).glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def quarantine(folder: Path) -> list[dict]:
    return pq.read_table(folder / "quarantine" / "quarantine.parquet").to_pylist()


def assert_accounted(build: Path, out: Path, min_score: float) -> dict:
    report = json.loads((out / "report.json").read_text())
    records, written, dropped = read(build), read(out), [q for q in quarantine(out) if q["reason"] == "low_score"]
    assert report["records"] == len(records) == report["written"] + report["low_score"]  # unscored ones are written
    assert len(written) == report["written"] and len(dropped) == report["low_score"]
    assert quarantine(out)[:len(quarantine(build))] == quarantine(build)  # the build's rows, then the new ones
    assert {r["source_id"] for r in written}.isdisjoint({q["source_id"] for q in dropped})
    assert all(r["score"] is None or r["score"] >= min_score for r in written)
    assert all(f"< min_score {min_score:g}" in q["detail"] for q in dropped)
    total = report["total"]
    assert total["read"] == total["written"] + total["quarantined"] + total["duplicates"]
    assert total["written"] == len(written) and total["reasons"].get("low_score", 0) == len(dropped)
    assert pq.read_table(out / "duplicates.parquet").num_rows == total["duplicates"]
    scored = Counter(r["source"] for r in written if r["score"] is not None) + Counter(q["source"] for q in dropped)
    assert {s: d["n"] for s, d in report["by_source"].items()} == dict(scored)
    assert sum(d["n"] for d in report["by_env"].values()) == sum(scored.values())
    assert set(report["by_env"]) <= {r["env"] for r in records}
    return report


@pytest.fixture
def reward_head(tmp_path_factory, fixtures_build) -> Path:
    """A reward head on the tiny model: untrained, but a real model giving real, varied scores."""
    pytest.importorskip("torch")
    pytest.importorskip("trl")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.support.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny"), fixtures_build)
    out = tmp_path_factory.mktemp("reward_head")
    AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def test_score_with_a_reward_model_and_min_score(fixtures_build, reward_head, tmp_path, capsys):
    from trajforge.flows.cli import main
    from trajforge.training.reward_model import RewardModel

    scores = RewardModel.load(str(reward_head), max_length=256).score(
        [[{"role": t["role"], "content": t["content"]} for t in r["conversations"]] for r in read(fixtures_build)])
    ordered, k = sorted(scores), len(scores) // 3
    min_score = (ordered[k - 1] + ordered[k]) / 2  # between two scores: padding may move a score by 1e-7
    out = tmp_path / "scored"
    assert main(["score", str(fixtures_build), "--out", str(out), "--scorer", "rm", "--model", str(reward_head),
                 "--max-length", "256", "--min-score", repr(min_score)]) == 0
    report = assert_accounted(fixtures_build, out, min_score)
    assert report["low_score"] == k and report["unscored"] == 0
    assert sorted(r["score"] for r in read(out)) == pytest.approx(ordered[k:], abs=1e-4)
    assert "low_score" in capsys.readouterr().out


_STEP = re.compile(r"^### Step (\d+)$", re.M)


def rubric_policy(messages: list[dict]) -> Reply:
    """A stand-in judge: 5 for a trajectory of at most three steps, one point less per further step
    (never below 1); a trajectory of exactly four steps gets a reply that is not JSON, every time."""
    steps = len(_STEP.findall(next(m["content"] for m in messages if m["role"] == "user")))
    if steps == 4:
        return Reply("Let me count the steps.", "It looks fine to me.")
    rating = max(1, 5 - max(0, steps - 3))
    return Reply(f"The trajectory has {steps} steps.", json.dumps({"rating": rating, "reason": f"{steps} steps"}))


def expected_rating(record: dict) -> float | None:
    steps = len(step_turns(record["conversations"]))
    return None if steps == 4 else float(max(1, 5 - max(0, steps - 3)))


def test_judge_scores_through_the_llm_client_and_a_rerun_makes_no_call(fixtures_build, tmp_path):
    from trajforge.flows.cli import main

    records = read(fixtures_build)
    out = tmp_path / "judged"
    args = ["score", str(fixtures_build), "--out", str(out), "--scorer", "judge", "--model", "DeepSeek-R1",
            "--min-score", "3", "--max-calls", "1000"]
    with Server(rubric_policy, shapes=("reasoning_content", "think")) as server:
        assert main([*args, "--base-url", server.base_url]) == 0
        calls = server.calls
        assert main([*args, "--base-url", server.base_url]) == 0
        assert server.calls == calls  # every rating is journaled (and cached): a rerun asks nothing
    report = assert_accounted(fixtures_build, out, 3.0)
    unratable = sum(expected_rating(r) is None for r in records)
    assert calls == len(records) + unratable  # one retry for each answer that is not JSON
    assert report["unscored"] == unratable and report["unscored_reasons"] == ({"no_json": unratable} if unratable else {})
    expected = {r["id"]: expected_rating(r) for r in records}
    assert {r["id"]: r["score"] for r in read(out)} == {i: s for i, s in expected.items() if s is None or s >= 3}
    assert report["low_score"] == sum(s is not None and s < 3 for s in expected.values())
    assert report["llm"]["ratings_resumed"] == len(records)  # format failures are journaled too


def test_the_judge_stops_at_its_call_budget(fixtures_build, tmp_path):
    from trajforge.flows.cli import main

    out = tmp_path / "budget"
    with Server(rubric_policy, shapes=("reasoning_content",)) as server:
        assert main(["score", str(fixtures_build), "--out", str(out), "--scorer", "judge", "--model", "DeepSeek-R1",
                     "--base-url", server.base_url, "--max-calls", "5", "--batch-size", "4"]) == 0
        assert server.calls == 5
    report = json.loads((out / "report.json").read_text())
    assert report["unscored_reasons"].get("llm_error:budget_exhausted", 0) >= report["records"] - 5
    assert report["written"] == report["records"]  # without --min-score nothing is dropped


def test_parse_rating():
    assert parse_rating('{"rating": 4, "reason": "ok"}') == 4.0
    assert parse_rating('Sure: {"rating": "3"}') == 3.0
    for text, reason in (("no json here", "no_json"), ('{"rating": 7}', "bad_rating"), ('{"rating": true}', "bad_rating")):
        with pytest.raises(ValueError, match=reason):
            parse_rating(text)
