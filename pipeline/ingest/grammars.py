"""The action grammar and the episode-end rule of every environment, registered by env name.

Each env's grammar lives in its spec (pipeline/envs/<env>.py), built with the toolkit of
pipeline/envs/grammar.py, which says what a grammar is: `check` (the first rule an action breaks),
`terminal` (whether an action ends the episode), `breaks` (edits that break one named rule each,
for the `invalid_action` negatives) and `replies` (how the env answers: refusals, no-ops, progress),
which grounds validation (pipeline/ingest/validate.py).

Where the rules come from (each grammar's `source`): the environments' own code and prompts.
AgentBench's task prompts (OS, DBBench, KG, WebShop, ALFWorld as AgentInstruct carries them), the
AgentGym environment servers (BabyAI's action space, TextCraft's action regexes, the tool envs'
`Name: f(params)` lists, SciWorld's action list in its prompt), Mind2Web's operation set, and the
ToolBench / Agent-FLAN function lists each prompt offers. WebArena has no grammar: no trajectory
of it is ingested and its action set (playwright-style `click [id]`, `type [id] [text]`, ...) was
not checked against a prompt of ours; its records are counted as unchecked.
"""
from __future__ import annotations

from trajforge.pipeline.envs import specs
from trajforge.pipeline.envs.grammar import Grammar
from trajforge.pipeline.registry import Registry

GRAMMARS: Registry[Grammar] = Registry("grammar", {name: s.grammar for name, s in specs().items() if s.grammar})


def grammar_for(env: str) -> Grammar | None:
    return GRAMMARS.get(env)
