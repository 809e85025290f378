"""Deduplicate trajectories (exact, then near, across sources) and remove contaminated ones.

What counts as "the same trajectory" is the task plus what happened after it (thoughts, actions,
observations), not the prompt: every row of an env shares the same boilerplate instructions, and
re-releases (OpenManus-RL of AgentTraj-L, Agent-FLAN of AgentInstruct) rewrite the prompt or the
whitespace while the task and the trajectory stay.

- Exact: a hash over that text as tokens (case, whitespace, terminal escape codes and literal
  `\\n` escapes folded), taken of its words and of the text without whitespace: the two hold what
  the tokens hold, and a regex that removes whitespace costs half one that extracts the tokens.
- Near: MinHash over word shingles of the same text (rewordings of thoughts, small edits),
  candidates from LSH band keys, confirmed by the true Jaccard similarity of the shingle sets, so
  LSH false positives never merge; a dropped record always points at a kept record it is similar
  to (no chaining through intermediate rows); the stages run over a key table (dedup_table.py).
  The signatures come from a vectorized numpy MinHash (default; bench/bench_dedup.py measures it
  against datasketch's on 100k trajectories: same recall, several times the throughput) or from
  datasketch's own.
- Only records of the same kind (and negative type) are compared: an upstream negative is not a
  duplicate of a positive even when it repeats its task.

Keep preference, in order (documented in docs/build.md): upstream loss flags over inferred ones, an
original upstream release over a re-release (OpenManus-RL) over synthetic rows (each source states
its `keep_rank`), more known outcome fields (answer, reward, success), then build order. It
depends only on the records, so reruns keep the same representatives.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trajforge.pipeline.ingest.dialects import clean_text
from trajforge.pipeline.registry import Registry

# datasketch's 32-bit permutation scheme; the numpy backend also produces 32-bit values of the same
# form, so either kind of signature goes into the same LSH index.
SCHEME = "affine32"

_LITERAL_ESCAPE = re.compile(r"\\[ntr]")


@dataclass(frozen=True)
class DedupConfig:
    near: bool = True
    threshold: float = 0.85        # Jaccard similarity of shingle sets that counts as a near duplicate
    shingle_size: int = 5          # words per shingle
    num_perm: int = 128
    # LSH bands x rows <= num_perm; None: datasketch picks them, weighing false positives and false
    # negatives equally. Candidates are confirmed by the true Jaccard, so a false positive costs only
    # a set intersection: the default favours recall (a pair at Jaccard 0.85 becomes a candidate
    # with p = 0.99, against 0.46 with datasketch's choice of 8 x 16 for this threshold).
    bands: int | None = 16
    rows: int | None = 8
    backend: str = "numpy"         # MinHash signatures: "numpy" (vectorized, ours) or "datasketch"
    seed: int = 1

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], not {self.threshold}")
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both bands and rows, or neither")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands x rows = {self.bands * self.rows} exceeds num_perm {self.num_perm}")
        SIGNATURE_BACKENDS.check([self.backend])


def _folded(text: str) -> str:
    """The text whose tokens dedup compares. Of `clean_text` only the escape codes matter here:
    the rest of it changes whitespace, which no token holds, so it runs only on text with an
    escape code (ESC or BEL) in it."""
    if "\x1b" in text or "\x07" in text:
        text = clean_text(text)
    return _LITERAL_ESCAPE.sub(" ", text).lower()


class DedupText(NamedTuple):
    """What dedup compares of a record: its task, then every turn from the first trained
    assistant turn on (thoughts, actions, observations). The instructions, the acknowledgement and
    any upstream demonstration before it are boilerplate and left out.

    Thoughts count: two rows with the same prompt and the same single action but a different
    reasoning (AgentTraj-L's repeated `lmrlgym_maze_18`) are two training examples, not one.
    """
    bare: str  # the folded tokens, run together (the text without its whitespace)
    words: str  # the word tokens, joined by spaces: what shingles are made of
    # Together they give the tokens back: the non-word characters of `bare` are tokens alone, and
    # `words` says where its runs of word characters split into tokens.


# Between the folded texts of a record: a turn boundary, so "a b" + "c" differs from "a" + "b c",
# and the boundary between an assistant turn's thought and action. Each is a token of its own;
# in a text, where `re` takes them for whitespace, they become spaces.
_TURN, _THOUGHT_END = "\x1e", "\x1d"


def _part(text: str) -> str:
    text = _folded(text)
    if _TURN in text or _THOUGHT_END in text:
        text = text.replace(_TURN, " ").replace(_THOUGHT_END, " ")
    return text


def _record_parts(record: dict) -> list[str]:
    """The record's texts (`DedupText`'s) and the turn markers between them, in turn: texts at
    even indices, markers at odd ones."""
    parts = [record["task"]]
    append = parts.append
    # From the first trained assistant turn on (one loop: no generator to find it, no slice).
    trained = False
    for turn in record["conversations"]:
        if turn["role"] == "assistant":
            if not trained:
                if not turn["loss"]:
                    continue
                trained = True
            parts += (_TURN, turn["thought"] or "", _THOUGHT_END, turn["action"] or "")
        elif trained:
            append(_TURN)
            append(turn["content"])
    return parts


def _record_text(record: dict) -> str:
    """The record's folded texts (`DedupText`'s), joined by the turn markers."""
    parts = _record_parts(record)
    joined = "".join(parts)
    # Folded at once unless a text holds an escape code or a marker of its own: the markers keep
    # the literal escapes and the lowercasing (its final sigma) from reaching across texts.
    if "\x1b" in joined or "\x07" in joined or joined.count(_TURN) + joined.count(_THOUGHT_END) > len(parts) // 2:
        return "".join(part if i % 2 else _part(part) for i, part in enumerate(parts))
    return _LITERAL_ESCAPE.sub(" ", joined).lower()


def _unlowered_text(record: dict) -> tuple[str, int]:
    """(text, the markers it holds): `_record_text`, less the lowercasing, which `dedup_tokens`
    leaves to the tokenizer over the batch's bytes (of ASCII letters `_byte_tables`, a translate it
    makes anyway; of other characters the compiled loop, by `_lowered`), where a `str.lower` per
    record is a pass of its own; assuming no text holds a marker of its own, which `dedup_tokens`
    checks over the batch at once. A text with an escape code comes folded, lowercasing included
    (lowering it again changes nothing)."""
    parts = _record_parts(record)
    joined = "".join(parts)
    if "\x1b" in joined or "\x07" in joined:
        return _record_text(record), len(parts) // 2
    return _unescaped(joined), len(parts) // 2


# Per code point, its class among the tokens' characters: a word character (`re`'s \w), whitespace
# (`re`'s \s, less the turn markers) or another one (a token of its own).
_OTHER, _WORD, _SPACE = 0, 1, 2


@functools.cache
def _classes() -> np.ndarray:
    """The class of every code point (uint8, indexed by code point), as `re` decides."""
    every = np.arange(0x110000, dtype=np.uint32)
    every = every[(every < 0xD800) | (every > 0xDFFF)]  # surrogates: no string holds them alone
    text = every.tobytes().decode("utf-32-le")
    table = np.full(0x110000, _OTHER, dtype=np.uint8)
    table[[ord(c) for c in re.findall(r"\w", text)]] = _WORD
    table[[ord(c) for c in re.findall(f"[^\\S{_TURN}{_THOUGHT_END}]", text)]] = _SPACE
    return table


class DedupTokens(NamedTuple):
    """The `DedupText`s of a batch of records, as two UTF-8 buffers: text i is
    words[word_bounds[i]:word_bounds[i + 1]] and bare[bare_bounds[i]:bare_bounds[i + 1]]. Each word
    in `words` is followed by one space (the last of a text too: a text is its `DedupText.words`
    and a space, or nothing when it has no word), so that every space ends a word."""
    words: bytes
    word_bounds: np.ndarray
    bare: bytes
    bare_bounds: np.ndarray

    def text(self, i: int) -> DedupText:
        words = self.words[self.word_bounds[i]:self.word_bounds[i + 1]].decode()
        return DedupText(self.bare[self.bare_bounds[i]:self.bare_bounds[i + 1]].decode(), words[:-1])

    def word_text(self, i: int) -> str:
        """Text i's `DedupText.words`."""
        start, end = self.word_bounds[i], self.word_bounds[i + 1]
        return self.words[start:max(start, end - 1)].decode()

    def word_texts(self) -> list[str]:
        """Each text's `DedupText.words`."""
        bounds = self.word_bounds.tolist()
        return [self.words[start:max(start, end - 1)].decode() for start, end in zip(bounds, bounds[1:])]


