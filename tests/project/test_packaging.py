"""The distribution ships every package of the tree: a folder missing from pyproject's list installs
in editable mode (the finder walks folders) and is silently absent from a wheel."""
from __future__ import annotations

import tomllib

from tests.support.paths import REPO


def test_every_package_folder_is_in_the_distribution():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree: set[str] = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            tree.add(".".join([name, *rel.parts]))
    assert tree == set(setuptools["packages"])
