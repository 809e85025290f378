"""Test oracles: second, plainer implementations of production steps that the tests hold the
production code to (same input, same output). None of this runs in a build; each section names the
production path it mirrors.

- `deduplicate`: all records in one list, exact then near with datasketch's MinHashLSH index; the
  build runs `pipeline.quality.dedup_table` (`deduplicate_in_memory` is that path on one list,
  `RecordsInMemory` its records).
- `preference_pairs`, `grpo_prompts`, `grpo_env_rows`: the derived sets of a list of records; the
  build makes them record by record (`pipeline.quality.derived`'s row makers), the GRPO prompts
  column-wise from a batch of records (`derived.grpo_prompts`; here one record at a time).
- `make_negatives`: the negatives of a list of records; the build makes them a staged batch at a time
  (`negatives.batch_negatives`: `negatives_of` of each record).
- `write_config`: the shards of in-memory tables, with a completion marker per shard; the build
  writes shards from staged files (`pipeline.publish.shards.plan_split`).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
from datasketch import LeanMinHash, MinHashLSH

from trajforge.pipeline.atomic import write_table
from trajforge.pipeline.build.resume import read_marker, write_marker
from trajforge.pipeline.envs.tasks import Task
from trajforge.pipeline.publish.manifest import file_sha256
from trajforge.pipeline.publish.shards import SHARD_RE, ShardConfig, plan_shards, shard_name
from trajforge.pipeline.quality.dedup import (
    SCHEME,
    DedupConfig,
    _folded,
    dedup_texts,
    exact_key,
    shingles,
    signatures,
)
from trajforge.pipeline.quality.dedup_table import (
    duplicates_table,
    near_matrices,
    parts_in_memory,
    record_keys,
    shingle_set_hashes,
)
from trajforge.pipeline.quality.derived import grpo_env_row, record_task, reference_answer
from trajforge.pipeline.quality.negatives import NegativesConfig, negatives_of
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.schemas import arrow_schema
from trajforge.sources import keep_rank as source_keep_rank

# --- dedup (pipeline/quality/dedup.py, dedup_table.py) -------------------------------------------


TOKEN = re.compile(r"\w+|[^\w\s]")


def fold(text: str) -> list[str]:
    """Tokens of a text with everything that differs between mirrors folded away, by Python's `re`."""
    return TOKEN.findall(_folded(text))


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def near_duplicates(sets: Sequence[set[str]], groups: Sequence[str], config: DedupConfig,
                    sigs: np.ndarray | None = None) -> list[tuple[int, float] | None]:
    """For each set (in preference order): None if kept, else (index of the kept set, Jaccard).

    `groups` partitions the sets; only sets of the same group are compared. `sigs` are the
    signatures when the caller already has them.
    """
    params = (config.bands, config.rows) if config.bands is not None else None
    lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm, params=params)
    sigs = signatures(sets, config) if sigs is None else sigs
    result: list[tuple[int, float] | None] = []
    for i, s in enumerate(sets):
        m = LeanMinHash(seed=config.seed, hashvalues=sigs[i], scheme=SCHEME)
        best: tuple[int, float] | None = None
        for j in sorted(lsh.query(m)):
            if groups[j] != groups[i]:
                continue
            sim = jaccard(s, sets[j])
            if sim >= config.threshold and (best is None or sim > best[1]):
                best = (j, sim)
        if best is None:
            lsh.insert(i, m, check_duplication=False)
        result.append(best)
    return result


def band_pairs(groups: Sequence[int], bands: np.ndarray) -> list[list[tuple[int, int]]]:
    """Per band, the pairs (a, b), a < b, of rows of the same group whose key in that band is the
    same (the band's candidate pairs), by comparing every pair."""
    a, b = np.triu_indices(len(groups), 1)
    same_group = np.asarray(groups)[a] == np.asarray(groups)[b]
    return [list(zip(a[mask].tolist(), b[mask].tolist()))
            for mask in (same_group & (bands[a, band] == bands[b, band]) for band in range(bands.shape[1]))]


