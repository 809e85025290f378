"""The key table's compiled loops (numba): joining a key batch's texts from its staged Arrow
buffers, tokenizing them, the string views of its word shingles, and its MinHash signatures with
its one-permutation sketches.

- `record_texts`: dedup.py's `_unlowered_text` of each record, joined as `_joined` joins them, read
  from the staged batch's string buffers in one pass, where Python walked every turn's dict and
  joined, escaped and encoded each record's parts (~4.8 -> ~0.7-1 us a record on the 20k corpus's
  key batches); with the key table's columns taken from the staged batch too (`record_chars`, the
  contents' characters, ~1-1.9 -> 0.1 us a record), `stage_keys` 29.0 -> 22.7 us a record (median of
  11, same process, alternated); `profile_build.py 100000`, 3 alternated pairs: keys 0.033-0.038 ->
  0.023-0.030 ms a record. Callgrind counts only -2.8 % of its instructions: most of what it saves
  is the stalls of walking every turn's dict, scattered over memory, one record after another.

- `tokens`: dedup.py's tokenizer (`_joined_tokens`) in one pass over the batch's UTF-8 bytes, where
  numpy makes a dozen (a class per byte by `bytes.translate`, the masks, the kept bytes, the counts
  per text): on the 20k corpus's key batches (45 MB) ~0.19 -> ~0.11 s, the same bytes (tests/quality/
  test_dedup.py runs its tokenizer tests on both). It also lowers the key texts' characters beyond
  ASCII (by a table of `str.lower`'s), which Python did text by text before: `stage_keys` 40.7 ->
  35.7 us a record on the 100k corpus's key batches (a quarter of its texts are not ASCII; median
  of 9, same process, alternated).
- `shingle_views`: `dedup.word_shingle_hashes` finds each text's words and shingles and writes their
  Arrow string views (`dedup._string_views`) in ~15 numpy passes; here in one pass per text, the same
  views (polars hashes them either way): on the 100k corpus's key batches ~0.0110 -> ~0.0083 ms a
  record for the whole of `word_shingle_hashes`; with the words' ends found without a branch, this
  loop 4.2 -> 1.6 us a record (bench/ab_map.py's rows, same process).
- `signatures_and_sketches`: `dedup._numpy_signatures` and `dedup_table.sketches` compute these in
  numpy: the signatures as a (permutations x shingles) buffer written by a multiply, then an add,
  then read by a per-set minimum (three passes over ~3 MB, beyond L2), the sketches by
  `np.minimum.at`. Here eight permutations at a time take one pass over a set's shingles (32 high
  bits each, in L1), their minima in registers, and a second pass keeps each sketch bin's minimum:
  on the 20k corpus's key batches (7.0M shingles, 18,278 sets) 0.26 -> 0.11 s, the same bits
  (tests/quality/test_dedup_table.py); a pass over the permutations per shingle (loading and
  storing every minimum at each shingle) cost ~4-6x these passes (100k corpus's key batches,
  bench/ab_map.py's rows: ~8.3 -> ~1.9 us a record).
- `window_hits` (with `text_keys`, the same key of an index's entries): decontamination's check of
  a batch of tasks against the evaluation tasks' word n-grams, a key of every window of words in one
  pass, where polars looked for every entry in the joined words (Aho-Corasick) and Python lowered
  and encoded each task; `_match` reads only the texts it passes (none on the bench corpora). On the
  100k corpus's staged units, with the tasks joined from their Arrow buffers by `record_texts`:
  `unit_contamination` 1.29 -> 0.79 s of CPU (best of 3, same process), the same details.

Both loops index through unsigned integers: through a signed one numba tests every access for a
negative (from the end) index. On the 100k corpus's key batches (same-process, bench/ab_map.py's
rows): `tokens` ~0.0095 -> ~0.0066 ms a record, `signatures_and_sketches` ~0.0107 -> ~0.0098, the same
bits.

numba is loaded only where one of these is first called (a build's map; the near screen loads it
anyway, sketch_screen.py): ~0.7 s of CPU in a process that has the build's other modules, most of
it loading LLVM and the compiled loops from numba's cache (the first run on a machine compiles
them, a few seconds).
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
    blocked = perms - perms % 8
    sig = np.empty((n, perms), dtype=np.uint32)
    sketch = np.zeros((n, bins), dtype=np.uint8)
    smallest = np.empty(bins, dtype=np.uint32)
    mask = np.uint32(bins - 1)
    for i in range(n):
        xs = high[np.uint64(starts[i]):np.uint64(starts[i + 1])]
        # Eight permutations a pass over the set's shingles, their minima in registers (the loop
        # vectorized over the shingles); a loop over the permutations per shingle instead loads and
        # stores every minimum at each shingle, ~4-6x the CPU.
        for p in range(0, blocked, 8):
            _minima8(xs, a, b, p, sig[i])
        for p in range(blocked, perms):
            sig[i, p] = _minimum(xs, a[p], b[p])
        smallest[:] = _EMPTY
        # Unsigned indices (module doc); the minimum as `min`, no branch (~5x faster than an `if`
        # on these random values).
        for s in range(np.uint64(starts[i]), np.uint64(starts[i + 1])):
            k = np.uint64(low[s] & mask)
            smallest[k] = min(smallest[k], high[s])
        for k in range(bins):
            if smallest[k] != _EMPTY:
                sketch[i, k] = np.uint8(smallest[k] % np.uint32(255) + np.uint32(1))
    return sig, sketch


@numba.njit(inline="always")
def _minimum(xs, a, b):
    """The minimum of (a * x + b) mod 2^32 over the uint32s `xs`."""
    m = _EMPTY
    for s in range(len(xs)):
        m = min(m, np.uint32(a * xs[s] + b))
    return m


@numba.njit(inline="always")
def _minima8(xs, a, b, p, out):
    """out[p:p + 8]: the `_minimum` of permutations p .. p + 7, in one pass over `xs`."""
    a0, a1, a2, a3, a4, a5, a6, a7 = a[p], a[p + 1], a[p + 2], a[p + 3], a[p + 4], a[p + 5], a[p + 6], a[p + 7]
    b0, b1, b2, b3, b4, b5, b6, b7 = b[p], b[p + 1], b[p + 2], b[p + 3], b[p + 4], b[p + 5], b[p + 6], b[p + 7]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = _EMPTY
    for s in range(len(xs)):
        x = xs[s]
        m0 = min(m0, np.uint32(a0 * x + b0))
        m1 = min(m1, np.uint32(a1 * x + b1))
        m2 = min(m2, np.uint32(a2 * x + b2))
        m3 = min(m3, np.uint32(a3 * x + b3))
        m4 = min(m4, np.uint32(a4 * x + b4))
        m5 = min(m5, np.uint32(a5 * x + b5))
        m6 = min(m6, np.uint32(a6 * x + b6))
        m7 = min(m7, np.uint32(a7 * x + b7))
    out[p], out[p + 1], out[p + 2], out[p + 3] = m0, m1, m2, m3
    out[p + 4], out[p + 5], out[p + 6], out[p + 7] = m4, m5, m6, m7


# Character classes, as dedup.py's `_classes` numbers them.
_WORD, _SPACE = 1, 2
_ASCII_A, _ASCII_Z = 0x41, 0x5A


@numba.njit(cache=True, nogil=True, boundscheck=False)
def tokens(data, bounds, classes, lower, lowered):
    """dedup.py's `_joined_tokens` in one pass over the UTF-8 bytes `data` (texts at `bounds`):
    (words, word_bounds, bare, bare_bounds, whole) as `DedupTokens` holds the first four, words and
    bare as uint8 arrays. `classes`: the class of every code point (`dedup._classes`); with `lower`,
    ASCII letters are made lower case in both, and so is every code point below len(lowered) into
    lowered[cp] (`dedup._lowered`: an empty table leaves them as they are). `whole` is False when a
    text holds a code point Python lowers otherwise (U+0130 into two, U+03A3 by its neighbours):
    those texts are not lowered as `str.lower` would.

    A byte takes its character's class (a continuation byte its lead's); a lowered character is
    written as its lower case, in UTF-8, with that one's class. `words` keeps each word character's
    bytes and the first byte after a run of them, which becomes a space unless it is a word
    character's; `bare` keeps every byte but whitespace's."""
    size = len(data)
    # One byte more than can be kept: each byte is written, and kept by moving on past it or not
    # (no branch on the class, which changes every few bytes); lowering makes a character at most
    # half as long again (2 bytes into 3).
    capacity = size + 1 + (size // 2 if len(lowered) else 0)
    words = np.empty(capacity, dtype=np.uint8)
    bare = np.empty(capacity, dtype=np.uint8)
    word_bounds = np.empty(len(bounds), dtype=np.int64)
    bare_bounds = np.empty(len(bounds), dtype=np.int64)
    # Per ASCII byte, looked up rather than worked out at each byte, in a loop of their own (a
    # multi-byte character's bytes take the next): whether it is a word character, whether `bare`
    # keeps it, and the byte written (lower case with `lower`).
    is_word = np.empty(128, dtype=np.uint64)
    not_space = np.empty(128, dtype=np.uint64)
    cased = np.empty(128, dtype=np.uint8)
    for c in range(128):
        is_word[c] = classes[c] == _WORD
        not_space[c] = classes[c] != _SPACE
        cased[c] = c | (0x20 if lower and _ASCII_A <= c <= _ASCII_Z else 0)
    whole = True
    # Unsigned positions (module doc).
    w = np.uint64(0)
    r = np.uint64(0)
    previous_word = np.uint64(0)
    for text in range(len(bounds) - 1):
        word_bounds[text] = w
        bare_bounds[text] = r
        i = np.uint64(bounds[text])
        end = np.uint64(bounds[text + 1])
        while i < end:
            c = data[i]
            if c < 0x80:
                word = is_word[c]
                c = cased[c]
                # The end of a word run is a space.
                words[w] = c if word else np.uint8(0x20)
                w += word | previous_word
                bare[r] = c
                r += not_space[c]
                previous_word = word
                i += np.uint64(1)
                continue
            # A lead byte (the text is UTF-8), then its continuation bytes: each written as the
            # character's class says (the end of a word run a space, the lead byte only).
            code = _code_point(data, i, c)
            if code < len(lowered) and lowered[code] != code:
                whole = whole and code != 0x130 and code != 0x3A3
                code = np.uint64(lowered[code])
                cls = classes[code]
                word = np.uint64(cls == _WORD)
                keep = np.uint64(cls != _SPACE)
                length = _utf8_length(code)
                for k in range(length):
                    c = _utf8_byte(code, length, k)
                    words[w] = c if word != 0 or k > 0 else np.uint8(0x20)
                    w += word | (previous_word if k == 0 else word)
                    bare[r] = c
                    r += keep
                previous_word = word
                i += _width(data[i])
                continue
            cls = classes[code]
            word = np.uint64(cls == _WORD)
            keep = np.uint64(cls != _SPACE)
            words[w] = c if word else np.uint8(0x20)
            w += word | previous_word
            bare[r] = c
            r += keep
            previous_word = word
            i += np.uint64(1)
            while i < end and data[i] & 0xC0 == 0x80:
                c = data[i]
                words[w] = c
                w += word
                bare[r] = c
                r += keep
                i += np.uint64(1)
    word_bounds[len(bounds) - 1] = w
    bare_bounds[len(bounds) - 1] = r
    return words[:w], word_bounds, bare[:r], bare_bounds, whole


# What `dedup._record_parts` puts between a record's texts, and what `dedup._unescaped` makes spaces
# of (a backslash, then one of `ntr`).
_TURN, _THOUGHT_END, _BACKSLASH, _SPACE_BYTE = 0x1E, 0x1D, 0x5C, 0x20


@numba.njit(cache=True, nogil=True, boundscheck=False)
def record_texts(task, task_data, turns, assistant, loss, thought, thought_data, has_thought, action, action_data,
                 has_action, content, content_data):
    """dedup.py's `_unlowered_text` of each record of a staged Arrow batch, joined as `dedup._joined`
    joins them: (joined, bounds, plain). The record's `task` (offsets into `task_data`, a string
    per record), then its turns turns[i]:turns[i + 1] from its first trained assistant turn on
    (`assistant`, `loss`: per turn) with the turn markers between them: an assistant turn's thought
    and action (offsets and data; `has_thought`, `has_action`: not null), another's content; each
    text's literal escapes made spaces, a newline after each record. `plain` is False when a text
    holds an escape code (ESC, BEL: `clean_text` folds those) or a turn marker of its own: the
    batch's texts are then not what `_unlowered_text` makes of them."""
    n = len(turns) - 1
    capacity = n
    for i in range(n):
        capacity += task[i + 1] - task[i] + 4 * (turns[i + 1] - turns[i])
    capacity += thought[len(thought) - 1] - thought[0] + action[len(action) - 1] - action[0]
    capacity += content[len(content) - 1] - content[0]
    out = np.empty(capacity, dtype=np.uint8)
    bounds = np.empty(n + 1, dtype=np.int64)
    at = np.uint64(0)
    plain = True
    for i in range(n):
        bounds[i] = at
        at, ok = _unescaped_copy(task_data, task[i], task[i + 1], out, at)
        plain &= ok
        trained = False
        for t in range(turns[i], turns[i + 1]):
            if assistant[t]:
                if not trained:
                    if not loss[t]:
                        continue
                    trained = True
                out[at] = _TURN
                at += np.uint64(1)
                if has_thought[t]:
                    at, ok = _unescaped_copy(thought_data, thought[t], thought[t + 1], out, at)
                    plain &= ok
                out[at] = _THOUGHT_END
                at += np.uint64(1)
                if has_action[t]:
                    at, ok = _unescaped_copy(action_data, action[t], action[t + 1], out, at)
                    plain &= ok
            elif trained:
                out[at] = _TURN
                at += np.uint64(1)
                at, ok = _unescaped_copy(content_data, content[t], content[t + 1], out, at)
                plain &= ok
        out[at] = 0x0A
        at += np.uint64(1)
    bounds[n] = at
    return out[:at], bounds, plain