@functools.cache
def _byte_tables(lower: bool = False) -> tuple[bytes, bytes, bytes, bytes | None]:
    """For `bytes.translate` (C loops over the bytes): each ASCII byte to its class; every ASCII
    byte but a word character to a space; the ASCII whitespace, to delete. The bytes of multi-byte
    characters (>= 0x80) are left to `_multibyte`. With `lower`, the second table and the fourth
    (for the bytes kept after the deletion; None: as they are) also make the upper case ASCII
    letters lower case, `str.lower` on ASCII text, in a translate made anyway."""
    classes = bytes(_classes()[:128].tolist()) + bytes([_OTHER] * 128)
    cased = bytes(range(256)).lower() if lower else bytes(range(256))
    return (classes, bytes(cased[c] if c >= 128 or classes[c] == _WORD else 0x20 for c in range(256)),
            bytes(c for c in range(128) if classes[c] == _SPACE), cased if lower else None)


def _multibyte(data: np.ndarray, classes: np.ndarray, gaps: np.ndarray) -> None:
    """Gives the bytes of the multi-byte characters of the UTF-8 `data` their character's class,
    and makes the first byte of each that is not a word character a space in `gaps` (a copy of
    `data`; the ASCII ones become spaces by `bytes.translate`)."""
    high = np.flatnonzero(data >= 0x80)
    leads = high[data[high] >= 0xC0]
    first = data[leads].astype(np.int32)
    following = [data[np.minimum(leads + k, len(data) - 1)].astype(np.int32) & 0x3F for k in (1, 2, 3)]
    code = np.where(first < 0xE0, (first & 0x1F) << 6 | following[0],
                    np.where(first < 0xF0, (first & 0x0F) << 12 | following[0] << 6 | following[1],
                             (first & 0x07) << 18 | following[0] << 12 | following[1] << 6 | following[2]))
    of_char = _classes()[code]
    classes[high] = of_char[np.searchsorted(leads, high, side="right") - 1]
    gaps[leads[of_char != _WORD]] = 0x20


