"""Our own synthesis output (`trajforge synth --out DIR`) as a build source.

Location: a synth output folder (it reads `data/synthetic/*.parquet`), that folder's
`data/synthetic`, or one of its Parquet files. The files hold finished schema records, which the
build passes through unchanged (per-turn `reasoning`, generator and sampling in `meta`) and
validates like any other record. A tree search's step data next to them
(`search/step_pairs/<env>.parquet`, `search/step_values/<env>.parquet`; `search_file`) becomes the
build's `step_pairs` and `step_values` configs (pipeline/quality/search_steps.py).
"""
from __future__ import annotations

from pathlib import Path

from trajforge.sources.base import KeepRank, Source, SourceError, SourceFile, file_stem, relative_name

# Env name -> record domain of synthetic records; the agent asks `Synthetic.domain_of`.
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


def search_file(records: Path, output: str) -> Path | None:
    """The tree search's `output` (step_pairs, step_values) of the env whose records are `records`
    (DIR/data/synthetic/<env>.parquet -> DIR/search/<output>/<env>.parquet), None when there is none."""
    if records.parent.name != "synthetic" or records.parent.parent.name != "data":
        return None
    path = records.parents[2] / "search" / output / records.name
    return path if path.is_file() else None


class Synthetic(Source):
    name = "synthetic"
    hub_repo = ""
    license = "other"
    keep_rank = KeepRank.SYNTHETIC

    def files(self, location: str | None) -> list[SourceFile]:
        if not location:
            raise SourceError("source synthetic: give the output folder of `trajforge synth` (synthetic=DIR)")
        root = self.local_root(location)
        parquet = synthetic_files(root)
        if not parquet:
            raise SourceError(f"source synthetic: no data/synthetic/*.parquet under {location}")
        return [SourceFile(path, self.split_of(path), relative_name(path, root)) for path in parquet]

    def split_of(self, path: Path) -> str:
        return file_stem(path)

    def domain_env(self, split: str, source_id: str, prompt: str = "") -> tuple[str, str] | None:
        domain = DOMAINS.get(split)
        return None if domain is None else (domain, split)

    def domain_of(self, env: str) -> str:
        """The domain a synthesized episode in `env` is filed under (tool use where the table is silent)."""
        return DOMAINS.get(env, "tool")
