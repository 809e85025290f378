"""The synthesis job's settings: plain dataclasses, light to import (the CLI reads their defaults).

`SynthConfig` is the job (`pipeline.synth.job`), `AgentConfig` one episode (`pipeline.synth.agent`),
`SearchConfig` the tree search per task (`pipeline.synth.search`), `LLMConfig` the model endpoint
(`pipeline.llm.client`). A `trajforge synth --config` file has their shape (configs/synth.yaml).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajforge.pipeline.llm.client import LLMConfig

KEEP = ("best", "all")
SEARCH_STRATEGIES = ("best_of_n", "beam", "mcts", "dfsdt")
VALUE_MODELS = ("judge",)


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 8                # AgentBench's round limit
    max_format_retries: int = 2       # re-prompts in a row for one step before the episode fails
    success_threshold: float = 1.0    # env score at or above this is a success
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None           # sample k is drawn with seed + k, so reruns are reproducible
    license: str = "other"            # license of the task source, for the records
    instructions: dict[str, str] = field(default_factory=dict)  # per env name; overrides the env spec's instructions


@dataclass(frozen=True)
class SearchConfig:
    """Tree search per task (`pipeline.synth.search`); strategy None runs the plain best-of-N job."""
    strategy: str | None = None       # best_of_n | beam | mcts | dfsdt
    branch: int = 3                   # K: candidate next steps proposed at a state (beam: also its width)
    max_calls: int | None = 64        # LLM calls per task, answers from the cache included
    max_tokens: int | None = None     # completion tokens per task; each request may use what is left
    value_model: str | None = None    # judge: the model rates non-terminal states (beam ranks by it)
    uct_c: float = 1.4                # MCTS exploration constant
    stop_on_success: bool = True      # end a task's search at its first success

    def __post_init__(self):
        if self.strategy is not None and self.strategy not in SEARCH_STRATEGIES:
            raise ValueError(f"search strategy must be one of {SEARCH_STRATEGIES}, not {self.strategy!r}")
        if self.value_model is not None and self.value_model not in VALUE_MODELS:
            raise ValueError(f"value_model must be one of {VALUE_MODELS}, not {self.value_model!r}")
        if self.branch < 1:
            raise ValueError("branch must be at least 1")
        if self.max_calls is not None and self.max_calls < 1 or self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_calls and max_tokens must be at least 1")
        if self.strategy not in (None, "best_of_n") and self.max_calls is None and self.max_tokens is None:
            raise ValueError(f"search strategy {self.strategy!r} searches until its budget is spent: "
                             "set max_calls or max_tokens")


@dataclass
class SynthConfig:
    tasks: str
    env: str
    out: str
    llm: LLMConfig
    n: int = 4
    keep: str = "best"                 # best: one record per task (highest reward, then fewest turns)
    episode_concurrency: int = 16      # environments alive at once; LLM calls are bounded by llm.concurrency
    backend: str = "openai"
    agent: AgentConfig = field(default_factory=AgentConfig)
    env_kw: dict[str, Any] = field(default_factory=dict)
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self):
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {self.keep!r}")
        if self.n < 1:
            raise ValueError("n must be at least 1")
