"""The synthesis job's settings: plain dataclasses, light to import (the CLI reads their defaults).

`SynthConfig` is the job (`pipeline.synth.job`), `AgentConfig` one episode (`pipeline.synth.agent`),
`LLMConfig` the model endpoint (`pipeline.synth.llm`). A `trajforge synth --config` file has
their shape (configs/synth.yaml).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajforge.pipeline.synth.llm import LLMConfig

KEEP = ("best", "all")


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 8                # AgentBench's round limit
    max_format_retries: int = 2       # re-prompts in a row for one step before the episode fails
    success_threshold: float = 1.0    # env score at or above this is a success
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None           # sample k is drawn with seed + k, so reruns are reproducible
    license: str = "other"            # license of the task source, for the records
    instructions: dict[str, str] = field(default_factory=dict)  # per env name; overrides INSTRUCTIONS


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

    def __post_init__(self):
        if self.keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {self.keep!r}")
        if self.n < 1:
            raise ValueError("n must be at least 1")
