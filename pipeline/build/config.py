"""What a build is set to do: `BuildConfig`, the settings of every stage and output of a build.

The stage settings with a home of their own (normalize, validate, shards, dedup, negatives) are
their modules' dataclasses, nested here; a `--config` file's `stages` section is this dataclass as a
mapping (flows/config.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from trajforge.pipeline.ingest.normalize import NormalizeConfig
from trajforge.pipeline.ingest.validate import ValidateConfig
from trajforge.pipeline.publish.shards import ShardConfig
from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.pipeline.quality.negatives import NegativesConfig

# Records per batch wherever the build streams staged files: memory stays one batch.
BATCH_ROWS = 1024


@dataclass(frozen=True)
class BuildConfig:
    rendering: str = NormalizeConfig.rendering
    max_turn_chars: int = NormalizeConfig.max_turn_chars
    max_total_chars: int = ValidateConfig.max_total_chars
    # The most turns (all roles) a record may have; longer ones are quarantined as too_long.
    max_record_turns: int = ValidateConfig.max_turns
    # What a step the env refused inside an episode does: mask | drop | keep (pipeline/ingest/validate.py).
    invalid_steps: str = ValidateConfig.invalid_steps
    progress_every: int = 1000
    shards: ShardConfig = ShardConfig()
    dedup: DedupConfig = DedupConfig()
    negatives: NegativesConfig = NegativesConfig()
    # A file of evaluation tasks; trajectories whose task shares a word n-gram with one are quarantined.
    decontaminate: str | None = None
    decontaminate_ngram: int = 8
    # The declared eval splits (pipeline/evaluation/splits.py) are held out of every build unless this is off.
    decontaminate_splits: bool = True
    # Task texts of those splits that this build may train on all the same (RFT trains on its round
    # tasks and evaluates on the rest of the split); a build that spares any says so in its report.
    decontaminate_except: tuple[str, ...] = ()
    # Task files (pipeline.envs.tasks formats) whose tasks become `grpo_env` rows, beside the
    # trajectories' own resettable tasks.
    rl_tasks: tuple[str, ...] = ()

    def __post_init__(self):
        ValidateConfig(invalid_steps=self.invalid_steps)  # a bad value fails here, not mid-build

    @property
    def normalize(self) -> NormalizeConfig:
        return NormalizeConfig(rendering=self.rendering, max_turn_chars=self.max_turn_chars)

    @property
    def validate(self) -> ValidateConfig:
        return ValidateConfig(max_total_chars=self.max_total_chars, max_turns=self.max_record_turns,
                              invalid_steps=self.invalid_steps)
