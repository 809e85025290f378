"""The step_labels config: where each label of a step comes from, on the real fixtures build."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from trajforge.pipeline.quality.derived import step_labels_of


def read(build: Path, config: str) -> list[dict]:
    return [r for p in sorted((build / "data" / config).glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_every_kept_trajectory_and_negative_has_its_step_labels(fixtures_build):
    rows = {r["record_id"]: r for r in read(fixtures_build, "step_labels")}
    records, negatives = read(fixtures_build, "sft"), read(fixtures_build, "negatives")
    pairs = {p["negative_id"] for p in read(fixtures_build, "preference")}
    assert {r["id"] for r in records} <= set(rows)
    # A negative has step labels exactly when it has a preference pair: both stop at its wrong step.
    assert {n["id"] for n in negatives if n["id"] in rows} == pairs
    for record in records:
        messages = rows[record["id"]]["messages"]
        assert [(m["role"], m["content"]) for m in messages] == [(t["role"], t["content"])
                                                                for t in record["conversations"]]
        # Validation masked the steps its env refused (meta masked_steps): those are the bad steps.
        refused = {step["turn"] for step in json.loads(record["meta"]).get("masked_steps", [])}
        for i, (m, t) in enumerate(zip(messages, record["conversations"])):
            trained = t["role"] == "assistant" and t["loss"]
            expected = (1, "trajectory") if trained else (0, "refused") if i in refused else (None, None)
            assert (m["label"], m["label_source"]) == expected
    report = json.loads((fixtures_build / "report.json").read_text())["step_labels"]
    assert report["rows"] == len(rows)
    assert report["steps"]["negative:bad"] == len(pairs)
    # Refused steps: the kept records' masked steps, and those negatives inherit before their wrong step.
    assert report["steps"]["refused:bad"] == sum(m["label_source"] == "refused" for r in rows.values()
                                                 for m in r["messages"])
    assert report["steps"]["refused:bad"] >= sum(len(json.loads(r["meta"]).get("masked_steps", [])) for r in records)


def test_a_negative_is_labelled_up_to_its_first_wrong_step(fixtures_build):
    rows = {r["record_id"]: r for r in read(fixtures_build, "step_labels")}
    pairs = {p["negative_id"]: p for p in read(fixtures_build, "preference")}
    for negative in read(fixtures_build, "negatives"):
        row = rows.get(negative["id"])
        if row is None:
            assert negative["id"] not in pairs
            continue
        pair = pairs[negative["id"]]
        assert (row["kind"], row["negative_type"], row["env"]) == ("negative", negative["negative_type"], negative["env"])
        *before, bad = row["messages"]
        assert (bad["label"], bad["label_source"]) == (0, "negative")
        assert bad["content"] == pair["rejected"][0]["content"]
        assert [(m["role"], m["content"]) for m in before] == [(m["role"], m["content"]) for m in pair["prompt"]]
        # Before it, the parent's labels: trained steps good, steps its env refused bad, the rest context.
        assert all((m["label"], m["label_source"]) in ((1, "trajectory"), (0, "refused"), (None, None)) for m in before)


def test_refused_critical_and_salvaged_steps_are_named(fixtures_build):
    record = next(r for r in read(fixtures_build, "sft")
                  if sum(t["role"] == "assistant" and t["loss"] and bool(t["action"]) for t in r["conversations"]) >= 3)
    steps = [i for i, t in enumerate(record["conversations"]) if t["role"] == "assistant" and t["loss"]]
    actions = [i for i, t in enumerate(record["conversations"]) if t["role"] == "assistant" and t["action"]]
    turns = [dict(t) for t in record["conversations"]]
    turns[steps[-1]]["critical"] = True
    turns[steps[1]]["loss"] = False  # validation masks a refused step: context, named in meta
    meta = {**json.loads(record["meta"]), "masked_steps": [{"turn": steps[1], "rule": "textcraft.refused"}],
            "beneficial_steps": [0]}
    row = step_labels_of({**record, "conversations": turns, "meta": json.dumps(meta)})
    labels = {i: (m["label"], m["label_source"]) for i, m in enumerate(row["messages"]) if m["label"] is not None}
    assert labels[steps[1]] == (0, "refused")
    assert labels[steps[-1]] == (1, "critical")
    assert labels[actions[0]] == (1, "salvage")
    assert {v for k, v in labels.items() if k not in (steps[1], steps[-1], actions[0])} == {(1, "trajectory")}
