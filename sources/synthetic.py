"""Our own synthesis output (`trajforge synth --out DIR`) as a build source.

Location: a synth output folder (it reads `data/synthetic/*.parquet`), that folder's
`data/synthetic`, or one of its Parquet files. The files hold finished schema records; the build
re-derives records from upstream-shaped rows, so the source hands it each record's id and its
`{role, content, loss}` turns (a small JSON Lines view written next to the input, under
`DIR/.synth/build_view/`), and the env from the file name (`<env>.parquet`).

What the view does not carry through the build: the per-turn `reasoning` and the synthesis
`meta` (model, sampling, reward). The synth output itself keeps both; use it directly when
training on reasoning.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from sources.base import Source, SourceError, SourceFile

# Env name -> record domain, for synthetic records (pipeline/agent.py uses it too).
DOMAINS = {"os": "os", "db": "db", "webshop": "ecommerce", "alfworld": "household", "sciworld": "science",
           "babyai": "game", "textcraft": "game", "maze": "game", "wordle": "game", "webarena": "web",
           "sqlgym": "db", "movie": "tool", "todo": "tool", "weather": "tool", "academia": "tool", "sheet": "tool"}


def synthetic_files(location: Path) -> list[Path]:
    if location.is_file():
        return [location]
    for folder in (location / "data" / "synthetic", location):
        files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        if files:
            return files
    return []


class Synthetic(Source):
    name = "synthetic"
    hub_repo = ""
    license = "other"

    def files(self, location: str | None) -> list[SourceFile]:
        if not location:
            raise SourceError("source synthetic: give the output folder of `trajforge synth` (synthetic=DIR)")
        root = Path(location)
        if not root.exists():
            raise SourceError(f"source synthetic: path {location} does not exist")
        parquet = synthetic_files(root)
        if not parquet:
            raise SourceError(f"source synthetic: no data/synthetic/*.parquet under {location}")
        return [SourceFile(self._view(path), path.stem) for path in parquet]

    def _view(self, path: Path) -> Path:
        """Write (once per input version) the upstream-shaped rows the build normalizes."""
        in_synth_out = path.parent.name == "synthetic" and path.parent.parent.name == "data"
        base = path.parents[2] if in_synth_out else path.parent
        view = base / ".synth" / "build_view" / f"{path.stem}.jsonl"
        if view.exists() and view.stat().st_mtime >= path.stat().st_mtime:
            return view
        view.parent.mkdir(parents=True, exist_ok=True)
        tmp = view.with_name(f".{view.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for record in pq.read_table(path, columns=["source_id", "conversations"]).to_pylist():
                turns = [{"role": t["role"], "content": t["content"], "loss": t["loss"]} for t in record["conversations"]]
                fh.write(json.dumps({"id": record["source_id"], "conversations": turns}, ensure_ascii=False) + "\n")
        tmp.replace(view)
        return view

    def split_of(self, path: Path) -> str:
        return path.stem

    def domain_env(self, split: str, source_id: str, prompt: str = "") -> tuple[str, str] | None:
        domain = DOMAINS.get(split)
        return None if domain is None else (domain, split)
