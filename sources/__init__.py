"""Registry of upstream sources: name -> Source."""
from __future__ import annotations

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


__all__ = ["REGISTRY", "DEFAULT_SOURCES", "KeepRank", "RawRow", "keep_rank", "Source", "SourceError", "SourceFile",
           "UnknownSource", "get_source", "iter_rows"]
