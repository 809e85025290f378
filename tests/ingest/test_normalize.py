"""Every real fixture record becomes a valid record or a quarantine entry with a specific reason."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.expected import FIXTURE_QUARANTINE
from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, RAW
from trajforge.pipeline.build import BuildConfig, process_unit
from trajforge.pipeline.ingest.dialects import parse_turn
from trajforge.pipeline.ingest.normalize import (
    RENDERINGS,
    NormalizeConfig,
    NormalizedRecord,
    NormalizeError,
    normalize_row,
)
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.schemas import arrow_schema, first_error, validator
from trajforge.sources import get_source, iter_rows


def _records(fixtures_build):
    return pq.read_table(fixtures_build / "data" / "sft").to_pylist()


def test_every_real_record_is_accounted_for(fixtures_build):
    report = json.loads((fixtures_build / "report.json").read_text())
    total = report["total"]
    assert total["read"] == total["written"] + total["quarantined"] + total["duplicates"]
    for name, entry in report["sources"].items():
        assert entry["read"] == entry["written"] + entry["quarantined"] + entry["duplicates"], name
    records = _records(fixtures_build)
    quarantine = pq.read_table(fixtures_build / "quarantine" / "quarantine.parquet").to_pylist()
    assert len(records) == total["written"] and len(quarantine) == total["quarantined"]
    # The rows actually present in the fixture files, counted independently of the build.
    raw_count = sum(1 for name in ("agentinstruct", "agenttraj_l", "openmanus_rl")
                    for f in get_source(name).files(str(RAW / name)) for _ in iter_rows(f.path))
    assert total["read"] == raw_count
    assert Counter((q["source_id"], q["reason"]) for q in quarantine) == FIXTURE_QUARANTINE
    assert all(q["reason"] and q["raw"] for q in quarantine)


def test_output_validates_record_by_record_and_ids_are_unique(fixtures_build):
    records = _records(fixtures_build)
    for record in records:
        assert not list(validator("trajectory").iter_errors(record)), record["id"]
        assert validate_record(record) is None, record["id"]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    # The maze id repeats upstream with different trajectories: both kept, the second suffixed.
    assert {"agenttraj_l/lmrlgym_maze_18", "agenttraj_l/lmrlgym_maze_18~2"} <= set(ids)


def test_parquet_schema_is_the_one_derived_from_json_schema(fixtures_build):
    written = pq.read_schema(next((fixtures_build / "data" / "sft").glob("*.parquet")))
    assert written.remove_metadata().equals(arrow_schema("trajectory").remove_metadata())


def test_stored_thought_and_action_are_what_the_content_parses_to(fixtures_build):
    for record in _records(fixtures_build):
        for turn in record["conversations"]:
            if turn["role"] == "assistant":
                parsed = parse_turn(turn["content"])
                assert (parsed.thought, parsed.action, parsed.dialect) == (turn["thought"], turn["action"], turn["dialect"])


def test_domains_envs_and_loss_flags(fixtures_build):
    records = {r["id"]: r for r in _records(fixtures_build)}
    assert Counter(r["domain"] for r in records.values()).keys() >= {"os", "db", "web", "kg", "household",
                                                                    "ecommerce", "tool", "game", "science"}
    db = records["agentinstruct/db_8"]
    assert db["loss_flags"] == "upstream"
    assert [t["loss"] for t in db["conversations"]][:2] == [False, False]  # instruction, "Ok."
    assert all(t["loss"] for t in db["conversations"][3::2])
    assert records["agenttraj_l/movie_124"]["env"] == "movie"
    assert records["agenttraj_l/sciworld_2200"]["domain"] == "science"
    alf = records["openmanus_rl/look_at_obj_in_light-AlarmClock-None-DeskLamp-301_trial_T20190907_174127_043461"]
    assert (alf["domain"], alf["env"], alf["loss_flags"]) == ("household", "alfworld", "inferred")


def test_one_shot_demos_are_context_without_loss(fixtures_build):
    records = {r["id"]: r for r in _records(fixtures_build)}
    os_row, kg_row = records["agentinstruct/os_42"], records["agentinstruct/kg_132"]
    assert os_row["demo_turns"] == 5 and kg_row["demo_turns"] == 16
    assert os_row["task"].startswith("How many files and directories in your home directory")
    for row in (os_row, kg_row):
        turns = row["conversations"]
        task_at = next(i for i, t in enumerate(turns) if t["role"] == "user" and row["task"] in t["content"])
        demo = turns[task_at - row["demo_turns"]:task_at]
        assert any(t["role"] == "assistant" for t in demo)
        assert not any(t["loss"] for t in demo)
        assert all(t["loss"] for t in turns[task_at:] if t["role"] == "assistant")


def test_react_rendering_follows_its_own_prompt():
    source = get_source("agentinstruct")
    path = RAW / "agentinstruct" / "adp_role_content" / "alfworld.json"
    row = next(iter_rows(path)).row
    record = normalize_row(row, source, "alfworld", path.name, 0, NormalizeConfig(rendering="react"))
    assert record["rendering"] == "react"
    assert validate_record(record) is None
    prompt = record["conversations"][0]["content"]
    assert "Think:" in prompt and "THOUGHT:" not in prompt
    for turn in record["conversations"]:
        if turn["role"] == "assistant" and turn["action"]:
            assert parse_turn(turn["content"]).dialect == "think_act"
    # A react record whose response turns were left in the upstream dialect is caught.
    broken = json.loads(json.dumps(record))
    last = broken["conversations"][-1]
    last["content"], last["dialect"] = f"THOUGHT: {last['thought']}\nACTION: {last['action']}", "upper_thought_action"
    assert validate_record(broken).reason == "mixed_rendering"


def test_json_tool_records_stay_native_in_react_mode(tmp_path):
    f = next(f for f in get_source("agent_flan").files(str(AGENT_FLAN)) if f.split == "toolbench_instruct_j1s1_3k")
    unit = process_unit("agent_flan", f, tmp_path, BuildConfig(rendering="react"))
    [record] = pa.ipc.open_file(unit.records_path).read_all().to_pylist()
    assert record["rendering"] == "native"


def test_agent_flan_rows_in_documented_layout(tmp_path):
    records = []
    for f in get_source("agent_flan").files(str(AGENT_FLAN)):
        unit = process_unit("agent_flan", f, tmp_path, BuildConfig())
        assert unit.quarantined == 0, unit.reasons
        records += pa.ipc.open_file(unit.records_path).read_all().to_pylist()
    by_id = {r["id"]: r for r in records}
    negative = by_id["agent_flan/toolbench_negative/5"]
    assert (negative["kind"], negative["negative_type"]) == ("negative", "tool_irrelevance")
    assert by_id["agent_flan/agent_instruct_react/1204"]["env"] == "webshop"  # from the prompt
    assert by_id["agent_flan/toolbench_react_10p/17"]["answer"] == "100 USD is 92.1 EUR."
    assert by_id["agent_flan/agent_instruct_react/1204"]["conversations"][0]["role"] == "system"


@pytest.mark.parametrize("mode", ["native", "react"])
def test_three_containers_give_the_same_records(mode, tmp_path):
    source = get_source("agentinstruct")
    out = {}
    for name in ("db.jsonl", "db-sample.parquet"):
        path = RAW / "agentinstruct" / name
        out[name] = [normalize_row(r.row, source, "db", "x", 0, NormalizeConfig(rendering=mode)) for r in iter_rows(path)]
    assert out["db.jsonl"] == out["db-sample.parquet"]
    # The JSON-array mirror (role/content, no loss) gives the same conversation text and actions.
    adp = {r.row["id"]: r.row for r in iter_rows(RAW / "agentinstruct" / "adp_role_content" / "db.json")}
    common = [rec for rec in out["db.jsonl"] if rec["source_id"] in adp]
    assert common
    for rec in common:
        other = normalize_row(adp[rec["source_id"]], source, "db", "x", 0, NormalizeConfig(rendering=mode))
        strip = lambda r: [(t["role"], t["content"], t["action"]) for t in r["conversations"]]  # noqa: E731
        assert strip(other) == strip(rec)
        assert other["loss_flags"] == "inferred" and rec["loss_flags"] == "upstream"


def test_react_build_of_every_fixture_validates(tmp_path):
    """The whole fixture set in react rendering: same accounting, every record valid, few left native."""
    config = BuildConfig(rendering="react")
    sources = dict(FIXTURE_SOURCES, agent_flan=str(AGENT_FLAN))
    units = [process_unit(name, f, tmp_path, config) for name, location in sources.items()
             for f in get_source(name).files(location)]
    records = [r for u in units for r in pa.ipc.open_file(u.records_path).read_all().to_pylist()]
    quarantine = [q for u in units for q in pq.read_table(u.quarantine_path).to_pylist()]
    assert Counter((q["source_id"], q["reason"]) for q in quarantine) == FIXTURE_QUARANTINE
    for record in records:
        assert validate_record(record) is None, record["id"]
    renderings = Counter(r["rendering"] for r in records)
    # Only the JSON / dict tool-call rows, whose prompts ask for JSON, stay native, and textcraft_205,
    # whose prose turn (TextCraft refused it; validation masks it) has no Think/Act form.
    native = {r["env"] if r["env"] == "toolbench" else r["id"] for r in records if r["rendering"] == "native"}
    assert native == {"toolbench", "agenttraj_l/textcraft_205"}
    assert renderings["react"] > 0.9 * len(records)


def test_negative_files_are_the_sources_own():
    """Agent-FLAN's negatives file, and OpenManus-RL's re-release of it, label their rows."""
    flan, openmanus = get_source("agent_flan"), get_source("openmanus_rl")
    assert flan.negative_type("toolbench_negative", "5") == "tool_irrelevance"
    assert flan.negative_type("toolbench_react_10p", "5") is None
    assert openmanus.negative_type("train", "AgentFlan_toolbench_negative_5") == "tool_irrelevance"
    assert openmanus.negative_type("train", "AgentFlan_toolbench_react_10p_5") is None
    assert get_source("agentinstruct").negative_type("os", "os_1") is None


def test_a_source_whose_ids_live_under_another_key_overrides_row_id():
    """The normalizer checks the type of what the source's `row_id` returns, not of `id` / `item_id`."""
    source = get_source("agentinstruct")

    class UidSource(type(source)):
        def row_id(self, row: dict) -> object:
            return row.get("uid")

    row = next(iter_rows(RAW / "agentinstruct" / "db.jsonl")).row
    moved = {("uid" if key == "id" else key): value for key, value in row.items()}
    record, expected = normalize_row(moved, UidSource(), "db", "x", 0), normalize_row(row, source, "db", "x", 0)
    # The same record; only the meta says that the row carried a key the normalizer does not read.
    assert json.loads(record.pop("meta"))["extra_keys"] == ["uid"] and "extra_keys" not in json.loads(expected.pop("meta"))
    assert record == expected
    with pytest.raises(NormalizeError) as refused:
        normalize_row({**moved, "uid": ["not", "an", "id"]}, UidSource(), "db", "x", 0)
    assert refused.value.reason == "wrong_type"
    with pytest.raises(NormalizeError) as missing:
        normalize_row({**moved, "uid": " "}, UidSource(), "db", "x", 0)
    assert missing.value.reason == "missing_id"


