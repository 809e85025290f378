"""The synthesis job's settings: plain dataclasses, light to import (the CLI reads their defaults).

`SynthConfig` is the job (`pipeline.synth.job`), `AgentConfig` one episode (`pipeline.synth.agent`),
`SearchConfig` the tree search per task (`pipeline.synth.search`), `LLMConfig` the model endpoint
(`pipeline.llm.client`). A `trajforge synth --config` file has their shape (configs/synth.yaml).
`RFTConfig` is the rejection-sampling loop that synthesizes each round (flows/rft.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajforge.pipeline.llm.client import LLMConfig

KEEP = ("best", "all")
SEARCH_STRATEGIES = ("best_of_n", "beam", "mcts", "dfsdt")
VALUE_MODELS = ("judge",)
# How long a checkpoint served for a run (`trajforge rft`, `eval --serve`) may take to answer.
SERVE_STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class AgentConfig:
    # The episode's turn budget: model actions before it ends as `max_turns` (AgentBench's round limit).
    max_turns: int = 8
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


@dataclass
class RFTConfig:
    """`trajforge rft`: rounds of build -> SFT -> serve -> synthesize on `tasks` -> keep successes."""
    tasks: str                         # the round tasks (their successes are trained on)
    env: str
    base_model: str                    # the model every round fine-tunes (folder or Hub id)
    out: str
    # The build's sources (source name -> local path or Hub repo id, None: its Hub repo).
    sources: dict[str, str | None] = field(default_factory=lambda: {"agentinstruct": None})
    rounds: int = 2
    sft_args: list[str] = field(default_factory=list)    # the SFT launcher's arguments (--config FILE ...)
    serve: str | list[str] = "transformers"             # a server name (pipeline.rft) or a command
    startup_timeout_s: float = SERVE_STARTUP_TIMEOUT_S
    n: int = SynthConfig.n                               # samples per round task
    agent: AgentConfig = field(default_factory=AgentConfig)
    # A checkpoint served on a CPU answers few requests at once.
    llm: LLMConfig = field(default_factory=lambda: LLMConfig(concurrency=16))
    eval_tasks: str | None = None      # held-out tasks of each round's eval (default: the env's split less `tasks`)
    eval_n: int = 1                    # samples per held-out task
