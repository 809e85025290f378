"""How faithful are the in-process AgentGym envs? Replay the real AgentTraj-L rows of each env.

For every row of `tests/fixtures/raw/agenttraj_l/<env>_train.json`, the local env is reset on the
row's task (BabyAI and SciWorld: the item index, mapped as AgentGym's server maps it; TextCraft:
the crafting commands and goal the row's first turn states) and every assistant turn of the row
is sent to it as AgentGym's client would send it. Each observation the env answers is compared
with the one upstream recorded: exactly, and after whitespace normalisation (runs of whitespace
to one space, ends stripped). TextCraft's recorded observations carry a `Instruction:\\n` prefix
that the collector added (the server does not say it); it is taken off before comparing, and the
table says how many match with it left on.

    python bench/env_fidelity.py [--env babyai --env textcraft --env sciworld] [--json OUT]

Every step is compared, the env going on from its own state; the first observations are counted
apart, since a task that was not rebuilt makes every later match a coincidence.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.local_agentgym import agenttraj_rows, episode  # noqa: E402
from trajforge.pipeline.ingest.dialects import parse_turn  # noqa: E402
from trajforge.pipeline.synth.envs import make_env  # noqa: E402

ENVS = ("babyai", "textcraft", "sciworld")


def _space(text: str) -> str:
    return " ".join(text.split())


def replay(env_name: str, row: dict) -> list[tuple[str, str, str]]:
    """[(kind, local observation, upstream observation)] of one row; kind is `first` or `step`."""
    first, steps = episode(row)
    pairs = []
    with make_env(env_name) as env:
        task = {"id": row["item_id"], "env": env_name, "description": first, "data": {"item_id": row["item_id"]}}
        pairs.append(("first", env.reset(task), first))
        for reply, upstream in steps:
            if upstream is None:
                break
            # BabyAI's and SciWorld's clients send the text after `Action:`; TextCraft's cleans the whole
            # reply when it has no `Action:` (an upstream row shows it), so its env gets the reply.
            action = reply if env_name == "textcraft" else (parse_turn(reply).action or reply)
            result = env.step(action)
            pairs.append(("step", result.observation, upstream))
            if result.done:
                break
    return pairs


def measure(env_name: str) -> dict:
    rows = agenttraj_rows(env_name)
    started = time.perf_counter()
    counts = {"rows": len(rows), "first": 0, "first_exact": 0, "first_space": 0,
              "step": 0, "step_exact": 0, "step_space": 0}
    raw_framed = 0
    for row in rows:
        framed = [t["value"] for t in row["conversations"][2:]][0::2]
        for n, (kind, local, upstream) in enumerate(replay(env_name, row)):
            counts[kind] += 1
            counts[f"{kind}_exact"] += local == upstream
            counts[f"{kind}_space"] += _space(local) == _space(upstream)
            raw_framed += n < len(framed) and local == framed[n]
    counts["exact_with_collector_framing"] = raw_framed
    counts["seconds"] = round(time.perf_counter() - started, 1)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", action="append", choices=ENVS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results = {name: measure(name) for name in args.env or ENVS}
    print("env        rows  first obs exact/ws  steps exact/ws  (exact incl. 'Instruction:' framing)  s")
    for name, c in results.items():
        print(f"{name:10} {c['rows']:4}  {c['first_exact']:>3}/{c['first_space']:<3} of {c['first']:<3}  "
              f"{c['step_exact']:>3}/{c['step_space']:<3} of {c['step']:<3}  "
              f"{c['exact_with_collector_framing']:>3}  {c['seconds']:>6}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