def sketch_similarity(sketch: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard of sketch rows a[i] and b[i]: the bins both fill with the same value among
    the bins either fills (dedup_table.py's one-permutation sketch), row by row in numpy."""
    left, right = sketch[a], sketch[b]
    both_empty = ((left == 0) & (right == 0)).sum(axis=1)
    return ((left == right).sum(axis=1) - both_empty) / np.maximum(1, sketch.shape[1] - both_empty)


def dedup_group(record: dict) -> str:
    """Only records of the same group are compared: the same kind and negative type."""
    return f"{record['kind']}:{record['negative_type'] or ''}"


def staged_keys(records: list[dict], start_order: int = 0, config: DedupConfig = DedupConfig()) -> pl.DataFrame:
    """`record_keys` of records staged as a build unit stages them (one Arrow table of the trajectory schema)."""
    return record_keys(records, pa.Table.from_pylist(records, schema=arrow_schema("trajectory")), start_order, config)


def key_columns_of_dicts(records: list[dict], config: DedupConfig = DedupConfig()) -> pl.DataFrame:
    """The key table's group, exact key, keep-preference and id columns made from the records'
    dicts: what `record_keys` makes of their staged columns."""
    texts = dedup_texts(records)
    return pl.DataFrame({
        "group": [dedup_group(r) for r in records],
        "exact": [exact_key(dedup_group(r), text) for r, text in zip(records, texts)],
        "not_upstream": [r["loss_flags"] != "upstream" for r in records],
        "source_rank": pl.Series([int(source_keep_rank(r["source"])) for r in records], dtype=pl.Int8),
        "unknown": pl.Series([-sum(r[k] is not None for k in ("answer", "reward", "success")) for r in records],
                             dtype=pl.Int8),
        **{name: [r[name] for r in records] for name in ("id", "source", "source_id", "source_file")},
    }, schema_overrides={name: pl.String for name in ("group", "exact", "id", "source", "source_id", "source_file")})


def keep_rank(record: dict, order: int) -> tuple:
    """Sort key of the keep preference (smaller is kept); see dedup.py's module docstring."""
    known = sum(record[k] is not None for k in ("answer", "reward", "success"))
    return (record["loss_flags"] != "upstream", source_keep_rank(record["source"]), -known, order)


def _dup_row(record: dict, kept: dict, match: str, similarity: float) -> dict:
    return {"id": record["id"], "source": record["source"], "source_id": record["source_id"],
            "source_file": record["source_file"], "kept_id": kept["id"], "kept_source": kept["source"],
            "match": match, "similarity": round(similarity, 4)}


def deduplicate(records: list[dict], config: DedupConfig = DedupConfig()) -> tuple[list[dict], list[dict]]:
    """Split records into (kept, duplicates); kept records stay in build order.

    Every dropped record gets one row in the duplicates map (schemas/duplicates.schema.json).
    """
    order = sorted(range(len(records)), key=lambda i: keep_rank(records[i], i))
    kept_by_key: dict[str, int] = {}
    dropped: dict[int, dict] = {}
    unique: list[int] = []
    texts = dedup_texts(records)
    for i in order:
        key = exact_key(dedup_group(records[i]), texts[i])
        if key in kept_by_key:
            dropped[i] = _dup_row(records[i], records[kept_by_key[key]], "exact", 1.0)
        else:
            kept_by_key[key] = i
            unique.append(i)
    if config.near and len(unique) > 1:
        sets = [shingles(texts[i].words.split(), config.shingle_size) for i in unique]
        groups = [dedup_group(records[i]) for i in unique]
        for pos, hit in enumerate(near_duplicates(sets, groups, config)):
            if hit is not None:
                i, (j, sim) = unique[pos], hit
                dropped[i] = _dup_row(records[i], records[unique[j]], "near", sim)
    kept = [r for i, r in enumerate(records) if i not in dropped]
    duplicates = [dropped[i] for i in sorted(dropped)]
    return kept, duplicates


@dataclass
class RecordsInMemory:
    """Records in a list, with their key table: the `records` of `duplicates_table` for one unit."""
    records: list[dict]
    keys: pl.DataFrame
    config: DedupConfig

    def near_parts(self, table: pl.DataFrame):
        return parts_in_memory([(np.arange(table.height), *near_matrices(self.keys[table["row"].to_numpy()], self.config))])

    def key_columns(self, table: pl.DataFrame, columns: list[str]) -> pl.DataFrame:
        return self.keys[table["row"].to_numpy()].select(columns)

    def shingle_sets(self, refs: list[tuple[int, int]], size: int) -> list[np.ndarray]:
        return shingle_set_hashes([self.records[row] for _, row in refs], size)


def deduplicate_in_memory(records: list[dict], config: DedupConfig = DedupConfig(),
                          batch: int = 4096) -> tuple[list[dict], list[dict]]:
    """`deduplicate` through the build's key table: (kept records in build order, duplicates map)."""
    keys = pl.concat([staged_keys(records[i:i + batch], i, config) for i in range(0, max(1, len(records)), batch)])
    keys = keys.with_columns(pl.lit(0, dtype=pl.Int32).alias("unit"), pl.col("order").alias("row"))
    rows = duplicates_table(keys, RecordsInMemory(records, keys, config), config)
    dropped = set(rows["order"].to_list())
    kept = [r for i, r in enumerate(records) if i not in dropped]
    return kept, rows.drop("order", "kept_order").to_dicts()


# --- derived sets (pipeline/quality/derived.py) ---------------------------------------------------


def _divergence(parent: list[dict], negative: list[dict]) -> int | None:
    for k, turn in enumerate(negative):
        if k >= len(parent):
            return k
        if turn["role"] != parent[k]["role"] or turn["content"] != parent[k]["content"]:
            return k
    return None


def _messages(turns: list[dict]) -> list[dict]:
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def preference_pair(negative: dict, parent: dict) -> dict | None:
    """The DPO pair of a negative and its parent, row by row (the build makes them column-wise,
    `derived.preference_table`), or None when they never differ on a reply."""
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
            "task": record["task"], "prompt": [{"role": t["role"], "content": t["content"]} for t in turns[:first]],
            "answer": record["answer"], "expected_actions": actions, "first_action": turns[first]["action"],
            "rendering": record["rendering"], "dialect": turns[first]["dialect"],
            "reward": record["reward"], "success": record["success"]}


def grpo_prompts(records: list[dict]) -> list[dict]:
    """GRPO rows from the positives (upstream-labelled negatives are not tasks to reward)."""
    return [row for r in records if r["kind"] == "positive" for row in [grpo_prompt(r)] if row is not None]


def grpo_env_rows(tasks: list[Task], records: list[dict]) -> tuple[list[dict], int]:
    """RL tasks from task files and from the positives whose task an environment can reset to;
    also the number of task-file tasks left out because they cannot run here (`skip_reason`).
    One row per task: a trajectory of a task-file task (synthetic, `meta.task_id`) only lends its
    final answer where the file knows none; repeated AgentGym items keep their first trajectory."""
    positives = [r for r in records if r["kind"] == "positive"]
    answers: dict[str, str] = {}
    for r in positives:
        task_id = json.loads(r["meta"]).get("task_id") if r["source"] == "synthetic" else None
        if task_id is not None and r["answer"] is not None:
            answers.setdefault(task_id, r["answer"])
    runnable = [t for t in tasks if not t.skip_reason]
    rows = {t.id: grpo_env_row(t, "tasks", answer=reference_answer(t) or answers.get(t.id)) for t in runnable}
    for r in positives:
        task = record_task(r)
        if task is not None and task.id not in rows:
            rows[task.id] = grpo_env_row(task, r["source"], row_id=task.id, env=r["env"], answer=r["answer"])
    return list(rows.values()), len(tasks) - len(runnable)


# --- negatives (pipeline/quality/negatives.py) ----------------------------------------------------


def make_negatives(records: list[dict], config: NegativesConfig = NegativesConfig(),
                   pools: EnvPools | None = None) -> list[dict]:
    """Negatives from the valid positives among `records`, in record order then type order.

    `pools` (pools.py) default to the pools of `records` themselves."""
    pools = EnvPools.of(records) if pools is None else pools
    return [negative for record in records for negative in negatives_of(record, pools, config)]


# --- shards (pipeline/publish/shards.py) ----------------------------------------------------------


def _table_fingerprint(table: pa.Table, config: ShardConfig) -> str:
    digest = hashlib.sha256(json.dumps([asdict(config), pa.__version__]).encode())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    digest.update(sink.getvalue())
    return digest.hexdigest()


def write_config(out: Path, config_name: str, splits: dict[str, pa.Table],
                 config: ShardConfig = ShardConfig()) -> dict[str, list[str]]:
    """Write every split of one config as shards; returns split -> shard paths relative to `out`.

    A shard whose marker matches its content fingerprint and whose file is intact is not
    rewritten (resume after a crash). An empty split is one shard without rows, so the config
    still loads. Shards of an earlier build that this one does not produce (another shard count,
    a split that is gone) are removed, so the folder holds one build.
    """
    folder = out / "data" / config_name
    written: dict[str, list[str]] = {}
    keep: set[str] = set()
    for split, table in splits.items():
        plan = plan_shards(table.num_rows, table.nbytes, config) or [(0, 0)]
        for index, (offset, length) in enumerate(plan):
            name = shard_name(split, index, len(plan))
            path = folder / name
            shard = table.slice(offset, length)
            fingerprint = _table_fingerprint(shard, config)
            marker = out / ".staging" / "markers" / "shards" / config_name / f"{name}.done"
            done = read_marker(marker, fingerprint)
            if not (done and path.exists() and path.stat().st_size == done["size"]
                    and file_sha256(path) == done["sha256"]):
                write_table(shard, path, compression_level=config.compression_level,
                            row_group_size=config.row_group_rows)
                write_marker(marker, fingerprint, {"size": path.stat().st_size, "sha256": file_sha256(path)})
            keep.add(name)
            written.setdefault(split, []).append(path.relative_to(out).as_posix())
    if folder.exists():
        for stale in folder.iterdir():
            if SHARD_RE.match(stale.name) and stale.name not in keep:
                stale.unlink()
    return written
