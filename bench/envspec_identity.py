"""Byte-identity of the environment-spec move: sha256 of every published file of the fixture build
(with every task file as RL tasks, so each env's `grpo_env` row is built) and of a synthesis run per
in-process env against the loopback OpenAI-compatible server (tests/support/openai_server.py).

Run it once on the commit before the move and once after, then compare:

    python bench/envspec_identity.py before.json      # with trajforge at the old commit
    python bench/envspec_identity.py after.json
    python bench/envspec_identity.py --compare before.json after.json

Files under state folders (`.staging`, `.synth`) are left out: caches and journals, not outputs.
The code version (a hash of the pipeline's code) and the build id made from it change with any code
change by design; they are masked in the card, and `manifest.json` is compared without the build id
and the card's hash (the card is compared itself).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.paths import FIXTURE_SOURCES, FIXTURES  # noqa: E402

TASKS = FIXTURES / "tasks"
DB_FILE = TASKS / "agentbench" / "db" / "dev.jsonl"
RL_TASKS = (str(DB_FILE), *map(str, sorted((TASKS / "agentbench" / "os").glob("*.json"))),
            *map(str, sorted((TASKS / "agentgym").glob("*.jsonl"))))


def digests(root: Path, masked: tuple[str, ...] = ()) -> dict[str, str]:
    def content(path: Path) -> bytes:
        if path == root / "manifest.json":
            manifest = json.loads(path.read_text())
            del manifest["build_id"], manifest["files"]["README.md"]
            return json.dumps(manifest, sort_keys=True).encode()
        data = path.read_bytes()
        for text in masked:
            data = data.replace(text.encode(), b"<masked>")
        return data

    return {str(p.relative_to(root)): hashlib.sha256(content(p)).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()
            and not any(part in (".staging", ".synth") for part in p.relative_to(root).parts)}


def fixture_build(out: Path) -> dict[str, str]:
    from trajforge.pipeline.build import BuildConfig, finalize, process_unit
    from trajforge.pipeline.publish.manifest import code_version
    from trajforge.sources import get_source

    config = BuildConfig(rl_tasks=RL_TASKS)
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    finalize(units, out, config)
    return digests(out, (code_version(), json.loads((out / "manifest.json").read_text())["build_id"]))


def synthesis(out: Path) -> dict[str, str]:
    import trajforge.pipeline.synth.job as synth_job
    from tests.support.local_agentgym import GoalPolicy
    from tests.support.openai_server import Server, fixture_policy

    try:
        from trajforge.pipeline.llm.client import LLMConfig
    except ImportError:  # the commit before the move: the client lived in synth/
        from trajforge.pipeline.synth.llm import LLMConfig

    runs = [("db", DB_FILE, fixture_policy(db_files=[DB_FILE])),
            ("babyai", TASKS / "agentgym" / "babyai.jsonl", GoalPolicy(stuck=True)),
            ("textcraft", TASKS / "agentgym" / "textcraft.jsonl", GoalPolicy(stuck=True))]
    for env, tasks, policy in runs:
        with Server(policy) as server:
            synth_job.synthesize(synth_job.SynthConfig(
                tasks=str(tasks), env=env, out=str(out), n=2, episode_concurrency=4,
                llm=LLMConfig(model="deepseek-ai/DeepSeek-R1", base_url=server.base_url, api_key="sk-test",
                              backoff_base_s=0.01)))
    return digests(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", help="where to write the digests (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        differ = {part: sorted(k for k in before[part].keys() | after[part].keys()
                               if before[part].get(k) != after[part].get(k)) for part in before}
        print(json.dumps({"files": {part: len(before[part]) for part in before}, "differ": differ}, indent=1))
        sys.exit(1 if any(differ.values()) else 0)
    with tempfile.TemporaryDirectory() as tmp:
        Path(args.out).write_text(json.dumps({"build": fixture_build(Path(tmp) / "build"),
                                              "synthesis": synthesis(Path(tmp) / "synth")}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
