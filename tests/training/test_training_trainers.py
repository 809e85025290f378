"""SFT 5 steps, GRPO 2 steps, DPO 2 steps on the fixtures build with a tiny random model, on CPU.

Each run goes through the launcher as a user would (YAML config + command-line overrides), and
checks that the loss is finite and that the weights moved. The resume test restarts SFT from a
mid-run checkpoint and must land on the same weights as the uninterrupted run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.support.tiny_model import CONFIGS, launch, warm_start  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def build(fixtures_build) -> Path:
    for config in ("sft", "grpo", "preference"):
        assert list((fixtures_build / "data" / config).glob("*.parquet")), config
    return fixtures_build


SFT_OVERRIDES = ("--max_length", "512")


@pytest.fixture(scope="module")
def sft_run(tiny, build, tmp_path_factory) -> Path:
    """SFT through `trajforge train sft`, 5 steps with checkpoints at 3 and 5 (sft_tiny.yaml)."""
    out = tmp_path_factory.mktemp("sft")
    launch("sft", tiny, build, out, *SFT_OVERRIDES)
    return out


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def assert_trained(tiny: Path, out: Path) -> dict:
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["train_loss"])
    before, after = weights(tiny), weights(out)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, f"only {changed} changed"
    return results


def test_sft_trains_five_steps_with_eval_and_checkpoints(tiny, sft_run):
    results = assert_trained(tiny, sft_run)
    assert math.isfinite(results["eval_loss"])
    assert json.loads((sft_run / "trainer_state.json").read_text())["global_step"] == 5
    assert sorted(p.name for p in sft_run.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-5"]


def test_sft_resumes_from_a_checkpoint(tiny, build, sft_run, tmp_path):
    from transformers import TrainerCallback

    from trajforge.training.arguments import SFTTrainConfig, parse
    from trajforge.training.common import run
    from trajforge.training.sft import build_trainer

    class CountSteps(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    resumed = tmp_path / "resumed"
    data_args, training_args, model_args = parse(SFTTrainConfig, [
        "--config", str(CONFIGS / "sft_tiny.yaml"), "--model_name_or_path", str(tiny), "--dataset_name", str(build),
        "--output_dir", str(resumed), *SFT_OVERRIDES, "--resume_from_checkpoint", str(sft_run / "checkpoint-3")])
    counter = CountSteps()
    run(build_trainer(data_args, training_args, model_args, callbacks=[counter]), training_args)
    assert counter.steps == [4, 5]  # only the steps after the checkpoint ran
    # Same data order, optimizer and scheduler state: the uninterrupted run's weights.
    full, again = weights(sft_run), weights(resumed)
    assert all(torch.allclose(full[k], again[k], atol=1e-5) for k in full)


def test_sft_packs_rows_when_asked(tiny, build, tmp_path):
    out = tmp_path / "packed"
    launch("sft", tiny, build, out, *SFT_OVERRIDES, "--packing", "true", "--max_steps", "2",
           "--save_strategy", "no", "--eval_fraction", "0")
    assert_trained(tiny, out)


def test_grpo_trains_two_steps_with_the_reward_registry(tiny, build, tmp_path):
    policy = warm_start(tiny, build, tmp_path / "warm")
    out = tmp_path / "grpo"
    launch("grpo", policy, build, out, "--max_prompt_tokens", "1024")
    state = json.loads((out / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "reward" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["reward"]) for entry in logged)
    assert {"rewards/format_reward/mean", "rewards/tag_count_reward/mean", "rewards/accuracy_reward/mean"} <= \
        set(logged[0])
    # GRPO learns only where a group's rewards differ. Whether the tiny warm-started policy writes the
    # asked-for format in two steps depends on the fixture build's exact rows, so both cases are
    # checked for what GRPO must do: weights move when the rewards told completions apart, and not
    # otherwise. (Training that must happen is tested with scripted policies in
    # test_training_environments.py.)
    if any(entry["reward_std"] > 0 for entry in logged):
        assert_trained(policy, out)
    else:
        assert all(entry["grad_norm"] == 0 and entry["frac_reward_zero_std"] == 1 for entry in logged)
        assert weights(policy).keys() == weights(out).keys()
        assert all(torch.equal(weights(policy)[k], weights(out)[k]) for k in weights(policy))


def test_dpo_trains_two_steps_on_preference_pairs(tiny, build, tmp_path):
    out = tmp_path / "dpo"
    launch("dpo", tiny, build, out, "--max_length", "512")
    assert_trained(tiny, out)