def test_a_row_with_several_faults_is_refused_for_its_first_in_a_fixed_order():
    """The turns' structure decides first, then the env, then cleaning (too long, or empty after it),
    each at the first turn it refuses: the reason a row gets does not depend on how its turns are read."""
    source = get_source("agentinstruct")
    row = next(iter_rows(RAW / "agentinstruct" / "db.jsonl")).row
    turns = row["conversations"]
    limit = max(len(t["value"]) for t in turns)
    config = NormalizeConfig(max_turn_chars=limit)

    def reason(changes: dict, split: str = "db") -> tuple[str, str]:
        broken = [{**t, **changes.get(i, {})} for i, t in enumerate(turns)]
        with pytest.raises(NormalizeError) as refused:
            normalize_row({**row, "conversations": broken, "id": f"{split}_1"}, source, split, "x", 0, config)
        return refused.value.reason, refused.value.detail

    too_long, empty = {"value": "x" * (limit + 1)}, {"value": " \x1b[0m\n"}
    assert reason({1: too_long, 3: {"from": "narrator"}})[0] == "unknown_role"
    assert reason({0: {"value": "Solve it."}, 1: empty}, split="elsewhere")[0] == "unknown_env"
    assert reason({1: empty, 2: too_long}) == ("empty_turn", "turn 1 (assistant) is empty after cleaning")
    assert reason({1: too_long, 2: empty}) == ("too_long", f"turn 1 has {limit + 1} chars (max {limit})")
    assert reason({0: empty})[1] == "turn 0 (user) is empty after cleaning"


