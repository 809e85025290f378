"""The RFT loop end to end on CPU: the real build flow, real SFT steps on the tiny model, a real server
subprocess, real synthesis in SQLite, and the accounting of every round."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.support.paths import FIXTURES, RAW  # noqa: E402
from tests.support.tiny_model import CONFIGS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
SFT_TINY = CONFIGS / "sft_tiny.yaml"
SFT_ARGS = ["--config", str(SFT_TINY), "--max_steps", "2", "--max_length", "512", "--eval_fraction", "0",
            "--save_strategy", "no"]
SOURCES = {"agentinstruct": str(RAW / "agentinstruct")}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    """Eight DBBench tasks: queries the reference solves, queries it does not, and table changes."""
    path = tmp_path_factory.mktemp("tasks") / "held_out.jsonl"
    path.write_text("\n".join(DB_FILE.read_text().splitlines()[:8]) + "\n")
    return path


def _assert_trained(model_dir: Path) -> None:
    results = json.loads((model_dir / "all_results.json").read_text())
    assert math.isfinite(results["train_loss"]) and (model_dir / "model.safetensors").exists()


def test_rft_rounds_keep_successes_and_build_again(tiny, held_out, tmp_path):
    """The served "model" is the loopback server replaying reference solutions, so rounds do succeed
    and the keep -> build-again path carries real records."""
    from trajforge.flows.rft import rft

    out = tmp_path / "rft"
    # The server knows every DBBench dev task, so it also solves some of the held-out split.
    serve = [sys.executable, "-m", "tests.support.openai_server", "--port", "{port}", "--db-tasks", str(DB_FILE)]
    report = rft(sources=SOURCES, tasks=str(held_out), env="db", base_model=str(tiny), out=str(out), rounds=2,
                 sft_args=SFT_ARGS, serve=serve, n=1, max_turns=4, startup_timeout_s=60)
    assert json.loads((out / "report.json").read_text()) == report
    first, second = report["rounds"]
    for summary in (first, second):
        _assert_trained(out / f"round-{summary['round']}" / "model")
        assert summary["tasks"] == summary["episodes"] == 8
        assert summary["tasks_solved"] + summary["failures"] == summary["episodes"]
        assert summary["success_rate"] == round(summary["tasks_solved"] / 8, 4)
        assert summary["records_kept"] == summary["tasks_solved"] > 0 and summary["llm_calls"] > 0
    # Every round is evaluated on the declared DBBench split without the 8 tasks it trains on.
    assert [c["round"] for c in report["curve"]] == [1, 2]
    for summary, point in zip(report["rounds"], report["curve"]):
        evaluated = json.loads((out / f"round-{summary['round']}" / "eval" / "eval.json").read_text())
        assert evaluated["envs"]["db"]["tasks"] == summary["heldout_episodes"] == 39 - 8
        assert point["heldout_success"] == evaluated["envs"]["db"]["model"]["success_rate"] > 0
        assert point["train_success"] == summary["success_rate"] and point["data_added"] == summary["records_kept"]
    # Round 1 builds from the sources alone; round 2 also from round 1's successes.
    assert first["build_synthetic_records"] == 0
    assert second["build_synthetic_records"] == first["records_kept"]
    assert second["build_records"] == first["build_records"] + first["records_kept"]
    kept = pq.read_table(out / "kept" / "data" / "synthetic" / "db.parquet").to_pylist()
    assert len(kept) == len({r["id"] for r in kept}) == report["records_kept"] == first["records_kept"] * 2
    assert {r["id"].split("/", 1)[1][:3] for r in kept} == {"r1-", "r2-"}
    # The same solutions found again in round 2 are near duplicates: the final build keeps one of each.
    assert report["final_build"]["synthetic_records"] == first["records_kept"]


def test_rft_serves_the_trained_tiny_model_with_transformers_serve(tiny, held_out, tmp_path):
    """The CPU end-to-end run: the checkpoint itself answers; it solves nothing, and every episode is accounted for."""
    from trajforge.flows.rft import rft

    out = tmp_path / "rft_tiny"
    tasks = tmp_path / "three.jsonl"
    tasks.write_text("\n".join(held_out.read_text().splitlines()[:3]) + "\n")
    held_out_three = tmp_path / "held_out_three.jsonl"
    held_out_three.write_text("\n".join(held_out.read_text().splitlines()[3:6]) + "\n")
    report = rft(sources=SOURCES, tasks=str(tasks), env="db", base_model=str(tiny), out=str(out), rounds=1,
                 sft_args=SFT_ARGS, serve="transformers", n=1, max_turns=1, max_tokens=16, startup_timeout_s=300,
                 eval_tasks=str(held_out_three))
    (summary,) = report["rounds"]
    _assert_trained(out / "round-1" / "model")
    assert report["serve"][:2] == ["transformers", "serve"]
    assert summary["tasks"] == summary["episodes"] == summary["failures"] == 3
    assert summary["success_rate"] == 0.0 and summary["records_kept"] == 0
    assert sum(summary["failure_reasons"].values()) == 3
    # The held-out floor: the tiny model solves none of the three held-out tasks either.
    assert summary["heldout_episodes"] == 3 and summary["heldout_success"] == 0.0
    assert report["curve"] == [{"round": 1, "train_success": 0.0, "heldout_success": 0.0, "data_added": 0}]
    # The server really answered: the request cache holds its responses.
    assert summary["llm_calls"] >= 3
    assert "Uvicorn running" in (out / "round-1" / "model" / "serve.log").read_text()
