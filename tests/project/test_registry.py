"""One registry helper: one error for an unknown name, listing the known ones, in every registry;
and a KeyError inside a registered constructor stays that KeyError."""
import dataclasses
import json

import pytest

from tests.support.paths import FIXTURES
from trajforge.flows.build import make_task_runner
from trajforge.pipeline.envs import spec, specs
from trajforge.pipeline.envs.agentgym import COMMON_PROFILE, server_profile
from trajforge.pipeline.envs.tasks import TaskFormatError, load_tasks, record_to_task
from trajforge.pipeline.ingest.dialects import DIALECTS
from trajforge.pipeline.ingest.grammars import GRAMMARS
from trajforge.pipeline.ingest.validate import RULES
from trajforge.pipeline.llm.client import BACKENDS, FAMILIES, LLMConfig, make_backend
from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.pipeline.quality.negatives import NegativesConfig
from trajforge.pipeline.registry import Registry, UnknownName
from trajforge.pipeline.rft import SERVE_COMMANDS, serve_command
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.envs.agentgym import AgentGymEnv
from trajforge.sources import SourceError, get_source
from trajforge.training.environments import EnvironmentFactory
from trajforge.training.rewards import env_reward, get_rewards


def test_registry_lists_known_names_and_is_a_key_and_value_error():
    colours = Registry("colour", {"red": 1, "blue": 2})

    @colours.register("green")
    def green():
        return 3

    assert colours["green"] is green and list(colours) == ["red", "blue", "green"] and colours.get("pink") is None
    with pytest.raises(UnknownName) as caught:
        colours["pink"]
    assert str(caught.value) == "unknown colour 'pink'; known: blue, green, red"
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)
    assert caught.value.known == ["blue", "green", "red"]
    with pytest.raises(ValueError, match="registered twice"):
        colours.register("red", 4)
    with pytest.raises(UnknownName, match="unknown colour"):
        colours[["a", "list"]]  # an unhashable name, as YAML can give


@pytest.mark.parametrize("lookup, message", [
    (lambda: get_source("nope"), "unknown source 'nope'; known: agent_flan, agentinstruct"),
    (lambda: make_env("nope"), "unknown environment 'nope'; known: agentgym, babyai, db, os, sciworld, textcraft"),
    (lambda: make_backend("nope", LLMConfig(model="m")), "unknown LLM backend 'nope'; known: openai, vllm"),
    (lambda: get_rewards(["format", "nope"]), "unknown reward 'nope'; known: accuracy, env, format"),
    (lambda: NegativesConfig(rates={"nope": 0.5}), "unknown negative type 'nope'; known: action_loop"),
    (lambda: DedupConfig(backend="nope"), "unknown MinHash backend 'nope'; known: datasketch, numpy"),
    (lambda: EnvironmentFactory("nope"), "unknown environment 'nope'; known: agentgym, babyai, db, os, sciworld, textcraft"),
    (lambda: DIALECTS["nope"], "unknown dialect 'nope'; known: "),
    (lambda: GRAMMARS["nope"], "unknown grammar 'nope'; known: "),
    (lambda: FAMILIES["nope"], "unknown model family 'nope'; known: deepseek-r1, default, qwq"),
    (lambda: make_task_runner("nope"), "unknown runner 'nope'; known: dask, processes, ray, threads"),
    (lambda: serve_command("nope"), "unknown serve command 'nope'; known: transformers, vllm"),
    (lambda: RULES["nope"], "unknown validation rule 'nope'; known: action_grammar, action_loop, answer_consistent"),
])
def test_every_registry_raises_the_one_error(lookup, message):
    with pytest.raises(UnknownName) as caught:
        lookup()
    assert str(caught.value).startswith(message)


def test_unknown_names_keep_their_domain_error_types():
    with pytest.raises(SourceError, match="unknown source 'nope'; known: "):
        get_source("nope")
    with pytest.raises(TaskFormatError, match="unknown env 'chess'; known: agentgym, babyai, db, os, sciworld, textcraft"):
        record_to_task({"env": "chess", "description": "x"}, "f")


class _BrokenBackend:
    def __init__(self, config, **kw):
        self.settings = {}["base_url"]  # a bug in a constructor


class _BrokenEnv:
    def __init__(self, **config):
        self.limits = {}["memory"]


def test_key_error_inside_a_backend_constructor_is_not_an_unknown_name(monkeypatch):
    monkeypatch.setitem(BACKENDS._entries, "broken", _BrokenBackend)
    with pytest.raises(KeyError) as caught:
        make_backend("broken", LLMConfig(model="m"))
    assert not isinstance(caught.value, UnknownName) and caught.value.args == ("base_url",)


def test_key_error_inside_an_env_constructor_reaches_the_env_reward(monkeypatch):
    task = load_tasks(FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl")[0]
    columns = {"env_task": [json.dumps(task.as_dict())]}
    monkeypatch.setitem(specs()._entries, "db", dataclasses.replace(spec("db"), runtime=f"{__name__}:_BrokenEnv"))
    with pytest.raises(KeyError) as caught:
        env_reward(["Action: Answer\nFinal Answer: []"], **columns)
    assert not isinstance(caught.value, UnknownName) and caught.value.args == ("memory",)
    # An env no registry entry has still gets no reward (None), as before.
    columns = {"env_task": [json.dumps({**task.as_dict(), "env": "agentgym"})]}
    monkeypatch.delitem(specs()._entries, "agentgym")
    assert env_reward(["Action: Answer\nFinal Answer: []"], **columns) == [None]


def test_cli_runner_names_are_the_registered_task_runners():
    from trajforge.flows.build import TASK_RUNNERS
    from trajforge.flows.config import RUNNERS

    assert sorted(RUNNERS) == TASK_RUNNERS.names()


def test_an_unknown_serve_command_name_lists_the_known_ones_where_it_is_looked_up(tmp_path):
    from tests.support.cli import trajforge
    from trajforge.flows.rft import rft

    message = "unknown serve command 'vlm'; known: transformers, vllm"
    with pytest.raises(UnknownName, match=message):  # the flow, before any round
        rft.fn(sources={}, tasks="tasks.jsonl", env="db", base_model="m", out=str(tmp_path / "out"), serve="vlm")
    assert not (tmp_path / "out").exists()
    proc, _, _ = trajforge("rft", "--tasks", "t.jsonl", "--env", "db", "--base-model", "m", "--out",
                           str(tmp_path / "out"), "--sft-config", "c.yaml", "--serve", "vlm")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith(f"argument --serve: {message}")
    # A command line (it says where to listen) and an argv are commands, not names.
    assert serve_command("python -m server --port {port} {model}") == ["python", "-m", "server", "--port", "{port}",
                                                                        "{model}"]
    assert serve_command(["my-server", "{port}"]) == ["my-server", "{port}"]
    assert serve_command("vllm") == SERVE_COMMANDS["vllm"]


def test_an_agentgym_server_without_a_profile_speaks_the_common_shape():
    assert server_profile("webshop").id_key == "env_idx" and server_profile("babyai").reward_key == "score"
    assert server_profile("a_new_env") is COMMON_PROFILE and server_profile("") is COMMON_PROFILE
    assert AgentGymEnv("http://127.0.0.1:1", "a_new_env")._profile is COMMON_PROFILE


def test_validation_rules_run_in_registration_order():
    assert list(RULES)[:2] == ["schema", "role_order"] and list(RULES)[-1] == "outcome_consistent"
