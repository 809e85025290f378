"""What the docs name exists: every module, function or class README.md or a page under docs/
gives as a dotted name (`pipeline.synth.envs.make_env`, `trajforge.flows.notify`) imports and
resolves, and every repository path or file name it gives (`pipeline/build/units.py`,
`configs/build.yaml`, `NOTES.md`) is in the repository. A moved module or a removed file leaves no
stale statement behind. The README stays short and opens with the quick start; the rest is in docs/."""
from __future__ import annotations

import importlib
import re
import subprocess

import pytest

from tests.support.paths import REPO

README = (REPO / "README.md").read_text()
DOCS = {path.relative_to(REPO).as_posix(): path.read_text()
        for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]}
README_MAX_LINES = 260
PACKAGES = ("pipeline", "sources", "schemas", "flows", "training")
# A dotted name under one of the packages, with or without `trajforge.` (not part of a path, nor a page
# name like `training.md`).
DOTTED = re.compile(rf"(?<![\w/.-])(?:trajforge\.)?(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+\b(?<!\.md)")
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


def _named(pattern: re.Pattern) -> list[tuple[str, str]]:
    """(doc, name) for every distinct name `pattern` finds in each doc."""
    return [(doc, name) for doc, text in DOCS.items() for name in sorted(set(pattern.findall(text)))]


def test_the_checks_find_what_the_readme_names():
    """The patterns see the names they are for (a pattern that matched nothing would pass anything)."""
    every = "\n".join(DOCS.values())
    assert {"pipeline.synth.envs.make_env", "pipeline.build.BuildConfig"} <= set(DOTTED.findall(every))
    assert {"pipeline/build/units.py", "configs/build.yaml"} <= set(PATH.findall(every))
    assert "constraints.txt" in FILE_NAME.findall(README)
    assert not _resolves("pipeline.envs.make_env") and not _resolves("pipeline.build.NoSuchThing")


def test_the_docs_tree_is_read():
    """The pages the README links to are among those checked, so a page under docs/ is not skipped."""
    linked = {f"docs/{name}" for name in re.findall(r"\(docs/([\w/-]+\.md)", README)}
    assert linked and linked <= set(DOCS)


@pytest.mark.parametrize(("doc", "dotted"), _named(DOTTED))
def test_dotted_names_resolve(doc, dotted):
    assert _resolves(dotted), f"{doc} names {dotted}, which does not import"


@pytest.mark.parametrize(("doc", "path"), _named(PATH))
def test_paths_exist(doc, path):
    assert list(REPO.glob(path)), f"{doc} names {path}, which is not in the repository"


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_file_names_are_files_of_the_repository(doc):
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    names = {line.rsplit("/", 1)[-1] for line in tracked.splitlines()}
    missing = sorted(set(FILE_NAME.findall(DOCS[doc])) - names)
    assert not missing, f"{doc} names files the repository does not have: {missing}"


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```[\w-]*\n.*?^```$", "", text, flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_links_between_docs_lead_to_a_page_and_heading(doc):
    here = (REPO / doc).parent
    broken = []
    for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)(?:#([\w-]+))?\)", DOCS[doc]):
        page = here / target if target else REPO / doc
        if not page.is_file() or (anchor and anchor not in _anchors(page.read_text())):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc} links to pages or headings that do not exist: {broken}"


def test_the_readme_is_short_and_starts_with_the_quick_start():
    lines = README.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the details belong in docs/"
    [first_section] = [line for line in lines if line.startswith("## ")][:1]
    assert first_section == "## Quick start"
    commands = re.search(r"## Quick start.*?```bash\n(.*?)```", README, re.S).group(1).splitlines()
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[0].endswith("trajforge build --out build") and commands[1] == "python -m pytest -q"
    assert commands[1] in ci.splitlines(), "the README's test command is the one .ci/run runs"
    extras = re.compile(r'pip install (?:-q )?-c constraints.txt -e "(\.\[[\w,]+\])"')
    assert extras.findall(commands[0]) == extras.findall(ci), "the README installs the extras .ci/run installs"


def test_the_record_example_is_at_the_schema_version():
    from trajforge.schemas import load_schema

    [example] = re.findall(r'"schema_version": "([\d.]+)"', DOCS["docs/record.md"])
    assert example == load_schema("trajectory")["version"]