def _segment_counts(mask: np.ndarray, bounds: list[int]) -> np.ndarray:
    """(n + 1,) int64: 0, then the running count of True in mask[bounds[i]:bounds[i + 1]]."""
    out = np.zeros(len(bounds), dtype=np.int64)
    out[1:] = [np.count_nonzero(mask[a:b]) for a, b in zip(bounds, bounds[1:])]
    return np.cumsum(out, out=out)


def dedup_tokens(records: Sequence[dict], staged: pa.Table | None = None) -> DedupTokens:
    """The `DedupTokens` of a batch of records; `staged`: the same records as staged (Arrow, the
    trajectory schema), whose texts are then joined from its buffers by the compiled loop
    (keys_kernel.record_texts: ~4.8 -> ~1 us a record) rather than from the dicts, unless a text
    needs more than `_unlowered_text`'s plain path, or the batch is too small for the compiled loops."""
    if staged is not None and staged.num_rows:
        joined = _staged_texts(staged)
        if joined is not None and len(joined[0]) >= COMPILED_TOKENS_FROM:
            tokens = _compiled_tokens(*joined, True, _lowered())
            if tokens is not None:
                return tokens
    texts, markers = zip(*map(_unlowered_text, records)) if records else ((), ())
    joined, bounds = _joined(texts)
    data = np.frombuffer(joined, dtype=np.uint8)
    if np.count_nonzero((data == ord(_TURN)) | (data == ord(_THOUGHT_END))) != sum(markers):
        # A text holds a marker of its own (each record holds its markers at least): folded text by text.
        return _tokens([_record_text(record) for record in records])
    if len(joined) >= COMPILED_TOKENS_FROM:
        tokens = _compiled_tokens(joined, bounds, True, _lowered())
        if tokens is not None:
            return tokens
    # Too small for the compiled loop, or a text holds a code point only `str.lower` lowers right.
    return _joined_tokens(*_joined([text if text.isascii() else text.lower() for text in texts]), lower=True)


_NO_BYTES = np.frombuffer(b"", dtype=np.uint8)


