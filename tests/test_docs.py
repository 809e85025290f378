"""What README.md names exists: every module, function or class it gives as a dotted name
(`pipeline.synth.envs.make_env`, `trajforge.flows.notify`) imports and resolves, and every
repository path or file name it gives (`pipeline/build.py`, `configs/build.yaml`, `NOTES.md`) is in
the repository. A moved module or a removed file leaves no stale statement behind."""
from __future__ import annotations

import importlib
import re
import subprocess

import pytest

from tests.conftest import REPO

README = (REPO / "README.md").read_text()
PACKAGES = ("pipeline", "sources", "schemas", "flows", "training")
# A dotted name under one of the packages, with or without `trajforge.` (not part of a path or file name).
DOTTED = re.compile(rf"(?<![\w/.-])(?:trajforge\.)?(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+")
# A path under a top-level folder of the repository.
PATH = re.compile(rf"(?<![\w/.-])((?:\.ci|tests|bench|configs|{'|'.join(PACKAGES)})/[\w./*-]*[\w*])")
# A bare file name of ours (upstream data files, .json/.parquet, are other people's names).
FILE_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.(?:md|py|toml|txt|yaml))\b")


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute path inside the longest module prefix of it."""
    parts = dotted.removeprefix("trajforge.").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module("trajforge." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_the_checks_find_what_the_readme_names():
    """The patterns see the names they are for (a pattern that matched nothing would pass anything)."""
    assert {"pipeline.synth.envs.make_env", "pipeline.build.BuildConfig"} <= set(DOTTED.findall(README))
    assert {"pipeline/build.py", "configs/build.yaml"} <= set(PATH.findall(README))
    assert "constraints.txt" in FILE_NAME.findall(README)
    assert not _resolves("pipeline.envs.make_env") and not _resolves("pipeline.build.NoSuchThing")


@pytest.mark.parametrize("dotted", sorted(set(DOTTED.findall(README))))
def test_dotted_names_resolve(dotted):
    assert _resolves(dotted), f"README.md names {dotted}, which does not import"


@pytest.mark.parametrize("path", sorted(set(PATH.findall(README))))
def test_paths_exist(path):
    assert list(REPO.glob(path)), f"README.md names {path}, which is not in the repository"


def test_file_names_are_files_of_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    names = {line.rsplit("/", 1)[-1] for line in tracked.splitlines()}
    missing = sorted(set(FILE_NAME.findall(README)) - names)
    assert not missing, f"README.md names files the repository does not have: {missing}"


def test_the_record_example_is_at_the_schema_version():
    from trajforge.schemas import load_schema

    [example] = re.findall(r'"schema_version": "([\d.]+)"', README)
    assert example == load_schema("trajectory")["version"]