# A window of words' key (`window_hits`, `text_keys`): each word's FNV-1a hash, mixed (murmur3's
# finalizer), the words' hashes h1..hs then summed as h1 * P^(s-1) + ... + hs (mod 2^64).
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
_KEY_BASE = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(inline="always")
def _mixed(h):
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


@numba.njit(inline="always")
def _with_word(key, h):
    """The running key of a text's words after one more word, whose bytes' FNV-1a hash is `h`."""
    return key * _KEY_BASE + _mixed(h)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def text_keys(words, word_bounds):
    """The window key of all of each text's words: text i's words, each followed by a space, are
    words[word_bounds[i]:word_bounds[i + 1]] (`dedup.DedupTokens.words`)."""
    keys = np.empty(len(word_bounds) - 1, dtype=np.uint64)
    for text in range(len(keys)):
        key = np.uint64(0)
        h = _FNV_OFFSET
        for i in range(np.uint64(word_bounds[text]), np.uint64(word_bounds[text + 1])):
            c = words[i]
            if c == _SPACE_BYTE:
                key = _with_word(key, h)
                h = _FNV_OFFSET
            else:
                h = (h ^ np.uint64(c)) * _FNV_PRIME
        keys[text] = key
    return keys


@numba.njit(cache=True, nogil=True, boundscheck=False)
def window_hits(words, word_bounds, sizes, keys, key_bounds, marks):
    """Per text (as `text_keys` reads them): whether a window of sizes[k] consecutive words of it
    has a key among keys[key_bounds[k]:key_bounds[k + 1]] (sorted; `marks`, 1 << 16 bytes: 1 at
    the top 16 bits of each key, so that most windows take no search). One pass over the bytes: a
    window's key is the difference of two running keys of the text's words (the running key
    before its first word times P^size), kept for the last max(sizes) words."""
    span = np.uint64(sizes.max() + 1)
    running = np.zeros(span, dtype=np.uint64)
    powers = np.empty(len(sizes), dtype=np.uint64)
    for k in range(len(sizes)):
        powers[k] = np.uint64(1)
        for _ in range(sizes[k]):
            powers[k] *= _KEY_BASE
    hits = np.zeros(len(word_bounds) - 1, dtype=np.bool_)
    for text in range(len(hits)):
        key = np.uint64(0)
        count = np.uint64(0)
        running[0] = 0
        h = _FNV_OFFSET
        i = np.uint64(word_bounds[text])
        end = np.uint64(word_bounds[text + 1])
        while i < end:
            c = words[i]
            i += np.uint64(1)
            if c != _SPACE_BYTE:
                h = (h ^ np.uint64(c)) * _FNV_PRIME
                continue
            key = _with_word(key, h)
            h = _FNV_OFFSET
            count += np.uint64(1)
            running[count % span] = key
            for k in range(len(sizes)):
                size = np.uint64(sizes[k])
                if count >= size:
                    window = key - running[(count - size) % span] * powers[k]
                    if marks[window >> np.uint64(48)]:
                        low, high = key_bounds[k], key_bounds[k + 1]
                        at = low + np.searchsorted(keys[low:high], window)
                        if at < high and keys[at] == window:
                            hits[text] = True
                            i = end
                            break
    return hits


