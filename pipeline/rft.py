"""Rejection-sampling fine-tuning (RFT) for agents: the parts of one round that are not other stages.

A round is build -> SFT -> serve the checkpoint -> synthesize on held-out tasks -> keep the
successes -> (next round) build again with them; `flows/rft.py` wires it from the real build flow,
the SFT launcher and the synthesis job. What lives here:

* `serving`: start an OpenAI-compatible server for a checkpoint as a subprocess (`transformers
  serve` on CPU by default, `vllm serve` on a GPU), wait until it lists its models, stop it (and
  only it) afterwards.
* `keep_successes`: the round's successful trajectories into one growing `synthetic` source folder,
  with the round in their id so that rounds never collide.
* `round_summary`: the round's line of the report (success rate on the held-out tasks, records
  kept, calls, train loss).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_parquet
from trajforge.pipeline.registry import Registry
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.rft")

# `{model}` is the checkpoint folder, `{port}` a free loopback port.
SERVE_COMMANDS: Registry[list[str]] = Registry("serve command", {
    "transformers": ["transformers", "serve", "--host", "127.0.0.1", "--port", "{port}", "--device", "cpu", "{model}"],
    "vllm": ["vllm", "serve", "{model}", "--host", "127.0.0.1", "--port", "{port}"],
})


def serve_command(serve: str | list[str]) -> list[str]:
    """The argv (with placeholders) of a server: `serve` is an argv, a command line, or a name of
    SERVE_COMMANDS. A command says where to listen (`{port}`): a string without it is a name."""
    if not isinstance(serve, str):
        return list(serve)
    return shlex.split(serve) if "{port}" in serve else list(SERVE_COMMANDS[serve])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str | Path, command: list[str], startup_timeout_s: float = 600.0,
            log_path: Path | None = None) -> Iterator[str]:
    """The base URL (`http://127.0.0.1:PORT/v1`) of a server for `model`, up for the `with` block.

    The server runs in a session of its own, so that stopping it stops the workers it started and
    nothing else. A server that exits or does not answer `GET /v1/models` in time raises
    RuntimeError with the tail of its log.
    """
    port = free_port()
    argv = [part.format(model=model, port=port) for part in command]
    log_path = log_path or Path(model) / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {process.returncode} before serving: "
                                   f"{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not serve within {startup_timeout_s}s: {_tail(log_path)}")
            time.sleep(0.5)
        log.info("serving %s at %s (pid %d)", model, base_url, process.pid)
        yield base_url
    finally:
        _stop(process)


def _stop(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def keep_successes(synth_out: Path, env: str, kept: Path, round_no: int) -> int:
    """Append the round's records to `kept/data/synthetic/<env>.parquet` (a `synthetic` source folder).

    Ids get the round (`synthetic/r2-<task>~<sample>`): the same task solved in two rounds is two
    trajectories, and the build's near-duplicate stage decides whether both stay.
    """
    produced = synth_out / "data" / "synthetic" / f"{env}.parquet"
    records = pq.read_table(produced).to_pylist() if produced.exists() else []
    for record in records:
        source, _, rest = record["id"].partition("/")
        record["id"] = f"{source}/r{round_no}-{rest}"
        record["source_id"] = f"r{round_no}-{record['source_id']}"
    target = kept / "data" / "synthetic" / f"{env}.parquet"
    earlier = pq.read_table(target).to_pylist() if target.exists() else []
    earlier = [r for r in earlier if not r["id"].split("/", 1)[1].startswith(f"r{round_no}-")]  # a rerun of this round
    if records or earlier:
        write_parquet(earlier + records, arrow_schema("trajectory"), target)
    return len(records)


def round_summary(round_no: int, build: dict, train: dict, synth: dict, kept: int, held_out: dict | None = None) -> dict:
    """One round of the report. success_rate (= train_success): the round's tasks with at least one
    success / tasks; held_out: the round's `trajforge eval` report on a split it does not train on
    (heldout_success: its success rate, with the 95% Wilson interval)."""
    figures = next(iter(held_out["envs"].values())).get("model") if held_out and held_out["envs"] else None
    return {
        "round": round_no,
        "build_records": build["total"]["written"],
        "build_synthetic_records": build["sources"].get("synthetic", {}).get("written", 0),
        "train_loss": train.get("train_loss"),
        "tasks": synth["tasks"], "episodes": synth["episodes"], "failures": synth["failures"],
        "failure_reasons": synth["failure_reasons"],
        "tasks_solved": synth["tasks_with_record"],
        "success_rate": round(synth["tasks_with_record"] / synth["tasks"], 4) if synth["tasks"] else None,
        "records_kept": kept,
        "llm_calls": synth["llm"]["calls"], "cache_hits": synth["llm"]["cache_hits"],
        "train_success": round(synth["tasks_with_record"] / synth["tasks"], 4) if synth["tasks"] else None,
        "heldout_success": figures and figures["success_rate"], "heldout_ci95": figures and figures["success_ci95"],
        "heldout_episodes": figures and figures["episodes"], "data_added": kept,
    }
