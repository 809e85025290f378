"""Near-duplicate detection: the build's columnar near dedup against datasketch's MinHash + MinHashLSH, in one run.

Usage: python bench/bench_dedup.py [--docs 100000] [--fixtures tests/fixtures/raw]

The corpus is scaled from the real fixture rows: every trajectory is a window of 60-120 words of
a real row's dedup text (task + trajectory, as `pipeline.dedup` folds it) with 30 % of its words
replaced, so the originals are distinct from one another; a quarter of them get a near copy with
0.5-3 % of the words changed. Planted pairs whose true shingle Jaccard reaches the threshold are
the positives.

Three contenders, on the same shingle sets (shingling is shared and timed apart):
- `datasketch`: datasketch's MinHash signatures and its MinHashLSH index (`near_duplicates` in tests/support/oracles.py,
  candidates confirmed by the true Jaccard);
- `numpy`: the same index with our vectorized signatures;
- `table`: what `trajforge build` runs (`pipeline.quality.dedup_table`): vectorized signatures, band
  keys and one-permutation sketches, candidate pairs per band screened by the sketches, the survivors
  confirmed by the true Jaccard, the same keep choice.
Reported: signature throughput and end-to-end throughput of each, the ratios to datasketch, the recall
of the planted pairs, other merges, merges below the threshold, and how often each decides as datasketch.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.oracles import jaccard, near_duplicates  # noqa: E402
from trajforge.pipeline.atomic import read_batches  # noqa: E402
from trajforge.pipeline.build import BuildConfig, process_unit  # noqa: E402
from trajforge.pipeline.quality.dedup import (  # noqa: E402
    DedupConfig,
    dedup_texts,
    shingle_hashes,
    shingles,
    signatures,
)
from trajforge.pipeline.quality.dedup_table import (  # noqa: E402
    band_keys,
    band_params,
    parts_in_memory,
    resolve,
    screened_pairs,
    sketches,
    write_near_table,
)
from trajforge.sources import get_source  # noqa: E402

SOURCES = ("agentinstruct", "agenttraj_l", "openmanus_rl")


def real_texts(raw: Path, staging: Path) -> list[list[str]]:
    words = []
    for name in SOURCES:
        for f in get_source(name).files(str(raw / name)):
            unit = process_unit(name, f, staging, BuildConfig())
            for batch in read_batches(unit.records_path, ["task", "conversations"]):
                words += [text.words.split() for text in dedup_texts(batch.to_pylist())]
    return [w for w in words if len(w) >= 60]


def corpus(real: list[list[str]], n_docs: int, seed: int = 0) -> tuple[list[list[str]], list[tuple[int, int]]]:
    rng = np.random.default_rng(seed)
    vocab = np.array(sorted({w for doc in real for w in doc}))
    n_orig = int(n_docs / 1.25)
    docs: list[list[str]] = []
    for k in range(n_orig):
        base = real[k % len(real)]
        size = int(rng.integers(60, 121))
        start = int(rng.integers(0, max(1, len(base) - size)))
        doc = np.array(base[start:start + size], dtype=object)
        swap = rng.random(len(doc)) < 0.30
        doc[swap] = vocab[rng.integers(0, len(vocab), swap.sum())]
        docs.append(list(doc))
    pairs = []
    for k in range(n_docs - n_orig):
        orig = docs[k]
        copy = np.array(orig, dtype=object)
        swap = rng.random(len(copy)) < rng.uniform(0.005, 0.03)
        copy[swap] = vocab[rng.integers(0, len(vocab), swap.sum())]
        pairs.append((k, len(docs)))
        docs.append(list(copy))
    return docs, pairs


def run(backend: str, sets, groups, config: DedupConfig) -> dict:
    cfg = DedupConfig(**{**config.__dict__, "backend": backend})
    t0 = time.perf_counter()
    sigs = signatures(sets, cfg)
    t1 = time.perf_counter()
    hits = near_duplicates(sets, groups, cfg, sigs=sigs)
    t2 = time.perf_counter()
    return {"backend": backend, "signature_s": t1 - t0, "total_s": t2 - t0, "hits": hits}


def run_table(sets, groups, config: DedupConfig) -> dict:
    """The build's near stage (dedup_table) on sets already in keep-preference order."""
    import tempfile

    import polars as pl

    bands, rows = band_params(config)
    t0 = time.perf_counter()
    hashes = shingle_hashes(sets, config.seed)
    keys, sketch = band_keys(signatures(sets, config, hashes), bands, rows), sketches(*hashes)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        table = write_near_table(Path(folder), pl.DataFrame({"group": groups}),
                                 parts_in_memory([(np.arange(len(sets)), keys, sketch)]), config)
        pairs = screened_pairs(table, config)
    found = resolve(((a, b, jaccard(sets[a], sets[b])) for a, b in pairs.tolist()), config.threshold)
    t2 = time.perf_counter()
    return {"backend": "table", "signature_s": t1 - t0, "total_s": t2 - t0,
            "hits": [found.get(i) for i in range(len(sets))], "screened": len(pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--fixtures", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "raw")
    p.add_argument("--threshold", type=float, default=DedupConfig.threshold)
    args = p.parse_args()

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        real = real_texts(args.fixtures, Path(tmp))
    docs, pairs = corpus(real, args.docs)
    config = DedupConfig(threshold=args.threshold)
    t0 = time.perf_counter()
    sets = [shingles(d, config.shingle_size) for d in docs]
    shingle_s = time.perf_counter() - t0
    groups = ["positive"] * len(sets)
    positives = {(a, b) for a, b in pairs if jaccard(sets[a], sets[b]) >= config.threshold}
    n_shingles = sum(len(s) for s in sets)
    print(f"corpus: {len(docs)} trajectories from {len(real)} real rows, {n_shingles} shingles "
          f"({n_shingles / len(docs):.0f} per trajectory); planted near pairs {len(pairs)}, "
          f"of which {len(positives)} have Jaccard >= {config.threshold}; shingling {shingle_s:.1f} s (shared)")

    results = [run(b, sets, groups, config) for b in ("datasketch", "numpy")] + [run_table(sets, groups, config)]
    for r in results:
        found = {(hit[0], i) for i, hit in enumerate(r["hits"]) if hit is not None}
        r["recall"] = len(found & positives) / max(1, len(positives))
        # Merges that are not planted pairs, and merges below the threshold (must be none).
        r["other_merges"] = len(found - {(a, b) for a, b in pairs})
        r["below_threshold"] = sum(1 for hit in r["hits"] if hit is not None and hit[1] < config.threshold)
        print(f"{r['backend']:>10}: signatures {len(docs) / r['signature_s']:>9.0f} traj/s "
              f"({r['signature_s']:.1f} s), near-dedup end to end {len(docs) / r['total_s']:>8.0f} traj/s "
              f"({r['total_s']:.1f} s), recall {r['recall']:.4f}, other merges {r['other_merges']}, "
              f"below threshold {r['below_threshold']}")
    lib = results[0]
    for ours in results[1:]:
        same = sum(1 for a, b in zip(lib["hits"], ours["hits"]) if (a is None) == (b is None)) / len(docs)
        print(f"ratio {ours['backend']}/datasketch: signatures x{lib['signature_s'] / ours['signature_s']:.1f}, "
              f"end to end x{lib['total_s'] / ours['total_s']:.1f}; recall {ours['recall']:.4f} vs "
              f"{lib['recall']:.4f}; same keep/drop decision on {same:.2%} of trajectories")
    print(f"table: {results[2]['screened']} candidate pairs passed the sketch screen")


if __name__ == "__main__":
    main()
