"""The import graph (grimp, import-linter's engine) has no cycle, and the packages keep the dependency
rules of docs/architecture.md.

An import inside a function counts like one at the top of a module: a function-level import of one
of our modules does not remove a cycle, it only moves the failure from import time to call time.
The one exception is a function-level import of a module that needs an optional extra at import time
(torch, trl, minigrid...): it is lazy so that the core runs without the extra, not to hide an edge.
Imports under `if TYPE_CHECKING:` never run and do not count."""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
import tomllib
from pathlib import Path

import grimp
import pytest

from tests.support.paths import REPO

PACKAGES = ("pipeline", "sources", "schemas", "flows", "training")
# The import names of the optional extras (pyproject.toml), e.g. `prefect-dask` -> `prefect_dask`.
_PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OPTIONAL = frozenset(re.match(r"[\w.-]+", requirement).group().replace("-", "_").lower()
                     for extra, requirements in _PYPROJECT["project"]["optional-dependencies"].items()
                     if extra != "test" for requirement in requirements)


@functools.cache
def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*(f"trajforge.{p}" for p in PACKAGES), include_external_packages=True,
                             exclude_type_checking_imports=True, cache_dir=None)


def _ours(module: str) -> bool:
    return module.startswith("trajforge.")


@functools.cache
def _function_level_lines(module: str) -> frozenset[int]:
    """Line numbers of the import statements inside a function body of `module`."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    return frozenset(node.lineno for function in ast.walk(tree)
                     if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
                     for node in ast.walk(function) if isinstance(node, ast.Import | ast.ImportFrom))


def _lazy(importer: str, imported: str) -> bool:
    """Every import of `imported` in `importer` is inside a function."""
    lines = _function_level_lines(importer)
    return all(d["line_number"] in lines for d in _graph().get_import_details(importer=importer, imported=imported))


def _needs_an_extra(module: str) -> bool:
    """`module` imports an optional extra at its top level."""
    return any(not _ours(t) and t.split(".")[0] in OPTIONAL and not _lazy(module, t)
               for t in _graph().find_modules_directly_imported_by(module))


def _counted_edges() -> list[tuple[str, str]]:
    graph = _graph()
    return [(importer, imported) for importer in sorted(m for m in graph.modules if _ours(m))
            for imported in sorted(graph.find_modules_directly_imported_by(importer))
            if _ours(imported) and not (_lazy(importer, imported) and _needs_an_extra(imported))]


def _cycles(edges: list[tuple[str, str]]) -> set[tuple[str, ...]]:
    """Every cycle through an edge, as the shortest way back, rotated to start at its least module."""
    graph = grimp.ImportGraph()
    for importer, imported in edges:
        graph.add_import(importer=importer, imported=imported)
    found = set()
    for importer, imported in edges:
        back = graph.find_shortest_chain(importer=imported, imported=importer)
        if back:
            cycle = (importer, *back[:-1])
            start = cycle.index(min(cycle))
            found.add(cycle[start:] + cycle[:start])
    return found


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    """A two-module cycle and a three-module one are found; a chain that does not close is not."""
    edges = [("a", "b"), ("b", "a"), ("c", "d"), ("d", "e"), ("e", "c"), ("e", "f")]
    assert _cycles(edges) == {("a", "b"), ("c", "d", "e")}
    # The classification reads real files: flows/cli.py imports training.cli inside a function only.
    assert _lazy("trajforge.flows.cli", "trajforge.training.cli")
    assert not _lazy("trajforge.flows.cli", "trajforge.sources")
    assert _needs_an_extra("trajforge.training.sft") and not _needs_an_extra("trajforge.pipeline.registry")
    assert {"torch", "trl", "minigrid", "prefect_dask"} <= OPTIONAL


def test_no_import_cycle():
    cycles = sorted(_cycles(_counted_edges()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join((*c, c[0])) for c in cycles)


def _imports(importer_package: str, imported: str) -> list[str]:
    """`module -> imported module` for each import from a module of `importer_package` of `imported`
    (one of our packages, or an external top-level name)."""
    graph = _graph()
    return sorted(f"{m} -> {t}" for m in graph.modules if m == importer_package or m.startswith(importer_package + ".")
                  for t in graph.find_modules_directly_imported_by(m)
                  if t == imported or t.startswith(imported + "."))


# docs/architecture.md, "Dependency rules": (importer, imported, the imports that are allowed).
RULES = [
    *(("trajforge.schemas", f"trajforge.{p}", ()) for p in PACKAGES if p != "schemas"),
    ("trajforge.sources", "trajforge.pipeline", ("trajforge.sources -> trajforge.pipeline.registry",)),
    *(("trajforge.sources", f"trajforge.{p}", ()) for p in ("flows", "training")),
    ("trajforge.pipeline", "trajforge.flows", ()),
    # Only to load a trained reward model, inside the functions that do (checked below).
    ("trajforge.pipeline", "trajforge.training", ("trajforge.pipeline.quality.score -> trajforge.training.process_reward_model",
                                                  "trajforge.pipeline.quality.score -> trajforge.training.reward_model")),
    ("trajforge.training", "trajforge.flows", ()),
    *((f"trajforge.{p}", "prefect", ()) for p in PACKAGES if p != "flows"),
]


@pytest.mark.parametrize("importer, imported, allowed", RULES, ids=[f"{a}-x->{b}" for a, b, _ in RULES])
def test_dependency_rule(importer, imported, allowed):
    assert set(_imports(importer, imported)) <= set(allowed)


def test_the_allowed_imports_exist_and_are_lazy():
    """The rules' exceptions are real (a stale one would allow an import nobody makes), and pipeline
    and flows import training only inside functions, so the build and `--help` run without the
    `train` extra."""
    for importer, imported, allowed in RULES:
        for edge in allowed:
            assert edge in _imports(importer, imported), edge
    into_training = _imports("trajforge.pipeline", "trajforge.training") + _imports("trajforge.flows", "trajforge.training")
    assert into_training
    assert [edge for edge in into_training if not _lazy(*edge.split(" -> "))] == []
