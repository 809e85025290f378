"""Registry of upstream sources: name -> Source."""
from __future__ import annotations

from trajforge.sources.agent_flan import AgentFlan
from trajforge.sources.agentinstruct import AgentInstruct
from trajforge.sources.agenttraj_l import AgentTrajL
from trajforge.sources.base import KeepRank, RawRow, Source, SourceError, SourceFile, iter_rows
from trajforge.sources.openmanus_rl import OpenManusRL
from trajforge.sources.synthetic import Synthetic

REGISTRY: dict[str, Source] = {s.name: s for s in (AgentInstruct(), AgentFlan(), AgentTrajL(), OpenManusRL(),
                                                    Synthetic())}

# What `trajforge build` reads when no --source is given: the three upstream datasets.
DEFAULT_SOURCES = ("agentinstruct", "agent_flan", "agenttraj_l")


def get_source(name: str) -> Source:
    try:
        return REGISTRY[name]
    except KeyError:
        raise SourceError(f"unknown source {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def keep_rank(name: str) -> KeepRank:
    """The dedup keep rank of a source's records."""
    return get_source(name).keep_rank


__all__ = ["REGISTRY", "DEFAULT_SOURCES", "KeepRank", "RawRow", "keep_rank", "Source", "SourceError", "SourceFile", "get_source", "iter_rows"]
