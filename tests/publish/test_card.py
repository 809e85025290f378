"""Dataset card and manifest: front matter `datasets` and the Hub read, body counts, provenance."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from datasets import Features
from datasets.info import DatasetInfosDict
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCard

from tests.support.paths import FIXTURE_SOURCES
from trajforge.pipeline.publish.card import hub_license_id, size_category
from trajforge.pipeline.publish.manifest import file_sha256, read_manifest
from trajforge.schemas import arrow_schema
from trajforge.sources import get_source


@pytest.fixture(scope="module")
def card(fixtures_build) -> DatasetCard:
    return DatasetCard.load(fixtures_build / "README.md")


def test_front_matter_configs_features_and_sizes(card, fixtures_build):
    configs = MetadataConfigs.from_dataset_card_data(card.data)
    assert configs["sft"]["data_files"] == [{"split": "train", "path": "data/sft/train-*.parquet"}]
    assert configs.get_default_config_name() == "sft"
    info = DatasetInfosDict.from_dataset_card_data(card.data)["sft"]
    assert info.features == Features.from_arrow_schema(arrow_schema("trajectory"))
    rows = pq.read_metadata(fixtures_build / "data/sft/train-00000-of-00001.parquet").num_rows
    assert info.splits["train"].num_examples == rows
    assert info.download_size == (fixtures_build / "data/sft/train-00000-of-00001.parquet").stat().st_size
    assert card.data.task_categories == ["text-generation"]
    assert card.data.size_categories == [size_category(rows)]


def test_licenses_are_the_upstream_ones_per_source(card):
    stated = {name: get_source(name).license for name in FIXTURE_SOURCES}
    assert sorted(card.data.license) == sorted({hub_license_id(text) for text in stated.values()})
    body = card.text
    for name, text in stated.items():
        # One provenance row per source: its upstream repo and its license as stated.
        row = next(line for line in body.splitlines()
                   if line.startswith(f"| {name} |") and "huggingface.co/datasets" in line)
        assert get_source(name).hub_repo in row and text in row
        # Local files are named by content: the real sha256 of each input file.
        assert "local files" in row
        for file in get_source(name).files(FIXTURE_SOURCES[name]):
            assert f"`{file.label}` (sha256 `{file_sha256(file.path)}`)" in row


def test_body_has_counts_quarantine_schema_and_ids(card, fixtures_build):
    report = json.loads((fixtures_build / "report.json").read_text())
    body = card.text
    total = report["total"]
    assert (f"| **total** | {total['read']} | {total['written']} | {total['quarantined']} | {total['duplicates']} |"
            in body)
    for reason, n in total["reasons"].items():
        assert f"| `{reason}` | {n} |" in body
    dup = report["duplicates"]
    assert f"{dup['total']} records dropped as duplicates" in body
    for source, n in dup["by_source"].items():
        assert f"| {source} | {n} |" in body
    for kind, n in report["negatives"]["by_type"].items():
        assert f"| `{kind}` | {n} |" in body
    for field in arrow_schema("trajectory").names:
        assert f"| `{field}` |" in body
    assert "## Validation per environment" in body
    for env, e in report["validation_by_env"].items():
        assert f"| {env} | yes | {e['records']} | {e['actions_checked']} | {e['actions_valid']} (" in body
    assert "| mind2web.operation 1 |" in body
    assert f"build id: `{read_manifest(fixtures_build)['build_id']}`" in body
    assert "code version: `" in body


def test_count_table_rows_add_up(card, fixtures_build):
    """Per source and in total: read = written + quarantined + duplicates, as the report counts them."""
    report = json.loads((fixtures_build / "report.json").read_text())
    lines = card.text.split("## Counts", 1)[1].strip().splitlines()
    assert lines[0] == "| source | read | written | quarantined | duplicates |"
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        name, *counts = [cell.strip() for cell in line.strip("|").split("|")]
        rows[name] = [int(c) for c in counts]
    assert rows.keys() == {*report["sources"], "**total**"}
    assert any(counts[3] for counts in rows.values()), "the fixtures hold duplicates"
    for name, (read, written, quarantined, duplicates) in rows.items():
        assert read == written + quarantined + duplicates, name
        entry = report["total"] if name == "**total**" else report["sources"][name]
        assert [read, written, quarantined, duplicates] == [entry[k] for k in ("read", "written", "quarantined",
                                                                               "duplicates")]


def test_build_is_reproducible_in_another_folder(fixtures_build, tmp_path):
    """Same inputs, config and code: byte-identical shards, card, report and manifest (same build id)."""
    from trajforge.pipeline.build import BuildConfig, finalize, process_unit

    config = BuildConfig()
    units = [process_unit(name, f, tmp_path / ".staging", config)
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    finalize(units, tmp_path, config)
    manifest = read_manifest(tmp_path)
    assert manifest == read_manifest(fixtures_build)
    for rel in manifest["files"]:
        assert (tmp_path / rel).read_bytes() == (fixtures_build / rel).read_bytes(), rel


def test_hub_license_ids_are_kept_and_other_texts_published_as_other():
    assert hub_license_id("unknown (AgentGym code: mit)") == "unknown"
    assert hub_license_id("some custom terms") == "other"