def test_turns_of_mixed_shapes_read_as_each_shape_alone_and_loose_types_are_refused():
    """A row's turns may mix the upstream key names (or carry both): it gives the record the row with one
    shape gives. A loss flag that is no bool, a role that is no role name and a content that is no
    string are refused at their turn, whichever turn it is."""
    source = get_source("agentinstruct")
    row = next(iter_rows(RAW / "agentinstruct" / "db.jsonl")).row
    turns = row["conversations"]
    as_role = [{"role": t["from"], "content": t["value"], "loss": t["loss"]} for t in turns]
    mixed = [as_role[0], *turns[1:-1], {**turns[-1], "role": turns[-1]["from"]}]
    expected = normalize_row(row, source, "db", "x", 0)
    for variant in (as_role, mixed):
        assert normalize_row({**row, "conversations": variant}, source, "db", "x", 0) == expected

    def reason(i: int, change: dict) -> tuple[str, str]:
        broken = [{**t, **change} if j == i else t for j, t in enumerate(turns)]
        with pytest.raises(NormalizeError) as refused:
            normalize_row({**row, "conversations": broken}, source, "db", "x", 0)
        return refused.value.reason, refused.value.detail

    assert reason(2, {"loss": 1}) == ("wrong_type", "turn 2 loss is int")
    assert reason(0, {"loss": "yes"}) == ("wrong_type", "turn 0 loss is str")
    assert reason(3, {"from": ["gpt"]}) == ("unknown_role", "turn 3 role ['gpt']")
    assert reason(1, {"value": None}) == ("wrong_type", "turn 1 content is NoneType")
    assert reason(4, {"note": "x"})[0] == "unexpected_keys"


