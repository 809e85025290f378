"""The test tree mirrors the packages: every test file sits in a folder under tests/, no two share a
name (pytest imports them by file name, each folder put on sys.path), and nothing imports conftest or
a test module: shared pieces live in tests/support, shared fixtures in a conftest."""
from __future__ import annotations

import ast
from collections import Counter

from tests.support.paths import REPO

TESTS = REPO / "tests"
TEST_FILES = sorted(p for p in TESTS.rglob("test_*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def _imported(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_every_test_file_is_in_a_folder_and_its_name_is_unique():
    assert TEST_FILES, "no test files found"
    assert [p.name for p in TEST_FILES if p.parent == TESTS] == []
    assert [name for name, n in Counter(p.name for p in TEST_FILES).items() if n > 1] == []


def test_nothing_imports_conftest_or_a_test_module():
    python = [*TESTS.rglob("*.py"), *(REPO / "bench").rglob("*.py")]
    found = {f"{p.relative_to(REPO)}: {name}" for p in python if "fixtures" not in p.relative_to(REPO).parts
             for name in _imported(p) if name.split(".")[-1] == "conftest" or name.split(".")[-1].startswith("test_")}
    assert found == set(), "import from tests/support (or use a conftest fixture) instead"
