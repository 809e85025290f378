"""Datasets derived from the trajectories: DPO preference pairs and GRPO prompts.

Preference pairs (schemas/preference.schema.json) are in TRL's conversational format: `prompt`,
`chosen` and `rejected` are lists of `{role, content}` messages. A pair comes from a negative and
its parent at the first turn where they differ: the turns before it are the shared prompt, the
parent's turn is chosen, the negative's rejected. When the negative changed the prompt itself
(`irrelevant_tools` swaps the offered tools) the parent has no turn for that context; the negative
then carries the right reply in its meta (`chosen`) and the pair uses the negative's context.

GRPO prompts (schemas/grpo.schema.json) are the conversation up to the first trained assistant
turn, with what a reward needs: the reference answer, the reference actions, env and domain.
Instructions, acknowledgement and upstream demonstrations stay in the prompt: they are the
context the agent acts in.
"""
from __future__ import annotations

import json


def _messages(turns: list[dict]) -> list[dict]:
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def _divergence(parent: list[dict], negative: list[dict]) -> int | None:
    for k, turn in enumerate(negative):
        if k >= len(parent) or (turn["role"], turn["content"]) != (parent[k]["role"], parent[k]["content"]):
            return k
    return None


def preference_pair(negative: dict, parent: dict) -> dict | None:
    """The DPO pair of a negative and its parent, or None when they never differ on a reply."""
    neg, par = negative["conversations"], parent["conversations"]
    chosen = json.loads(negative["meta"]).get("chosen")
    if chosen is not None:
        k = len(neg) - 1
        prompt, chosen_turn, rejected_turn = neg[:k], {"role": "assistant", "content": chosen}, neg[k]
    else:
        k = _divergence(par, neg)
        if k is None or k >= len(par) or neg[k]["role"] != "assistant" or par[k]["role"] != "assistant":
            return None
        prompt, chosen_turn, rejected_turn = par[:k], par[k], neg[k]
    if not prompt or rejected_turn["role"] != "assistant":
        return None
    return {"id": f"{negative['id']}#pair", "parent_id": parent["id"], "negative_id": negative["id"],
            "negative_type": negative["negative_type"], "source": parent["source"], "domain": parent["domain"],
            "env": parent["env"], "prompt": _messages(prompt), "chosen": _messages([chosen_turn]),
            "rejected": _messages([rejected_turn])}


def preference_pairs(negatives: list[dict], records: list[dict]) -> tuple[list[dict], int]:
    """Pairs for every negative whose parent is among `records`; also the number left without one."""
    by_id = {r["id"]: r for r in records}
    pairs, unpaired = [], 0
    for negative in negatives:
        parent = by_id.get(negative["parent_id"] or "")
        pair = preference_pair(negative, parent) if parent is not None else None
        if pair is None:
            unpaired += 1
        else:
            pairs.append(pair)
    return pairs, unpaired


def grpo_prompt(record: dict) -> dict | None:
    """The RL prompt of a positive trajectory, or None when it has no trained assistant turn."""
    turns = record["conversations"]
    first = next((i for i, t in enumerate(turns) if t["role"] == "assistant" and t["loss"]), None)
    if first is None or first == 0:
        return None
    actions = [t["action"] for t in turns[first:] if t["role"] == "assistant" and t["loss"] and t["action"]]
    return {"id": record["id"], "source": record["source"], "domain": record["domain"], "env": record["env"],
            "task": record["task"], "prompt": _messages(turns[:first]), "answer": record["answer"],
            "expected_actions": actions, "first_action": turns[first]["action"],
            "rendering": record["rendering"], "dialect": turns[first]["dialect"],
            "reward": record["reward"], "success": record["success"]}


def grpo_prompts(records: list[dict]) -> list[dict]:
    """GRPO rows from the positives (upstream-labelled negatives are not tasks to reward)."""
    return [row for r in records if r["kind"] == "positive" for row in [grpo_prompt(r)] if row is not None]