@numba.njit(inline="always")
def _unescaped_copy(data, start, end, out, at):
    """data[start:end] copied to out[at:] with its literal escapes (`\\n`, `\\t`, `\\r`) made spaces:
    (where the copy ends, whether it holds no escape code and no turn marker)."""
    ok = True
    i = np.uint64(start)
    stop = np.uint64(end)
    while i < stop:
        c = data[i]
        if c < 0x20 or c == _BACKSLASH:
            if c == _BACKSLASH and i + np.uint64(1) < stop:
                following = data[i + np.uint64(1)]
                if following == 0x6E or following == 0x74 or following == 0x72:
                    out[at] = _SPACE_BYTE
                    at += np.uint64(1)
                    i += np.uint64(2)
                    continue
            ok &= c != 0x1B and c != 0x07 and c != _TURN and c != _THOUGHT_END
        out[at] = c
        at += np.uint64(1)
        i += np.uint64(1)
    return at, ok


@numba.njit(cache=True, nogil=True, boundscheck=False)
def record_chars(turns, content, content_data):
    """Per record, the characters of its turns' contents (`len` of each, summed): the UTF-8 bytes
    of turns turns[i]:turns[i + 1] (offsets `content` into `content_data`, consecutive) less their
    continuation bytes."""
    n = len(turns) - 1
    chars = np.empty(n, dtype=np.int64)
    for i in range(n):
        count = 0
        for k in range(np.uint64(content[turns[i]]), np.uint64(content[turns[i + 1]])):
            count += (content_data[k] & 0xC0) != 0x80
        chars[i] = count
    return chars


