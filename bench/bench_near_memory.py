"""Peak memory (PSS) of the near-dedup stage per record: writing its table, and each band step.

    python bench/bench_near_memory.py 100000 1000000

Builds the near stage's table (`write_near_table`) for N synthetic rows in keep-preference order,
then runs every band step (`screen_band`) one after the other in a child process, as a worker of
the build's task runner does, and samples /proc/self/smaps_rollup every few milliseconds. Prints,
per N, the table's size on disk, the peak PSS above the process's own start while writing, and
the highest peak of the band steps, in MiB and in bytes a row (with its anonymous and
file-backed parts), and the CPU seconds of each (the rows are made before, into files). The first
band step also loads the compiled screen (numba and LLVM: ~65 MiB of heap and ~115 MiB of shared
library pages, which a build's worker processes share).

The rows (default mix): 60 % alone (keys and sketch of their own), 10 % in pairs of planted near
copies (Jaccard ~0.9: a band agrees with probability 0.9^rows, a sketch bin with 0.9), 30 % in
templated families of 50 (siblings at ~0.7), the members of a pair or family spread over the table.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl

from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.pipeline.quality.dedup_table import SKETCH_BINS, band_params, screen_band, write_near_table

PART_ROWS = 10_000
GROUPS = 4


def pss() -> dict[str, int]:
    """This process's PSS, and its anonymous and file-backed parts, in bytes."""
    fields = dict(line.split()[:2] for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return {name: int(fields[f"{name}:"]) * 1024 for name in ("Pss", "Pss_Anon", "Pss_File")}


class PeakPss:
    """This process's highest PSS while the block runs (and its parts then), above their values at the start."""

    def __enter__(self) -> PeakPss:
        self.start = self.peak = pss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.003):
            self._take()

    def _take(self) -> None:
        now = pss()
        if now["Pss"] > self.peak["Pss"]:
            self.peak = now

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    @property
    def above_start(self) -> dict[str, int]:
        return {name: self.peak[name] - self.start[name] for name in self.peak}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 values: a cheap deterministic hash."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def families(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its family id (rows alone have their own) and its Jaccard to the family's centre."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=n, p=[0.6, 0.1, 0.3])
    family = np.arange(n, dtype=np.uint64)
    pairs = np.flatnonzero(kind == 1)
    family[pairs] = np.uint64(n) + rng.integers(0, max(1, len(pairs) // 2), len(pairs)).astype(np.uint64)
    templated = np.flatnonzero(kind == 2)
    family[templated] = np.uint64(2 * n) + rng.integers(0, max(1, len(templated) // 50), len(templated)).astype(np.uint64)
    similarity = np.select([kind == 1, kind == 2], [0.95, 0.84], 0.0)
    return family, similarity


def parts(n: int, bands: int, rows: int, seed: int = 0):
    """(row indices, band keys, sketches) of the table's rows, PART_ROWS at a time."""
    family, similarity = families(n, seed)
    for start in range(0, n, PART_ROWS):
        at = np.arange(start, min(start + PART_ROWS, n), dtype=np.int64)
        rng = np.random.default_rng([seed, start])
        fam, sim = family[at], similarity[at]
        centre_keys = _mix(fam[:, None] * np.uint64(64) + np.arange(bands, dtype=np.uint64))
        own_keys = _mix(np.uint64(1 << 62) + at.astype(np.uint64)[:, None] * np.uint64(64)
                        + np.arange(bands, dtype=np.uint64))
        keys = np.where(rng.random((len(at), bands)) < (sim ** rows)[:, None], centre_keys, own_keys)
        centre = (_mix(fam[:, None] * np.uint64(SKETCH_BINS) + np.arange(SKETCH_BINS, dtype=np.uint64))
                  % np.uint64(255) + np.uint64(1)).astype(np.uint8)
        own = rng.integers(1, 256, (len(at), SKETCH_BINS), dtype=np.uint8)
        yield at, keys, np.where(rng.random((len(at), SKETCH_BINS)) < sim[:, None], centre, own)


def saved_parts(folder: Path, n: int, bands: int, rows: int):
    """`parts`, made once into .npy files under `folder` and then read back a part at a time: the band
    keys or the sketches of every row or of the `wanted` ones (dedup_table.NearParts; so that making
    them is not measured)."""
    paths = []
    for i, part in enumerate(parts(n, bands, rows)):
        paths.append([folder / f"{i}-{name}.npy" for name in ("at", "bands", "sketch")])
        for path, array in zip(paths[-1], part):
            np.save(path, array)

    def column(name: str, wanted: np.ndarray | None = None):
        for at_path, bands_path, sketch_path in paths:
            at = np.load(at_path)
            inside = np.isin(at, wanted) if wanted is not None else slice(None)
            yield at[inside], np.load(sketch_path if name == "sketch" else bands_path)[inside]

    return column


def band_steps(folder: str, bands: int, threshold: float, out) -> None:
    """In a child process: each band step's peak PSS above the child's PSS before it, and the CPU
    seconds of all of them."""
    from trajforge.pipeline.quality.dedup_table import NearTable

    table = NearTable(folder)
    peaks, pairs = [], []
    cpu = time.process_time()
    for band in range(bands):
        with PeakPss() as peak:
            pairs.append(screen_band(table, band, threshold))
        peaks.append(peak.above_start)
    # A pair that shares several bands passes in each: counted once, as the near stage keeps it.
    out.send((peaks, len(np.unique(np.concatenate(pairs), axis=0)), time.process_time() - cpu))


def measure(n: int, config: DedupConfig) -> dict:
    bands, rows = band_params(config)
    groups = pl.DataFrame({"group": [f"g{i % GROUPS}" for i in range(n)]})
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as folder:
        (Path(folder) / "parts").mkdir()
        made = saved_parts(Path(folder) / "parts", n, bands, rows)
        cpu = time.process_time()
        with PeakPss() as writing:
            table = write_near_table(Path(folder) / "near", groups, made, config)
        written = time.process_time() - cpu
        disk = sum(f.stat().st_size for f in Path(table.folder).iterdir())
        receive, send = multiprocessing.Pipe(duplex=False)
        child = multiprocessing.get_context("spawn").Process(target=band_steps,
                                                             args=(table.folder, bands, config.threshold, send))
        child.start()
        peaks, pairs, screened = receive.recv()
        child.join()
    return {"n": n, "disk": disk, "write_peak": writing.above_start, "write_s": written,
            "band_peak": max(peaks, key=lambda peak: peak["Pss"]), "band_peaks": peaks, "screen_s": screened,
            "pairs": pairs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rows", type=int, nargs="+", help="table sizes (rows) to measure")
    args = p.parse_args()
    mib = 1 << 20

    def size(peak: dict[str, int], n: int) -> str:
        return (f"+{peak['Pss'] / mib:.1f} MiB ({peak['Pss'] / n:.0f} B/row; anon {peak['Pss_Anon'] / mib:+.1f}, "
                f"file {peak['Pss_File'] / mib:+.1f})")

    for n in args.rows:
        r = measure(n, DedupConfig())
        per_band = " ".join(f"{peak['Pss'] / mib:.0f}" for peak in r["band_peaks"])
        print(f"N={n:,}: table on disk {r['disk'] / mib:.1f} MiB ({r['disk'] / n:.0f} B/row)\n"
              f"  writing it: peak PSS {size(r['write_peak'], n)}, {r['write_s']:.1f} s of CPU\n"
              f"  band steps: highest peak PSS {size(r['band_peak'], n)}; {r['screen_s']:.1f} s of CPU, "
              f"{r['pairs']:,} pairs past the screen\n"
              f"  per band (MiB): {per_band}")


if __name__ == "__main__":
    main()
