"""The key table's MinHash signatures and one-permutation sketches in one compiled pass (numba).

`dedup._numpy_signatures` and `dedup_table.sketches` compute the same two arrays in numpy: the
signatures as a (permutations x shingles) buffer written by a multiply, then an add, then read by a
per-set minimum (three passes over ~3 MB, beyond L2), the sketches by `np.minimum.at`. Here each
shingle's 32 high bits go through the permutations while the set's minima stay in registers and L1,
and the same loop keeps its sketch bin's minimum: on the 20k corpus's key batches (7.0M shingles,
18,278 sets) 0.26 -> 0.11 s, the same bits (tests/quality/test_dedup_table.py holds the two to it).

numba is loaded only where this is first called (a build's map; the near screen loads it anyway,
sketch_screen.py): ~0.25 s of CPU a process, and ~0.35 s to load the compiled loop from numba's
cache (the first run on a machine compiles it, ~3 s).
"""
from __future__ import annotations

import numba
import numpy as np

_EMPTY = np.uint32(0xFFFFFFFF)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def signatures_and_sketches(high, low, starts, a, b, bins):
    """((n, len(a)) uint32 signatures, (n, bins) uint8 sketches) of the n sets whose shingles'
    64-bit hashes are high[s] << 32 | low[s] for s in starts[i]:starts[i + 1] (each set non-empty).

    Signature value p of a set: the minimum over its shingles of (a[p] * high + b[p]) mod 2^32.
    Sketch bin k (`bins` a power of two): the minimum `high` of the shingles whose `low` & (bins - 1)
    is k, stored as minimum % 255 + 1, and 0 where none is (or the minimum is 0xFFFFFFFF)."""
    n = len(starts) - 1
    perms = a.shape[0]
    sig = np.empty((n, perms), dtype=np.uint32)
    sketch = np.zeros((n, bins), dtype=np.uint8)
    minima = np.empty(perms, dtype=np.uint32)
    smallest = np.empty(bins, dtype=np.uint32)
    mask = np.uint32(bins - 1)
    for i in range(n):
        minima[:] = _EMPTY
        smallest[:] = _EMPTY
        for s in range(starts[i], starts[i + 1]):
            x = high[s]
            k = low[s] & mask
            if x < smallest[k]:
                smallest[k] = x
            for p in range(perms):
                value = np.uint32(a[p] * x + b[p])
                if value < minima[p]:
                    minima[p] = value
        sig[i] = minima
        for k in range(bins):
            if smallest[k] != _EMPTY:
                sketch[i, k] = np.uint8(smallest[k] % np.uint32(255) + np.uint32(1))
    return sig, sketch