@numba.njit(cache=True, nogil=True, boundscheck=False)
def shingle_views(padded, bounds, size):
    """dedup.py's `word_shingle_hashes` up to the hash, in one pass over the words: (sizes, views).
    `padded`: `DedupTokens.words` and 16 zero bytes; `bounds`: its `word_bounds` (n + 1 of them).
    sizes[t]: text t's shingles (`max(words - (size - 1), 1)`); views: (shingles, 4) uint32, each
    shingle (`size` words, or all of a shorter text's, or none of an empty one: text after text,
    word after word) as `dedup._string_views` writes its Arrow string view over `padded`."""
    texts = len(bounds) - 1
    sizes = np.empty(texts, dtype=np.int64)
    total = 0
    longest = 0
    for t in range(texts):
        n = 0
        for i in range(np.uint64(bounds[t]), np.uint64(bounds[t + 1])):
            n += padded[i] == 0x20  # every space ends a word
        sizes[t] = max(n - (size - 1), 1)
        total += sizes[t]
        longest = max(longest, bounds[t + 1] - bounds[t])
    views = np.empty((total, 4), dtype=np.uint32)
    # Where each word of the current text ends: sized to the longest text (stays in cache), one
    # more than the spaces it can hold.
    ends = np.empty(longest + 1, dtype=np.int64)
    row = np.uint64(0)
    for t in range(texts):
        start = bounds[t]
        # Each byte's position is written and kept by moving on past it at a space only: no branch
        # on the bytes (one every ~6 bytes mispredicted: ~2.5x the CPU of this function).
        n = np.uint64(0)
        for i in range(np.uint64(start), np.uint64(bounds[t + 1])):
            ends[n] = i
            n += np.uint64(padded[i] == 0x20)
        if n == 0:  # one empty shingle
            views[row] = 0
            row += np.uint64(1)
            continue
        for j in range(n - (size - 1) if n > size - 1 else 1):
            begin = start if j == 0 else ends[np.uint64(j - 1)] + 1
            _view(padded, views, row, begin, ends[np.uint64(min(j + size - 1, n - 1))] - begin)
            row += np.uint64(1)
    return sizes, views


