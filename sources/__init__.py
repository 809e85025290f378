"""Registry of upstream sources: name -> Source, and the check that a source's files are its own."""
from __future__ import annotations

from itertools import islice
from pathlib import Path

from trajforge.pipeline.registry import Registry, UnknownName
from trajforge.sources.agent_flan import AgentFlan
from trajforge.sources.agentinstruct import AgentInstruct
from trajforge.sources.agenttraj_l import AgentTrajL
from trajforge.sources.base import KeepRank, RawRow, Source, SourceError, SourceFile, iter_rows
from trajforge.sources.openmanus_rl import OpenManusRL
from trajforge.sources.synthetic import Synthetic

REGISTRY: Registry[Source] = Registry("source", {s.name: s for s in (AgentInstruct(), AgentFlan(), AgentTrajL(),
                                                                     OpenManusRL(), Synthetic())})

# What `trajforge build` reads when no --source is given: the three upstream datasets.
DEFAULT_SOURCES = ("agentinstruct", "agent_flan", "agenttraj_l")


class UnknownSource(UnknownName, SourceError):
    """An unknown source name: a bad argument that fails the build fast, like every SourceError."""


def get_source(name: str) -> Source:
    try:
        return REGISTRY[name]
    except UnknownName as exc:
        raise UnknownSource(exc.kind, exc.name, exc.known) from None


def keep_rank(name: str) -> KeepRank:
    """The dedup keep rank of a source's records."""
    return get_source(name).keep_rank


# Rows of a file that the layout check looks at: its first ones, so that it costs a read of the
# file's beginning, not of the file.
LAYOUT_ROWS = 16


class ForeignLayout(SourceError):
    """A source's files are in another registered source's layout: reading them would publish one
    dataset under another's name and license."""


def looks_like(name: str, path: Path) -> tuple[str, str] | None:
    """(another source, why) when a data file read as source `name` is in that other source's
    upstream layout and not in `name`'s own (`Source.recognizes`, on its first decoded rows)."""
    rows = [raw.row for raw in islice(iter_rows(path), LAYOUT_ROWS * 4) if raw.row is not None][:LAYOUT_ROWS]
    if not rows or get_source(name).recognizes(path, rows):
        return None
    return next(((other, why) for other, source in REGISTRY.items() if other != name
                 for why in [source.recognizes(path, rows)] if why), None)


def check_layout(name: str, files: list[SourceFile]) -> None:
    """Raise ForeignLayout (one line naming both sources and their licenses) when a file of source
    `name` looks like another source's; the user's `--source-as NAME` skips this check."""
    for file in files:
        found = looks_like(name, file.path)
        if found:
            other, why = found
            raise ForeignLayout(
                f"--source {name}: {file.label} looks like {other} ({why}), not {name}; reading it as {name} would "
                f"publish {other}'s records ({get_source(other).license}) as {name} ({get_source(name).license}): "
                f"give it as --source {other}=PATH, or add --source-as {name} if it is {name}'s data in another layout")


__all__ = ["REGISTRY", "DEFAULT_SOURCES", "ForeignLayout", "KeepRank", "RawRow", "check_layout", "keep_rank",
           "looks_like", "Source", "SourceError", "SourceFile", "UnknownSource", "get_source", "iter_rows"]