def string_buffers(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, data) of a string array, numpy views of its buffers: its own rows' n + 1 offsets
    into the data. Read-only both, whether Arrow's buffers are or not: the type the compiled loops
    that read them were loaded for (keys_kernel.warm)."""
    _, offsets, data = array.buffers()
    views = (np.frombuffer(offsets, dtype=np.int32, count=len(array) + 1, offset=4 * array.offset),
             _NO_BYTES if data is None else np.frombuffer(data, dtype=np.uint8))
    for view in views:
        view.flags.writeable = False
    return views


def _staged_texts(staged: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """`_joined` of the `_unlowered_text` of each staged record (Arrow, the trajectory schema), as
    (UTF-8 bytes, bounds), or None when a text holds an escape code or a turn marker (keys_kernel.record_texts)."""
    from trajforge.pipeline.quality.keys_kernel import record_texts

    parts, bounds, at = [], [np.zeros(1, dtype=np.int64)], 0
    for batch in staged.to_batches():
        conversations = batch.column("conversations")
        turn = conversations.values
        role, loss, thought, action = (turn.field(name) for name in ("role", "loss", "thought", "action"))
        joined, starts, plain = record_texts(
            *string_buffers(batch.column("task")), conversations.offsets.to_numpy(),
            pc.equal(role, "assistant").to_numpy(zero_copy_only=False), loss.to_numpy(zero_copy_only=False),
            *string_buffers(thought), thought.is_valid().to_numpy(zero_copy_only=False),
            *string_buffers(action), action.is_valid().to_numpy(zero_copy_only=False),
            *string_buffers(turn.field("content")))
        if not plain:
            return None
        parts.append(joined)
        bounds.append(starts[1:] + at)
        at += len(joined)
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
    joined.flags.writeable = False  # as `_compiled_tokens` reads bytes: the type its loop was loaded for
    return joined, np.concatenate(bounds)


def _joined(texts: Sequence[str]) -> tuple[bytes, list[int]]:
    """The texts as one UTF-8 buffer, a newline after each (whitespace, so no token changes, and a
    gap, so every text's last word ends), and where each starts (and the end)."""
    encoded = [text.encode() for text in texts]
    return b"\n".join([*encoded, b""]), np.cumsum([0, *(len(text) + 1 for text in encoded)]).tolist()


def _tokens(folded: Sequence[str]) -> DedupTokens:
    """The `DedupTokens` of folded texts."""
    return _joined_tokens(*_joined(folded))


# From this many bytes, texts are tokenized by the compiled loop (keys_kernel.py: one pass over the
# bytes, ~5x numpy's dozen on a key batch); a smaller input by numpy, which loads no compiler (numba
# costs ~0.7 s of CPU in a process that has not loaded it). Both give the same bytes.
COMPILED_TOKENS_FROM = 1 << 20


def _joined_tokens(joined: bytes, bounds: list[int], lower: bool = False) -> DedupTokens:
    """The `DedupTokens` of folded texts as `_joined` puts them (with `lower`, texts folded but for
    the lowercasing of ASCII letters, which `_byte_tables` does), tokenized over that one buffer:
    no work per token in Python."""
    if len(joined) >= COMPILED_TOKENS_FROM:
        return _compiled_tokens(joined, bounds, lower)
    return _numpy_tokens(joined, bounds, lower)


# No character but ASCII letters lowered by the compiled loop.
_NOT_LOWERED = np.zeros(0, dtype=np.uint32)


def warm() -> None:
    """Make the tables the compiled tokenizer reads (`_classes`, ~0.11 s of CPU, and `_lowered`) and
    load the compiled loops (`keys_kernel.warm`) now: a process that forks workers (the `processes`
    runner's fork server) makes them once for every worker it starts."""
    from trajforge.pipeline.quality import keys_kernel

    _classes()
    _lowered()
    keys_kernel.warm()


def _compiled_tokens(joined: bytes | np.ndarray, bounds: Sequence[int], lower: bool, lowered: np.ndarray = _NOT_LOWERED) -> DedupTokens | None:
    """The compiled loop's tokens (with `lower`, of texts lowered as `str.lower` lowers them but for
    the characters `lowered` leaves as they are: `_lowered`'s, or none), or None when a text holds a
    character the loop cannot lower as `str.lower` does."""
    from trajforge.pipeline.quality.keys_kernel import tokens

    words, word_bounds, bare, bare_bounds, whole = tokens(np.frombuffer(joined, dtype=np.uint8),
                                                          np.asarray(bounds, dtype=np.int64), _classes(), lower, lowered)
    return DedupTokens(words.tobytes(), word_bounds, bare.tobytes(), bare_bounds) if whole else None


@functools.cache
def _lowered() -> np.ndarray:
    """uint32, per code point up to the last one that `str.lower` changes: the code point it lowers
    to (itself when it does not change). U+0130, which lowers into two, to its first (`i`), and
    U+03A3 as where no letter precedes it (`σ`): the compiled loop leaves a text that holds either
    to `str.lower` (keys_kernel.tokens)."""
    every = np.arange(0x110000, dtype=np.uint32)
    every = every[(every < 0xD800) | (every > 0xDFFF)]  # surrogates: no string holds them alone
    # One string of every code point, lowered at once: the same length once U+0130 is out of it.
    text = every.tobytes().decode("utf-32-le").replace("\u0130", "i")
    table = np.arange(0x110000, dtype=np.uint32)
    table[every] = np.frombuffer(text.lower().encode("utf-32-le"), dtype=np.uint32)
    table[0x130], table[0x3A3] = ord("i"), ord("\u03c3")
    changed = np.flatnonzero(table != np.arange(0x110000, dtype=np.uint32))
    return table[:changed[-1] + 1].copy()


def _numpy_tokens(joined: bytes, bounds: list[int], lower: bool) -> DedupTokens:
    """`_joined_tokens` in numpy over the buffer's bytes (`bytes.translate` for the ASCII ones)."""
    data = np.frombuffer(joined, dtype=np.uint8)
    to_class, gaps_to_space, ascii_space, cased = _byte_tables(lower)
    classes = np.frombuffer(joined.translate(to_class), dtype=np.uint8)
    gaps = data
    if not joined.isascii():
        classes, gaps = classes.copy(), data.copy()
        _multibyte(data, classes, gaps)
    word = classes == _WORD
    # Every word character, and the first character after each word run, made a space.
    keep = word.copy()
    keep[1:] |= word[:-1]
    space = classes == _SPACE
    bare = joined.translate(cased, ascii_space)
    if len(bare) != len(joined) - np.count_nonzero(space):  # multi-byte whitespace, which that leaves
        bare = data[~space].tobytes().translate(cased)
    return DedupTokens(gaps[keep].tobytes().translate(gaps_to_space), _segment_counts(keep, bounds),
                       bare, np.asarray(bounds) - _segment_counts(space, bounds))


def dedup_texts(records: Sequence[dict]) -> list[DedupText]:
    """The `DedupText` of each record."""
    tokens = dedup_tokens(records)
    return [tokens.text(i) for i in range(len(records))]


# Between the group, the words and the bare text in what the exact key hashes.
_KEY_SEPARATOR = b"\x1f"


def exact_key(group: str, text: DedupText) -> str:
    """The exact-dedup hash of a record, from its group and its `DedupText`."""
    return _exact_key(group, text.words.encode(), text.bare.encode())


def exact_keys(groups: Sequence[str], tokens: DedupTokens) -> list[str]:
    """The `exact_key` of each record of a batch, from its group and the batch's `DedupTokens`."""
    words, bare = memoryview(tokens.words), memoryview(tokens.bare)
    word_bounds, bare_bounds = tokens.word_bounds.tolist(), tokens.bare_bounds.tolist()
    # The hash of each group's prefix made once and copied, the words and the bare text hashed
    # where they lie rather than joined first (a copy of both): ~-19 % of this function's CPU.
    prefixes = {}
    keys = []
    for i, group in enumerate(groups):
        prefix = prefixes.get(group)
        if prefix is None:
            prefix = prefixes[group] = hashlib.sha1(group.encode() + _KEY_SEPARATOR)
        key = prefix.copy()
        # A text's words are its part of `words` less the space after its last word.
        key.update(words[word_bounds[i]:max(word_bounds[i], word_bounds[i + 1] - 1)])
        key.update(_KEY_SEPARATOR)
        key.update(bare[bare_bounds[i]:bare_bounds[i + 1]])
        keys.append(key.hexdigest())
    return keys


def _exact_key(group: str, words, bare) -> str:
    return hashlib.sha1(_KEY_SEPARATOR.join([group.encode(), words, bare])).hexdigest()


def shingles(words: Sequence[str], size: int) -> set[str]:
    """Word shingles; a text shorter than one shingle is a single shingle of all its words."""
    if len(words) <= size:
        return {" ".join(words)}
    return {" ".join(words[i:i + size]) for i in range(len(words) - size + 1)}


class ShingleSets(Sequence):
    """The `shingles` of the texts of `DedupTokens`, each set made only when it is read: the numpy
    backend reads their hashes (`word_shingle_hashes`) instead."""

    def __init__(self, tokens: DedupTokens, size: int):
        self.tokens, self.size = tokens, size

    def __len__(self) -> int:
        return len(self.tokens.word_bounds) - 1

    def __getitem__(self, i):
        return shingles(self.tokens.text(i).words.split(), self.size)


def _datasketch_signatures(sets: Sequence[set[str]], num_perm: int, seed: int, hashes=None) -> np.ndarray:
    from datasketch import MinHash  # the optional backend; datasketch loads scipy (~1.5 s) on import

    out = np.empty((len(sets), num_perm), dtype=np.uint32)
    for i, s in enumerate(sets):
        m = MinHash(num_perm=num_perm, seed=seed, scheme=SCHEME)
        m.update_batch([x.encode() for x in s])
        out[i] = m.hashvalues
    return out


def shingle_hashes(sets: Sequence[set[str]], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(set sizes, one 64-bit hash per shingle of every set, set after set), hashed by polars at once."""
    sizes = np.fromiter((len(s) for s in sets), dtype=np.int64, count=len(sets))
    flat = pl.Series([x for s in sets for x in s], dtype=pl.String)
    return sizes, flat.hash(seed=seed).to_numpy()


def word_shingle_hashes(words: bytes, bounds: np.ndarray, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`shingle_hashes` of the `shingles` of the texts of `DedupTokens.words` (`bounds` its
    `word_bounds`), hashed by polars at once. Each shingle is a view into `words` (an Arrow string
    view array), never a string of its own. A shingle that repeats in a text is hashed each time:
    MinHash and the sketches keep minima, which a repeat does not change (`np.unique` of a text's
    hashes is its set's). Positions are 32-bit (a batch's words are far under 4 GiB): half the
    memory traffic of 64-bit ones, and what the views hold. From COMPILED_TOKENS_FROM bytes the
    views are made in one compiled pass (keys_kernel.shingle_views: the same views, ~4x faster)."""
    if len(words) >= COMPILED_TOKENS_FROM:
        from trajforge.pipeline.quality.keys_kernel import shingle_views

        padded = words + bytes(16)
        sizes, views = shingle_views(np.frombuffer(padded, dtype=np.uint8), bounds.astype(np.int64, copy=False), size)
        return sizes, pl.Series(_views_array(views, padded)).hash(seed=seed).to_numpy()
    ends = np.flatnonzero(np.frombuffer(words, dtype=np.uint8) == 0x20).astype(np.uint32)  # every space ends a word
    n_words = len(ends)
    first_word = np.searchsorted(ends, bounds.astype(np.uint32))
    counts = np.diff(first_word)
    starts = np.zeros(n_words, dtype=np.uint32)
    starts[1:] = ends[:-1] + 1
    # Word j starts a shingle when its text holds words j .. j + size - 1 (no text starts among
    # the size - 1 words after it); the shingle ends where word j + size - 1 does.
    text_start = np.zeros(n_words + size, dtype=bool)
    text_start[first_word[1:]] = True
    text_start[n_words:] = True
    crossing = np.zeros(n_words, dtype=bool)
    for k in range(1, size):
        crossing |= text_start[k:n_words + k]
    shingle_start = ~crossing
    last = np.zeros(n_words, dtype=np.uint32)
    last[:max(0, n_words - size + 1)] = ends[size - 1:]
    # A text of 1 .. size - 1 words: one shingle, all its words.
    short = np.flatnonzero((counts > 0) & (counts < size))
    shingle_start[first_word[short]] = True
    last[first_word[short]] = ends[first_word[short + 1] - 1]
    begin = starts[shingle_start]
    length = last[shingle_start] - begin
    sizes = np.maximum(counts - (size - 1), 1)
    empty = np.flatnonzero(counts == 0)
    if len(empty):  # a text without words: one empty shingle
        at = (np.cumsum(sizes) - sizes)[empty] - np.arange(len(empty))
        begin, length = np.insert(begin, at, 0), np.insert(length, at, 0)
    return sizes, pl.Series(_string_views(words, begin, length)).hash(seed=seed).to_numpy()


# Little-endian masks of a 4-byte word's first 0..4 bytes.
_PREFIX_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF], dtype="<u4")