@numba.njit(inline="always")
def _view(padded, views, row, begin, length):
    """Row `row` of `views`: the string padded[begin:begin + length] as an Arrow string view (its
    length, then itself up to 12 bytes, zeros after it; else its first 4 bytes, buffer 0, `begin`)."""
    at = np.uint64(begin)
    views[row, 0] = length
    first = _four(padded, at)
    if length > 12:
        views[row, 1] = first
        views[row, 2] = 0
        views[row, 3] = begin
    else:
        views[row, 1] = first & _mask(length)
        views[row, 2] = _four(padded, at + np.uint64(4)) & _mask(length - 4) if length > 4 else 0
        views[row, 3] = _four(padded, at + np.uint64(8)) & _mask(length - 8) if length > 8 else 0


@numba.njit(inline="always")
def _mask(length):
    """The mask of a little-endian uint32's first `length` (>= 0) bytes, all of them from 4 on."""
    return np.uint32(0xFFFFFFFF) if length >= 4 else np.uint32((1 << (8 * length)) - 1)


@numba.njit(inline="always")
def _four(padded, at):
    """The little-endian uint32 of padded[at:at + 4] (`at` unsigned)."""
    return (np.uint32(padded[at]) | np.uint32(padded[at + np.uint64(1)]) << np.uint32(8)
            | np.uint32(padded[at + np.uint64(2)]) << np.uint32(16) | np.uint32(padded[at + np.uint64(3)]) << np.uint32(24))


