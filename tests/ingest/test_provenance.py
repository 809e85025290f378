"""One dataset is never published under another's name and license without the builder saying so.

The readers accept any layout (mirrors re-serialize), so the check looks at what was read: a
source's files that another registered source recognizes as its own (file names, id patterns,
row keys) and the named source does not are refused with exit 2, unless `--source-as NAME` (or
`source_as:` in a --config file) says they are NAME's; the card then states what they look like.
"""
from __future__ import annotations

import shutil

import pytest
import yaml
from huggingface_hub import DatasetCard

from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, RAW
from trajforge.flows.build import resolve_source
from trajforge.flows.cli import main
from trajforge.sources import REGISTRY, ForeignLayout, check_layout, get_source

# Every fixture source in its own layout: the legitimate fixtures build.
OWN = {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}


@pytest.fixture
def agentinstruct_on_the_hub(tmp_path):
    """AgentInstruct rows as its Hub repo lays them out: data/<split>-00000-of-00001-<hash>.parquet."""
    folder = tmp_path / "AgentInstruct"
    (folder / "data").mkdir(parents=True)
    shutil.copy(RAW / "agentinstruct" / "db-sample.parquet", folder / "data" / "db-00000-of-00001-5f8c1d2e.parquet")
    return folder


def refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1 and not printed.out, printed.err
    return lines[0]


def test_agentinstruct_read_as_agent_flan_is_refused_naming_both(agentinstruct_on_the_hub, tmp_path, capsys):
    line = refused(capsys, "build", "--out", str(tmp_path / "o"), "--source", f"agent_flan={agentinstruct_on_the_hub}")
    assert line.startswith("trajforge: error: --source agent_flan: data/db-00000-of-00001-5f8c1d2e.parquet "
                           "looks like agentinstruct")
    assert "cc-by-nc-4.0" in line and "apache-2.0" in line and "--source-as agent_flan" in line
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("read_as", sorted(OWN))
@pytest.mark.parametrize("actual", sorted(OWN))
def test_every_fixture_source_is_accepted_as_itself_and_refused_as_another(actual, read_as):
    files = get_source(read_as).files(OWN[actual])
    if actual == read_as:
        check_layout(read_as, files)
        return
    with pytest.raises(ForeignLayout, match=rf"^--source {read_as}: .* looks like {actual} "):
        check_layout(read_as, files)


def test_the_flow_checks_too(agentinstruct_on_the_hub):
    """A deployment run (or a Hub source, checked once downloaded) meets the same check in the flow."""
    with pytest.raises(ForeignLayout, match="looks like agentinstruct"):
        resolve_source.fn("agent_flan", str(agentinstruct_on_the_hub))
    assert resolve_source.fn("agent_flan", str(agentinstruct_on_the_hub), check=False)


def test_source_as_must_name_a_source_of_the_build(agentinstruct_on_the_hub, tmp_path, capsys):
    line = refused(capsys, "build", "--out", str(tmp_path / "o"), "--source", f"agent_flan={agentinstruct_on_the_hub}",
                   "--source-as", "agentinstruct")
    assert line == "trajforge: error: --source-as agentinstruct: not a source of this build (agent_flan)"


@pytest.mark.slow
def test_source_as_from_a_config_file_builds_and_the_card_says_what_was_read(agentinstruct_on_the_hub, tmp_path):
    config = tmp_path / "build.yaml"
    config.write_text(yaml.safe_dump({"out": str(tmp_path / "o"), "runner": "threads",
                                      "sources": {"agent_flan": str(agentinstruct_on_the_hub)},
                                      "source_as": ["agent_flan"]}))
    assert main(["build", "--config", str(config)]) == 0
    card = DatasetCard.load(tmp_path / "o" / "README.md")
    # The records carry the named source's license; the files look like AgentInstruct: both are stated.
    assert sorted(card.data.license) == ["apache-2.0", "cc-by-nc-4.0"]
    [row] = [line for line in card.text.splitlines() if line.startswith("| agent_flan |")
             and "huggingface.co" in line]
    assert (f"1 of 1 files look like agentinstruct ({REGISTRY['agentinstruct'].license})" in row
            and "`--source-as agent_flan`" in row)