def test_meta_is_the_json_text_of_its_keys_sorted():
    """`meta` is what `json.dumps(..., sort_keys=True, ensure_ascii=False)` makes of the row's provenance,
    whatever its split's name holds and whether the row has keys beyond the known ones."""
    source = get_source("agentinstruct")
    row = next(iter_rows(RAW / "agentinstruct" / "db.jsonl")).row
    for split, index, extra in [("db", 0, {}), ('d"b\\\u00e9\n\u2028', 10**12, {}), ("db", 7, {"z": 1, "a b": 2})]:
        record = normalize_row({**row, **extra}, source, split, "x", index)
        meta = {"source_index": index, "split": split, **({"extra_keys": sorted(extra)} if extra else {})}
        assert record["meta"] == json.dumps(meta, sort_keys=True, ensure_ascii=False)


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_normalized_turns_fit_the_schema_by_construction(rendering):
    """Validation checks a normalized record against the schema less its turns, which normalize builds
    to it: on every fixture row the full check agrees."""
    config, normalized = NormalizeConfig(rendering=rendering), 0
    for name, location in {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}.items():
        source = get_source(name)
        for f in source.files(location):
            for raw in (r for r in iter_rows(f.path, f.label) if not r.error):
                try:
                    record = normalize_row(raw.row, source, f.split, f.label, raw.index, config)
                except NormalizeError:
                    continue
                if isinstance(record, NormalizedRecord):
                    normalized += 1
                    assert first_error("trajectory", record, items_built=True) == first_error("trajectory", record)
    assert normalized > 100