@numba.njit(inline="always")
def _width(lead):
    """The bytes of the UTF-8 character whose lead byte (>= 0xC0) is `lead`, unsigned."""
    return np.uint64(2) if lead < 0xE0 else (np.uint64(3) if lead < 0xF0 else np.uint64(4))


@numba.njit(inline="always")
def _utf8_length(code):
    """The bytes of code point `code` (unsigned) in UTF-8, unsigned."""
    if code < 0x80:
        return np.uint64(1)
    return np.uint64(2) if code < 0x800 else (np.uint64(3) if code < 0x10000 else np.uint64(4))


@numba.njit(inline="always")
def _utf8_byte(code, length, k):
    """Byte k of code point `code` in UTF-8 (`length` bytes; all unsigned)."""
    if length == 1:
        return np.uint8(code)
    shift = np.uint64(6) * (length - np.uint64(1) - np.uint64(k))
    if k == 0:  # 0xC0, 0xE0 or 0xF0, then the code point's high bits
        return np.uint8(((np.uint64(0xFF00) >> length) & np.uint64(0xFF)) | (code >> shift))
    return np.uint8(np.uint64(0x80) | ((code >> shift) & np.uint64(0x3F)))


@numba.njit(inline="always")
def _code_point(data, i, lead):
    """The code point of the UTF-8 character whose lead byte `lead` is data[i] (`i` unsigned), unsigned."""
    one, two, three = np.uint64(1), np.uint64(2), np.uint64(3)
    if lead < 0xE0:
        return (np.uint64(lead) & 0x1F) << 6 | (np.uint64(data[i + one]) & 0x3F)
    if lead < 0xF0:
        return ((np.uint64(lead) & 0x0F) << 12 | (np.uint64(data[i + one]) & 0x3F) << 6
                | (np.uint64(data[i + two]) & 0x3F))
    return ((np.uint64(lead) & 0x07) << 18 | (np.uint64(data[i + one]) & 0x3F) << 12
            | (np.uint64(data[i + two]) & 0x3F) << 6 | (np.uint64(data[i + three]) & 0x3F))


def warm() -> None:
    """Load the loops (from numba's cache, or compiled) now (`dedup.warm` also makes the tables
    `tokens` reads)."""
    tokens(np.frombuffer(b"a\n", dtype=np.uint8), np.array([0, 2], dtype=np.int64), np.zeros(128, dtype=np.uint8), True,
           np.zeros(1, dtype=np.uint32))
    one = np.zeros(1, dtype=np.uint32)
    signatures_and_sketches(one, one, np.array([0, 1], dtype=np.int64), one, one, 8)
    # Read-only, as `word_shingle_hashes` passes its padded bytes: the type the build's calls load.
    shingle_views(np.frombuffer(b"a " + bytes(16), dtype=np.uint8), np.array([0, 2], dtype=np.int64), 5)
    # Read-only offsets and bytes (numpy views of Arrow buffers), writable flags (Arrow's booleans
    # unpacked), as `dedup._staged_texts` and `assemble._chars` pass them.
    offsets, data, flags = np.frombuffer(bytes(8), dtype=np.int32), np.frombuffer(b"", dtype=np.uint8), np.zeros(1, bool)
    record_texts(offsets, data, offsets, flags, flags, offsets, data, flags, offsets, data, flags, offsets, data)
    record_chars(offsets, offsets, data)
    # Read-only words (`DedupTokens.words`, bytes), as `dedup.Contamination` passes them.
    bounds, keys = np.array([0, 2], dtype=np.int64), text_keys(np.frombuffer(b"a ", dtype=np.uint8), np.zeros(1, dtype=np.int64))
    window_hits(np.frombuffer(b"a ", dtype=np.uint8), bounds, np.ones(1, dtype=np.int64), keys, bounds[:1].repeat(2),
                np.zeros(1 << 16, dtype=np.uint8))
