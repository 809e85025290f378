"""The near-dedup screen's inner loop, compiled (numba): which candidate pairs of a band's buckets
have sketches that may reach the threshold.

At a million templated trajectories a band step screens tens of millions of pairs (siblings at
Jaccard ~0.7 share band keys); in numpy each pair cost a gather of both sketches and ~0.5-0.7 us,
here ~10-15 ns. The estimate is the one `dedup_table`'s docstring describes: agreeing bins among the
bins either set fills, (same - both empty) / (bins - both empty), in float64 as numpy computes it.

A sketch row is read as 64-bit words of 8 one-byte bins. A word's zero bytes are counted without a
loop over its bytes: ~((w & 0x7F..) + 0x7F..) | w) has the high bit of exactly its zero bytes set
(no carry crosses a byte), so (that & 0x80..) >> 7 adds 1 to a byte lane per zero byte. Equal bins
are the zero bytes of a ^ b, bins empty in both those of a | b; a row's 64 words add at most 64 to
a lane, so the lanes do not overflow before they are summed.
"""
from __future__ import annotations

import numba
import numpy as np

_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_BYTE_PAIRS = np.uint64(0x00FF00FF00FF00FF)
_SUM16 = np.uint64(0x0001000100010001)


@numba.njit(inline="always")
def _zero_bytes(word):
    """Per byte lane of `word`: 1 where the byte is zero, else 0."""
    return (~(((word & _LOW7) + _LOW7) | word) & _HIGH) >> np.uint64(7)


@numba.njit(inline="always")
def _lane_sum(lanes):
    """The sum of a word's eight byte lanes (each <= 64)."""
    pairs = (lanes & _BYTE_PAIRS) + ((lanes >> np.uint64(8)) & _BYTE_PAIRS)
    return np.int64((pairs * _SUM16) >> np.uint64(48))


@numba.njit(inline="always")
def _may_reach(left, right, min_similarity):
    same = np.uint64(0)
    both_empty = np.uint64(0)
    for k in range(left.shape[0]):
        same += _zero_bytes(left[k] ^ right[k])
        both_empty += _zero_bytes(left[k] | right[k])
    empty = _lane_sum(both_empty)
    return (_lane_sum(same) - empty) / max(1, 8 * left.shape[0] - empty) >= min_similarity


@numba.njit(inline="always")
def _append(out, count, i, j):
    if count == out.shape[0]:
        grown = np.empty((2 * count, 2), dtype=np.int64)
        grown[:count] = out
        out = grown
    out[count, 0] = i
    out[count, 1] = j
    return out


@numba.njit(cache=True, nogil=True, boundscheck=False)
def pairs_within(words, bounds, min_similarity):
    """(m, 2) local (i, j), i < j, of the rows of each segment bounds[s]:bounds[s + 1] (a bucket)
    whose sketches may reach `min_similarity`; `words`: (rows, bins / 8) sketches as uint64."""
    out = np.empty((256, 2), dtype=np.int64)
    count = 0
    for segment in range(len(bounds) - 1):
        end = bounds[segment + 1]
        for i in range(bounds[segment], end):
            for j in range(i + 1, end):
                if _may_reach(words[i], words[j], min_similarity):
                    out = _append(out, count, i, j)
                    count += 1
    return out[:count]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def pairs_across(words_left, words_right, min_similarity):
    """(m, 2) local (i, j) of every left row i and right row j (two blocks of one bucket) whose
    sketches may reach `min_similarity`."""
    out = np.empty((256, 2), dtype=np.int64)
    count = 0
    for i in range(words_left.shape[0]):
        for j in range(words_right.shape[0]):
            if _may_reach(words_left[i], words_right[j], min_similarity):
                out = _append(out, count, i, j)
                count += 1
    return out[:count]


def warm() -> None:
    """Load both loops (from numba's cache, or compiled) now, for the argument types the screen
    passes: a process that forks workers (the `processes` runner's fork server) loads them once for
    every worker it starts."""
    words = np.zeros((2, 1), dtype=np.uint64)
    pairs_within(words, np.array([0, 2], dtype=np.int64), 0.5)
    pairs_across(words, words, 0.5)
