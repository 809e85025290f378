"""Critical-step selection (ATLaS) against the loopback server, and the `loss_on: critical` label mask."""
from __future__ import annotations

import copy
import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.openai_server import _ERROR_WORDS, CriticalStepPolicy, Server
from tests.support.tables import declared_rows
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig
from trajforge.pipeline.quality.critical_steps import SelectConfig, SelectionError, parse_selection, select_steps

SELECTOR_SHAPES = ("reasoning_content", "think")  # a JSON answer has no action to recover from the reasoning


def garbled(prompt: str) -> bool:
    """About one prompt in eight gets an answer that is not JSON, every time it is asked."""
    return hashlib.sha1(prompt.encode()).digest()[0] % 8 == 0


def _config(server: Server, inputs: Path, out: Path, **kw) -> SelectConfig:
    return SelectConfig(inputs=str(inputs), out=str(out), batch_size=32,
                        llm=LLMConfig(model="DeepSeek-R1", base_url=server.base_url, api_key="EMPTY",
                                      backoff_base_s=0.01, max_retries=1), **kw)


def _records(folder: Path) -> list[dict]:
    return [r for p in sorted((folder / "data" / "sft").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.fixture(scope="module")
def selected(fixtures_build: Path, tmp_path_factory):
    out = tmp_path_factory.mktemp("selected")
    with Server(CriticalStepPolicy(garble=garbled), shapes=SELECTOR_SHAPES) as server:
        report = select_steps(_config(server, fixtures_build, out))
        calls = server.calls
        again = select_steps(_config(server, fixtures_build, out))
        assert server.calls == calls
    return out, report, again, calls


def expected_flags(record: dict) -> dict[int, str]:
    """The stand-in selector's rule, stated over the conversation: turn index -> category."""
    conversations = record["conversations"]
    steps = [i for i, t in enumerate(conversations) if t["role"] == "assistant" and t["loss"]]
    flags = {}
    for i in steps:
        before = conversations[i - 1]
        if i != steps[0] and before["role"] == "user" and _ERROR_WORDS.search(before["content"][:2000]):
            flags[i] = "self_correction"
    flags.setdefault(steps[0], "plan_creation")
    flags[steps[-1]] = "critical_action"
    return flags


def test_flags_land_on_the_turns_the_selector_named(selected, fixtures_build):
    out, report, _, _ = selected
    inputs, records = _records(fixtures_build), _records(out)
    assert [r["id"] for r in records] == [r["id"] for r in inputs]  # nothing lost, order kept
    failed = {row["id"]: row for row in declared_rows(out / "select_failures.parquet", "select_failures")}
    judged = 0
    for before, record in zip(inputs, records):
        assert validate_record(record) is None, record["id"]
        # Annotation adds fields; it changes nothing the record already said.
        assert [{k: t[k] for k in ("role", "content", "loss")} for t in record["conversations"]] == \
            [{k: t[k] for k in ("role", "content", "loss")} for t in before["conversations"]]
        if record["id"] in failed:
            assert all(t["critical"] is None for t in record["conversations"])
            continue
        judged += 1
        assert record["schema_version"] == "1.1.0"
        expected = expected_flags(record)
        for i, turn in enumerate(record["conversations"]):
            if turn["role"] != "assistant" or not turn["loss"]:
                assert turn["critical"] is None and turn["critical_category"] is None, (record["id"], i)
            elif i in expected:
                assert turn["critical"] is True and turn["critical_category"] == expected[i], (record["id"], i)
                assert turn["critical_reason"]
            else:
                assert turn["critical"] is False and turn["critical_category"] is None, (record["id"], i)
    assert judged == report["judged"] > 100
    # The fixtures hold every case the mapping must get right.
    categories = Counter(t["critical_category"] for r in records for t in r["conversations"] if t["critical"])
    assert set(categories) == {"plan_creation", "self_correction", "critical_action"}
    assert any(t["role"] == "assistant" and not t["loss"] for r in records for t in r["conversations"])


def test_every_failure_ends_once_with_a_reason_and_counts_add_up(selected, fixtures_build):
    out, report, _, calls = selected
    failures = declared_rows(out / "select_failures.parquet", "select_failures")
    ids = [f["id"] for f in failures]
    assert len(ids) == len(set(ids)) == report["failed"] > 0
    assert {f["reason"] for f in failures} == {"no_json"}
    assert report["records"] == len(_records(fixtures_build)) == report["judged"] + report["failed"]
    # One call per judged record; a garbled answer is asked once more (max_format_retries=1), then given up.
    assert calls == report["llm"]["calls"] == report["judged"] + 2 * report["failed"]


def test_report_shows_the_critical_share_per_env(selected):
    out, report, again, _ = selected
    recount: dict[str, Counter] = {}
    for record in _records(out):
        counts = recount.setdefault(record["env"], Counter())
        for turn in record["conversations"]:
            if turn["critical"] is not None:
                counts["steps"] += 1
                counts["critical"] += turn["critical"]
    assert json.loads((out / "report.json").read_text()) == again  # the last run's
    for env, counts in recount.items():
        entry = report["envs"][env]
        assert (entry["steps"], entry["critical"]) == (counts["steps"], counts["critical"])
        if counts["steps"]:
            assert entry["critical_share"] == round(counts["critical"] / counts["steps"], 4)
    assert {"os", "db", "alfworld", "webshop"} <= set(report["envs"])
    assert 0 < sum(e["critical"] for e in report["envs"].values()) < sum(e["steps"] for e in report["envs"].values())


def test_rerun_makes_zero_calls_and_writes_the_same_records(selected):
    out, report, again, _ = selected
    assert again["llm"]["calls"] == 0 and again["selections_run"] == 0
    assert again["selections_resumed"] == report["records"]
    assert {k: v for k, v in again.items() if k not in ("llm", "selections_run", "selections_resumed")} == \
        {k: v for k, v in report.items() if k not in ("llm", "selections_run", "selections_resumed")}


def test_llm_errors_are_not_journaled_and_the_next_run_retries_them(fixtures_build, tmp_path):
    source = sorted((fixtures_build / "data" / "sft").glob("*.parquet"))[0]
    out = tmp_path / "out"
    with Server(CriticalStepPolicy(), shapes=SELECTOR_SHAPES, fault=lambda n, body: "500" if n % 5 == 0 else None) as server:
        first = select_steps(_config(server, source, out))
        assert first["failure_reasons"] == {"llm_error:server_error": first["failed"]} and first["failed"] > 0
        failed = {f["id"] for f in declared_rows(out / "select_failures.parquet", "select_failures")}
        server.fault = None
        before = server.calls
        second = select_steps(_config(server, source, out))
        # Only the records that failed are asked again; the others come from the journal.
        assert server.calls - before == second["selections_run"] == len(failed)
        assert second["failed"] == 0 and second["judged"] == second["records"]


def test_parse_selection_refuses_what_it_cannot_use():
    assert parse_selection('```json\n{"critical_steps": [{"step": 2, "category": "Critical Action"}]}\n```', 3) == \
        {2: ("critical_action", "")}
    for text, reason in (("steps 1 and 2", "no_json"), ('{"critical_steps": [{"step": 4, "category": "plan_creation"}]}', "bad_step"),
                         ('{"critical_steps": [{"step": 1, "category": "cleanup"}]}', "bad_category"),
                         ('{"steps": []}', "bad_json")):
        with pytest.raises(SelectionError) as info:
            parse_selection(text, 3)
        assert info.value.reason == reason


def test_select_steps_cli_runs_the_flow(fixtures_build, tmp_path, capsys):
    from trajforge.flows.cli import main

    source = sorted((fixtures_build / "data" / "sft").glob("*.parquet"))[0]
    out = tmp_path / "cli"
    with Server(CriticalStepPolicy(), shapes=SELECTOR_SHAPES) as server:
        assert main(["select-steps", str(source), "--out", str(out), "--model", "DeepSeek-R1",
                     "--base-url", server.base_url, "--env", "os", "--env", "db"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert set(report["envs"]) == {"os", "db"} and report["skipped_env"] > 0
    assert f"os: {report['envs']['os']['judged']}/" in printed and server.calls == report["judged"]


# --- the label mask follows the flags -----------------------------------------------------------
@pytest.mark.parametrize("template", ["chatml", "plain_headers"])
def test_label_mask_with_loss_on_critical_is_exactly_the_critical_turns(selected, fixtures_build, template):
    pytest.importorskip("trl")
    from datasets import Dataset

    from tests.support.tiny_model import CHATML, END_OF_TURN, HEADERS, build_tokenizer, fixture_texts, labelled_runs
    from trajforge.training.data import prepare_sft, tokenize_trajectory

    out, report, _, _ = selected
    tok = build_tokenizer(fixture_texts(fixtures_build))
    tok.chat_template = {"chatml": CHATML, "plain_headers": HEADERS}[template]
    records = _records(out)
    checked = skipped_turns = 0
    for record in records:
        critical = [t["content"] for t in record["conversations"] if t["critical"]]
        result = tokenize_trajectory(tok, record["conversations"], None, loss_on="critical")
        if not critical:
            assert result is None, record["id"]
            continue
        assert labelled_runs(tok, result["labels"]) == [c + END_OF_TURN[tok.chat_template] for c in critical], record["id"]
        everything = tokenize_trajectory(tok, record["conversations"], None, loss_on="all")
        assert everything["input_ids"] == result["input_ids"]
        checked += 1
        skipped_turns += sum(t["critical"] is False for t in record["conversations"])
    assert checked == report["judged"] and skipped_turns > 50
    _, stats = prepare_sft(Dataset.from_list(copy.deepcopy(records)), tok, None, loss_on="critical")
    # Records the selector could not judge carry no loss under `critical`: dropped and counted as such.
    assert (stats.kept, stats.dropped_not_judged, stats.dropped_no_loss) == (report["judged"], report["failed"], 0)
    failed = [r for r in records if not any(t["critical"] is not None for t in r["conversations"])]
    with pytest.raises(ValueError, match=f"of {len(failed)} rows, {len(failed)} dropped: never judged by "
                                         "`trajforge select-steps`"):
        prepare_sft(Dataset.from_list(copy.deepcopy(failed)), tok, None, loss_on="critical")
    with pytest.raises(ValueError, match="loss_on"):
        prepare_sft(Dataset.from_list(records[:2]), tok, None, loss_on="critical_only")


def test_loss_on_is_a_launcher_option():
    pytest.importorskip("trl")
    from trajforge.training.arguments import SFTTrainConfig, parse

    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--use_cpu", "true"]
    assert parse(SFTTrainConfig, base)[1].loss_on == "all"
    assert parse(SFTTrainConfig, [*base, "--loss_on", "critical"])[1].loss_on == "critical"
    with pytest.raises(SystemExit):
        parse(SFTTrainConfig, [*base, "--loss_on", "critical_only"])


def test_sft_launcher_trains_critical_steps_as_tool_calls(selected, fixtures_build, tmp_path):
    """`loss_on: critical` with `action_format: tools` through `trajforge train sft`: the tool-call
    rendering keeps the critical flags, and the records the selector could not judge are counted
    in the metrics the run prints and writes."""
    pytest.importorskip("trl")
    torch = pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests.support.tiny_model import build_tiny_model, tool_chat_template
    from trajforge.flows.cli import main
    from trajforge.training.data import IGNORE, prepare_sft, tools_rendering

    out, report, _, _ = selected
    records = _records(out)
    tiny = build_tiny_model(tmp_path / "tiny", fixtures_build, chat_template=tool_chat_template())
    torch.set_num_threads(1)
    run = tmp_path / "sft"
    assert main(["train", "sft", "--config", str(Path(__file__).resolve().parents[2] / "training" / "configs" /
                                                  "sft_tiny.yaml"),
                 "--model_name_or_path", str(tiny), "--dataset_name", str(out), "--output_dir", str(run),
                 "--loss_on", "critical", "--action_format", "tools", "--max_length", "8192", "--eval_fraction", "0",
                 "--max_steps", "2", "--save_strategy", "no"]) == 0
    results = json.loads((run / "all_results.json").read_text())
    rendered = [r for r in records if tools_rendering(r) is not None]
    judged = [r for r in rendered if any(t["critical"] for t in r["conversations"])]
    assert len(judged) > 10
    assert results["sft_train_kept"] == len(judged)
    assert results["sft_train_dropped_not_judged"] == len(rendered) - len(judged) > 0
    assert results["sft_train_dropped_no_tool_call"] == len(records) - len(rendered)
    assert results["sft_train_dropped_too_long"] == results["sft_train_dropped_no_loss"] == 0
    assert json.loads((run / "data_results.json").read_text()) == {k: v for k, v in results.items()
                                                                   if k.startswith("sft_")}
    # The trained tokens are the critical calls, and only they.
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    data, _ = prepare_sft(Dataset.from_list(copy.deepcopy(judged[:5])), tokenizer, None, loss_on="critical",
                          action_format="tools")
    for record, labels in zip(judged[:5], data["labels"]):
        trained = tokenizer.decode([t for t in labels if t != IGNORE])
        assert trained.count("<tool_call>") == sum(bool(t["critical"]) for t in record["conversations"])
