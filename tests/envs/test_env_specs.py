"""Environment specs (pipeline/envs): each env has one home, and what the stages read is derived from it."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from tests.support.paths import REPO
from trajforge.pipeline.envs import recorded_in, runtimes, spec, specs
from trajforge.pipeline.envs.tasks import Task
from trajforge.schemas import load_schema

SCANNED = ("pipeline", "flows", "training")


def _own_files() -> dict[str, set[Path]]:
    """Env name -> the files that are its home: the module of its spec and the module of its runtime."""
    own: dict[str, set[Path]] = {}
    for name, env in specs().items():
        files = own.setdefault(name, set())
        home = next(Path(inspect.getfile(m)) for m in _spec_modules() if any(s.name == name for s in m.SPECS))
        files.add(home.resolve())
        if env.runtime:
            files.add(Path(inspect.getfile(importlib.import_module(env.runtime.split(":")[0]))).resolve())
    return own


def _spec_modules() -> list:
    import trajforge.pipeline.envs as package
    modules = [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
    return [m for m in modules if hasattr(m, "SPECS")]


def _string_literals(path: Path) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_source_names_an_env_outside_its_own_modules():
    """Adding an env is adding its modules: no other source file holds its name as a string literal
    (a table keyed by env, an `if env == ...` chain). Comments and docstrings may mention envs."""
    names = set(specs())
    own = _own_files()
    found = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            for line, value in _string_literals(path):
                if value in names and path.resolve() not in own[value]:
                    found.append(f"{path.relative_to(REPO)}:{line}: {value!r}")
    assert not found, "env names outside their own modules:\n" + "\n".join(found)


def test_the_scan_sees_an_env_name_where_it_is():
    # The check above can fail: the spec module of `db` does hold the literal.
    db_home = next(Path(inspect.getfile(m)) for m in _spec_modules() if any(s.name == "db" for s in m.SPECS))
    assert "db" in {value for _, value in _string_literals(db_home)}


def _arguments(tool) -> dict[str, str]:
    samples = {"command": "ls -la /tmp", "text": "42", "query": "SELECT * FROM `t`;", "answer": '["a", "b"]',
               "action": "go to red ball 1"}
    return {a.name: samples[a.name] for a in tool.arguments}


@pytest.mark.parametrize("name", list(runtimes()))
def test_every_tool_call_maps_to_action_text_and_back(name):
    """One source for both action formats: a tool's action text parses back to the same call."""
    env = spec(name)
    assert env.tools and env.task_format and env.tool_instructions and env.tool_call
    for tool in env.tools:
        arguments = _arguments(tool)
        assert env.tool_call(env.action_text(tool.name, arguments)) == {"name": tool.name, "arguments": arguments}
    with pytest.raises(ValueError, match="unknown tool 'teleport'"):
        env.action_text("teleport", {})


@pytest.mark.parametrize("name", list(runtimes()))
def test_the_trl_adapter_offers_exactly_the_spec_tools(name):
    from trajforge.training.environments import tool_schemas

    schemas = tool_schemas(name)
    assert [(s["function"]["name"], sorted(s["function"]["parameters"].get("properties", {}))) for s in schemas] == \
        sorted((t.name, sorted(a.name for a in t.arguments)) for t in spec(name).tools)
    assert all(s["function"]["description"] for s in schemas)


def test_the_grpo_env_schema_lists_the_envs_that_run():
    enum = load_schema("grpo_env")["properties"]["environment"]["enum"]
    assert sorted(enum) == sorted(runtimes())


def test_a_recorded_env_runs_in_its_own_env_or_in_the_host():
    hosts = [name for name, env in specs().items() if env.hosts_recorded]
    assert len(hosts) == 1
    assert recorded_in("a_new_agentgym_env").name == hosts[0]
    for name, env in specs().items():
        assert recorded_in(name).name == (name if env.recorded_here else hosts[0])


def test_only_runnable_envs_read_tasks_and_their_first_prompt_is_the_description_unless_fixed():
    for name, env in specs().items():
        assert (env.task_format is not None) == (env.runtime is not None), name
        task = Task("t", name, "the goal", {})
        if env.runtime and env.first_prompt is None:
            assert env.task_prompt(task) == "the goal"
