"""Sanity bench: does an outcome reward model trained on the fixtures' preference pairs rank held-out
chosen replies above rejected ones more often than chance?

The fixtures build (the real upstream records of tests/fixtures) is made in-process, a tiny random
Qwen2 with a tokenizer trained on it is the base (no download), and `trajforge train rm` trains it on
the `preference` pairs with a share of the parent trajectories held out (no parent's pairs on both
sides). The figure is the held-out pairwise accuracy with its 95% Wilson interval and the one-sided
binomial p-value against 0.5, per negative type too, for a few seeds (each another held-out slice). CPU only, a few minutes on 2 cores.

    python bench/bench_rm.py [--epochs 3] [--eval-fraction 0.3] [--max-length 2048] [--seeds 0 1 2]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def fixtures_build(out: Path) -> Path:
    from tests.support.paths import FIXTURE_SOURCES
    from trajforge.pipeline.build import BuildConfig, finalize, process_unit
    from trajforge.sources import get_source

    config = BuildConfig()
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    finalize(units, out, config)
    return out


def binomial_p_at_least(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): the chance of ranking this well by coin flips."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def run(seed: int, build: Path, tiny: Path, work: Path, args) -> dict:
    from trajforge.training.arguments import RewardTrainConfig, parse
    from trajforge.training.dpo import fit_pairs
    from trajforge.training.reward_model import RewardModel, load_pairs, wilson_interval
    from trajforge.training.reward_model import main as train_rm

    out = work / f"rm-{seed}"
    argv = ["--config", str(REPO / "training/configs/rm_tiny.yaml"), "--model_name_or_path", str(tiny),
            "--dataset_name", str(build), "--output_dir", str(out), "--seed", str(seed),
            "--eval_fraction", str(args.eval_fraction), "--max_length", str(args.max_length),
            "--max_steps", "-1", "--num_train_epochs", str(args.epochs), "--learning_rate", str(args.learning_rate)]
    started = time.perf_counter()
    train_rm(argv)
    seconds = time.perf_counter() - started
    # Per negative type: the held-out pairs again, with their type.
    data_args, training_args, _ = parse(RewardTrainConfig, argv)
    _, held_out = load_pairs(data_args, training_args)
    rm = RewardModel.load(str(out))
    from trajforge.training.data import load_release

    types = {r["id"]: r["negative_type"] for r in load_release(str(build), "preference")["train"]}
    fitting = fit_pairs(held_out, rm.tokenizer, args.max_length)
    chosen = rm.score([p + c for p, c in zip(fitting["prompt"], fitting["chosen"])])
    rejected = rm.score([p + r for p, r in zip(fitting["prompt"], fitting["rejected"])])
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for pair_id, c, r in zip(fitting["id"], chosen, rejected):
        by_type[types[pair_id]][0] += c > r
        by_type[types[pair_id]][1] += 1
    right, n = sum(c > r for c, r in zip(chosen, rejected)), len(chosen)
    low, high = wilson_interval(right, n)
    return {"seed": seed, "held_out_pairs": n, "ranked_right": right, "accuracy": round(right / n, 4),
            "ci95": [round(low, 4), round(high, 4)], "p_vs_chance": binomial_p_at_least(right, n),
            "train_seconds": round(seconds, 1),
            "by_negative_type": {t: f"{k}/{m}" for t, (k, m) in sorted(by_type.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--eval-fraction", type=float, default=0.3)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="each seed is another held-out slice and another initialisation")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build = fixtures_build(work / "build")
        tiny = build_tiny_model(work / "tiny", build)
        runs = [run(seed, build, tiny, work, args) for seed in args.seeds]
    # The seeds' held-out slices overlap (one small dataset): each run's interval stands on its own,
    # the mean says how much the figure moves with the slice and the initialisation.
    summary = {"runs": runs, "mean_accuracy": round(sum(r["accuracy"] for r in runs) / len(runs), 4),
               "settings": vars(args)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