def _string_views(data: bytes, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """The strings data[starts[i]:starts[i] + lengths[i]] (uint32 each) as an Arrow string view
    array over `data` (under 4 GiB: a batch's words): 16 bytes each, its length, then the string
    itself when it fits in 12 bytes (zeros after it), else its first 4 bytes, buffer 0 and its offset."""
    padded = data + bytes(16)
    # The 4 bytes from every offset of `data`, read unaligned: a strided view, no copy of them.
    fours = np.ndarray((len(padded) - 3,), dtype="<u4", buffer=padded, strides=(1,))
    views = np.empty((len(starts), 4), dtype="<u4")
    views[:, 0], views[:, 1], views[:, 2], views[:, 3] = lengths, fours[starts], 0, starts
    inline = np.flatnonzero(lengths <= 12)
    if len(inline):
        at, size = starts[inline], lengths[inline].astype(np.int64)
        for column in (1, 2, 3):
            views[inline, column] = fours[at + 4 * (column - 1)] & _PREFIX_MASKS[np.clip(size - 4 * (column - 1), 0, 4)]
    return _views_array(views, padded)


def _views_array(views: np.ndarray, padded: bytes) -> pa.Array:
    """The Arrow string view array of `views` ((n, 4) uint32, as `_string_views` makes them) over `padded`."""
    return pa.Array.from_buffers(pa.string_view(), len(views), [None, pa.py_buffer(views), pa.py_buffer(padded)])


def hash_halves(hashed: np.ndarray) -> np.ndarray:
    """(n, 2) uint32 view of 64-bit hashes: the low 32 bits of each, then the high ones."""
    return hashed.astype("<u8", copy=False).view("<u4").reshape(-1, 2)


@functools.cache
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy backend's `num_perm` affine permutations (a * x + b) mod 2^32 of a seed: (a, b),
    uint32 each, `a` odd. Shared between callers: not to be written to."""
    gen = np.random.RandomState(seed)
    a = (gen.randint(0, 1 << 31, size=num_perm, dtype=np.uint64) * 2 + 1).astype(np.uint32)
    b = gen.randint(0, 1 << 32, size=num_perm, dtype=np.uint64).astype(np.uint32)
    return a, b


def _numpy_signatures(sets: Sequence[set[str]], num_perm: int, seed: int,
                      hashes: tuple[np.ndarray, np.ndarray] | None = None, chunk_shingles: int = 6 << 10) -> np.ndarray:
    """MinHash of many sets at once: one vectorized 64-bit hash of every shingle (polars), then
    `num_perm` affine permutations of its 32 high bits, (a*x + b) mod 2^32 with odd `a` (a
    bijection, the scheme datasketch calls affine32), and a per-set minimum (numpy).

    The work runs in chunks of whole sets through one reused buffer of about 3 MB (128
    permutations), a row per permutation: each minimum then reads contiguous memory, several
    times faster than a row per shingle. Its rows are not a power of two apart (rows 8 KB apart
    measured 3x slower, as if they shared cache sets). Chunks of 3072 shingles (a 1.5 MB buffer)
    cost ~15 % more than of 5120 to 16384, which measured alike (a build's key batches, 2000
    records, on a 2-core EPYC with 1 MB of L2 a core): fewer chunks, fewer numpy calls.
    """
    sizes, hashed = hashes or shingle_hashes(sets, seed)
    hashed = np.ascontiguousarray(hash_halves(hashed)[:, 1])
    a, b = permutations(num_perm, seed)
    out = np.empty((num_perm, len(sets)), dtype=np.uint32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    buf = np.empty((num_perm, max(chunk_shingles, int(sizes.max()))), dtype=np.uint32)
    doc = 0
    while doc < len(sets):
        # Whole sets per chunk, so each minimum is taken within one chunk.
        end = max(doc + 1, int(np.searchsorted(starts, starts[doc] + chunk_shingles, side="right")) - 1)
        lo, hi = starts[doc], starts[end]
        view = buf[:, :hi - lo]
        np.multiply(a[:, None], hashed[None, lo:hi], out=view)
        view += b[:, None]
        out[:, doc:end] = np.minimum.reduceat(view, starts[doc:end] - lo, axis=1)
        doc = end
    return np.ascontiguousarray(out.T)


SIGNATURE_BACKENDS = Registry("MinHash backend", {"numpy": _numpy_signatures, "datasketch": _datasketch_signatures})


def signatures(sets: Sequence[set[str]], config: DedupConfig,
               hashes: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """MinHash signatures (one row per set) with the configured backend; `hashes` are the sets'
    `shingle_hashes` when the caller has them already."""
    if not sets:
        return np.empty((0, config.num_perm), dtype=np.uint32)
    return SIGNATURE_BACKENDS[config.backend](sets, config.num_perm, config.seed, hashes)


# --- decontamination ------------------------------------------------------------------------

def read_eval_tasks(path: Path) -> list[str]:
    """Evaluation tasks: a text file with one task per line, or a JSON / JSON Lines file of
    strings or of objects with a `task` (or `instruction`) field."""
    text = Path(path).read_text(encoding="utf-8")
    items: list = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        items = json.loads(stripped)
    elif stripped.startswith(("{", '"')):
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        items = [line for line in text.splitlines() if line.strip()]
    tasks = []
    for item in items:
        value = item.get("task", item.get("instruction")) if isinstance(item, dict) else item
        if isinstance(value, str) and value.strip():
            tasks.append(value)
    return tasks


class Contamination:
    """Word n-gram index of evaluation tasks. A task shorter than n words is matched whole."""

    def __init__(self, tasks: Iterable[str], n: int = 8):
        self.n = n
        self.grams: dict[tuple[str, ...], int] = {}
        self.short: dict[int, dict[tuple[str, ...], int]] = {}
        for index, words in enumerate(map(_split, _task_tokens(list(tasks)).word_texts())):
            if not words:
                continue
            if len(words) < n:
                self.short.setdefault(len(words), {}).setdefault(words, index)
            for k in range(len(words) - n + 1):
                self.grams.setdefault(words[k:k + n], index)
        # The words that start an entry of each table: a window starting with another word is no hit.
        self.tables = [(size, table, {gram[0] for gram in table})
                       for size, table in [(n, self.grams), *sorted(self.short.items())]]

    @functools.cached_property
    def _keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What `keys_kernel.window_hits` reads of the tables: (sizes, the sorted keys of each
        table's entries, where each table's start, the marks of their top 16 bits). Made where
        first asked for (a worker that checks a large batch), in the compiled loop that reads them."""
        from trajforge.pipeline.quality.keys_kernel import text_keys

        tables = [np.unique(text_keys(*_word_buffer(table))) for _, table, _ in self.tables]
        keys = np.concatenate(tables)
        marks = np.zeros(1 << 16, dtype=np.uint8)
        marks[keys >> np.uint64(48)] = 1
        return (np.array([size for size, _, _ in self.tables], dtype=np.int64), keys,
                np.cumsum([0, *map(len, tables)], dtype=np.int64), marks)

    def matches(self, texts: Sequence[str] | pa.Array) -> list[tuple[int, str] | None]:
        """Per text (strings, or a staged batch's `task` column, whose texts are then read from
        its buffers): (index of an overlapping evaluation task, the shared words) or None. `_match`
        says which, first, of the texts a compiled pass finds a window of words with an entry's
        key in (`keys_kernel.window_hits`; few), or of every text of a batch too small for the
        compiled loops."""
        tokens = _task_tokens(texts)
        out: list[tuple[int, str] | None] = [None] * (len(tokens.word_bounds) - 1)
        if len(tokens.words) >= COMPILED_TOKENS_FROM:
            from trajforge.pipeline.quality.keys_kernel import window_hits

            words = np.frombuffer(tokens.words, dtype=np.uint8)
            candidates = np.flatnonzero(window_hits(words, tokens.word_bounds, *self._keys)).tolist()
        else:
            candidates = range(len(out))
        for i in candidates:
            out[i] = self._match(_split(tokens.word_text(i)))
        return out

    def details(self, texts: Sequence[str] | pa.Array) -> list[str | None]:
        """Per text (as `matches` reads them): the quarantine detail of its overlap with an evaluation task, or None."""
        return [None if hit is None else
                f"task shares {len(hit[1].split())} words with evaluation task #{hit[0]}: {hit[1]!r}"[:500]
                for hit in self.matches(texts)]

    def _match(self, words: tuple[str, ...]) -> tuple[int, str] | None:
        for size, table, firsts in self.tables:
            for k in range(len(words) - size + 1):
                if words[k] in firsts:
                    hit = table.get(words[k:k + size])
                    if hit is not None:
                        return hit, " ".join(words[k:k + size])
        return None


def _task_tokens(texts: Sequence[str] | pa.Array) -> DedupTokens:
    """The tokens of each folded text (dedup's): strings, or an Arrow string array, whose texts are
    joined from its buffers by the compiled loop (`_staged_tasks`) unless one needs more than
    `_unlowered`'s plain path or they are too few for the compiled loops."""
    if isinstance(texts, pa.Array):
        tokens = _staged_tasks(texts)
        if tokens is not None:
            return tokens
        texts = texts.to_pylist()
    # The ASCII texts' lowercasing is left to the tokenizer (as `_unlowered_text` leaves it).
    return _joined_tokens(*_joined([_unlowered(text) for text in texts]), lower=True)


def _staged_tasks(tasks: pa.Array) -> DedupTokens | None:
    """`_task_tokens` of a string array by the compiled loops (`keys_kernel.record_texts` with no
    turns: each text unescaped, a newline after it), or None where they do not apply."""
    from trajforge.pipeline.quality.keys_kernel import record_texts

    offsets, data = string_buffers(tasks)
    no_turns = np.frombuffer(bytes(4 * len(offsets)), dtype=np.int32)
    no_flags, no_text = np.zeros(0, dtype=bool), no_turns[:1]
    joined, bounds, plain = record_texts(offsets, data, no_turns, no_flags, no_flags, no_text, _NO_BYTES, no_flags,
                                         no_text, _NO_BYTES, no_flags, no_text, _NO_BYTES)
    if not plain or len(joined) < COMPILED_TOKENS_FROM:
        return None
    joined.flags.writeable = False  # as `_compiled_tokens` reads bytes: the type its loop was loaded for
    return _compiled_tokens(joined, bounds, True, _lowered())


def _split(words: str) -> tuple[str, ...]:
    return tuple(words.split(" ")) if words else ()


def _word_buffer(grams: Iterable[tuple[str, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Word tuples as `DedupTokens` hold words: (each word and a space after it, where each tuple starts and the end)."""
    encoded = [("".join(word + " " for word in gram)).encode() for gram in grams]
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), np.cumsum([0, *map(len, encoded)], dtype=np.int64)


def _unlowered(text: str) -> str:
    """`_folded`, less the lowercasing of an ASCII text (`_joined_tokens` does it with `lower`)."""
    if "\x1b" in text or "\x07" in text:
        return _folded(text)
    return _unescaped_unlowered(text)


def _unescaped_unlowered(text: str) -> str:
    """`_unlowered` of a text without terminal control sequences."""
    text = _unescaped(text)
    return text if text.isascii() else text.lower()


def _unescaped(text: str) -> str:
    """The text with its literal escapes (`\\n`, `\\t`, `\\r`) made spaces."""
    if "\\" in text:
        text = _LITERAL_ESCAPE.sub(" ", text)
    return text


def decontaminate(records: list[dict], index: Contamination) -> tuple[list[dict], list[tuple[dict, str]]]:
    """Split records into (clean, [(record, detail)]) by n-gram overlap of their task."""
    clean, removed = [], []
    for record, detail in zip(records, index.details([record["task"] for record in records])):
        if detail is None:
            clean.append(record)
        else:
            removed.append((record, detail))
    return clean, removed
