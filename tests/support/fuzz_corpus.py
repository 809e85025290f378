"""A seeded generator of hostile inputs made from the real fixture rows (tests/e2e/test_fuzz.py uses it).

Every source's fixture rows are copied, given unique ids, mutated (record-level: wrong types,
roles that are dicts or lists, nesting thousands deep, unpaired surrogates, huge turns, ...),
and written in each container the sources accept (JSON Lines, JSON arrays with and without
indentation, Parquet), some files damaged as a whole (BOM, a malformed or cut element, invalid
UTF-8, NUL bytes, truncation, flipped bytes in a Parquet row group, a broken footer, zero bytes).
Files go into each source's layout (`<env>_train.json`, `<split>-00000-of-00001.parquet`,
`data/train-...`), some under two folders with the same name.

`generate(root, records, seed)` returns, per source, the folder to build and, per file (path
relative to that folder), how many records were written and whether the container still says
how many (`expected`, None when the damage hides it). Same seed, same bytes.
"""
from __future__ import annotations

import copy
import io
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.sources import get_source, iter_rows

# Replaced in the serialized text by a payload JSON cannot express as a value.
MARK = "@@FUZZ@@"
RECORDS_PER_FILE = 50


@dataclass
class FuzzFile:
    records: int
    expected: int | None
    damage: str
    # ids of records whose text carries a given payload (surrogate, deep nesting, ...)
    marked: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class FuzzSource:
    root: Path
    files: dict[str, FuzzFile] = field(default_factory=dict)


# -- record-level mutations: (row, rng) -> (row, text payload or None, tag) ---------------------

def _conv_key(row: dict) -> str:
    return "conversations" if "conversations" in row else "conversation"


def _turn(row: dict, rng: random.Random) -> dict:
    return rng.choice(row[_conv_key(row)])


def _role_key(turn: dict) -> str:
    return "from" if "from" in turn else "role"


def _text_key(turn: dict) -> str:
    return "value" if "value" in turn else "content"


def _junk(rng: random.Random):
    return rng.choice([None, 7, -1.5, True, [], {}, "", [None], {"a": [1, {"b": None}]}, "\u202e\u0301\U0001f600"])


def _replace_somewhere(value, rng: random.Random):
    """Replace one random node of a JSON tree by junk."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        value[key] = _replace_somewhere(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        value[i] = _replace_somewhere(value[i], rng)
        return value
    return _junk(rng)


def role_dict(row, rng):
    turn = _turn(row, rng)
    turn[_role_key(turn)] = {"name": "user"}
    return row, None, "role_dict"


def role_list(row, rng):
    turn = _turn(row, rng)
    turn[_role_key(turn)] = ["user", "assistant"]
    return row, None, "role_list"


def deep(row, rng):
    turn = _turn(row, rng)
    turn[_text_key(turn)] = MARK
    depth = rng.choice([1100, 5000])
    return row, "[" * depth + "1" + "]" * depth, "deep"


def surrogate(row, rng):
    turn = _turn(row, rng)
    turn[_text_key(turn)] = MARK
    return row, rng.choice(['"before \\ud800 after"', '"\\udc00"', '"a\\uDBFFb"']), "surrogate"


def wrong_type(row, rng):
    # Below the top level: a whole row that is not an object is test_bad_input's case, and a JSON
    # array reader that lost its place resumes at the next object, not at a bare value.
    key = rng.choice(sorted(row))
    row[key] = _replace_somewhere(row[key], rng)
    return row, None, "wrong_type"


def drop_key(row, rng):
    if rng.random() < 0.5:
        del row[rng.choice(sorted(row))]
    else:
        turn = _turn(row, rng)
        del turn[rng.choice(sorted(turn))]
    return row, None, "drop_key"


def extra_key(row, rng):
    _turn(row, rng)["tool_calls"] = []
    return row, None, "extra_key"


def id_type(row, rng):
    key = "id" if "id" in row else "item_id"
    row[key] = rng.choice([1.5, ["a"], {"id": 1}, None, True, "", "  "])
    return row, None, "id_type"


def conversations_text(row, rng):
    key = _conv_key(row)
    row[key] = json.dumps(row[key]) if rng.random() < 0.5 else "not json ["
    return row, None, "conversations_text"


def cut_turns(row, rng):
    key = _conv_key(row)
    row[key] = row[key][:rng.randrange(0, len(row[key]))]
    return row, None, "cut_turns"


def odd_text(row, rng):
    turn = _turn(row, rng)
    turn[_text_key(turn)] += rng.choice(["\x00", "\x1b[31mred\x1b[0m", "\u202e\u0301", "\U0001f600", "\\n" * 3, "\r\n"])
    return row, None, "odd_text"


def empty_text(row, rng):
    turn = _turn(row, rng)
    turn[_text_key(turn)] = rng.choice(["", "   ", "\n"])
    return row, None, "empty_text"


def huge_turn(row, rng):
    turn = _turn(row, rng)
    turn[_text_key(turn)] = "x" * 250_000
    return row, None, "huge_turn"


def unknown_role(row, rng):
    turn = _turn(row, rng)
    turn[_role_key(turn)] = rng.choice(["tool", "", "GPT", "function"])
    return row, None, "unknown_role"


def good(row, rng):
    return row, None, "good"


# Mutations whose result Parquet can hold in the real column types (no payload, same types).
PARQUET_MUTATIONS = [good, good, good, cut_turns, odd_text, empty_text, unknown_role, drop_key]
JSON_MUTATIONS = PARQUET_MUTATIONS + [role_dict, role_list, deep, surrogate, wrong_type, extra_key, id_type,
                                      conversations_text, huge_turn]
JSON_WEIGHTS = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0.1]


# -- serialization ---------------------------------------------------------------------------

def _element(row: dict, payload: str | None, indent: int | None) -> bytes:
    text = json.dumps(row, ensure_ascii=False, indent=indent)
    if payload is not None:
        text = text.replace(json.dumps(MARK), payload, 1)
    return text.encode("utf-8")


def _json_array(elements: list[bytes], indent: int | None) -> bytes:
    sep = b",\n" if indent else b", "
    return b"[" + sep.join(elements) + b"]"


# Damages to one element's bytes that keep the element count readable.
def _damage_element(element: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["colon", "brace", "utf8", "nul", "quote"])
    middle = len(element) // 2
    if kind == "colon":
        at = element.find(b'": ', 2)
        return element[:at] + b'"; ' + element[at + 3:], "malformed_element"
    if kind == "brace":
        at = element.rfind(b"}", 0, len(element) - 1)
        return element[:at] + element[at + 1:], "unbalanced_element"
    # Inside a string value: after the opening quote of the last long string.
    at = element.rfind(b'": "', 0, middle) + 4
    if at < 4:
        at = element.find(b'": "') + 4
    payload = {"utf8": b"\xff\xfe", "nul": b"\x00", "quote": b""}[kind]
    if kind == "quote":
        return element[:at - 1] + element[at:], "dropped_quote"
    return element[:at] + payload + element[at:], f"{kind}_in_element"


def _write_parquet(rows: list[dict], schema: pa.Schema, rng: random.Random, damage: str) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), sink, row_group_size=10, compression="zstd")
    data = bytearray(sink.getvalue())
    if damage == "flipped_row_group":
        meta = pq.read_metadata(io.BytesIO(bytes(data)))
        group = min(2, meta.num_row_groups - 1)
        column = meta.row_group(group).column(rng.randrange(meta.row_group(group).num_columns))
        start = column.data_page_offset
        for i in range(start + column.total_compressed_size // 3, start + column.total_compressed_size // 3 + 8):
            data[i] ^= 0xFF
    elif damage == "truncated_footer":
        data = data[:-rng.randrange(9, 40)]
    return bytes(data)


@dataclass
class _Layout:
    """File names in a source's own layout, per container."""
    source: str

    def name(self, split: str, container: str, n: int) -> str:
        if self.source == "agenttraj_l":
            return {"json": f"{split}_train.json", "jsonl": f"{split}_train.jsonl",
                    "parquet": f"{split}_train-00000-of-00001.parquet"}[container]
        if self.source == "openmanus_rl":
            return {"json": f"data/train-{n:05d}.json", "jsonl": f"data/train-{n:05d}.jsonl",
                    "parquet": f"data/train-{n:05d}-of-99999.parquet"}[container]
        return {"json": f"{split}.json", "jsonl": f"{split}.jsonl", "parquet": f"{split}-00000-of-00001.parquet"}[container]


def _real_rows(location: str, source: str) -> list[tuple[str, dict]]:
    """(split, row) of every readable fixture row of a source."""
    rows = []
    for file in get_source(source).files(location):
        for raw in iter_rows(file.path, file.label):
            if raw.row is not None and ("conversations" in raw.row or "conversation" in raw.row):
                rows.append((file.split, raw.row))
    return rows


def _unique_id(row: dict, n: int) -> None:
    key = "id" if "id" in row else "item_id"
    value = str(row.get(key, "row"))
    row[key] = re.sub(r"(\d+)$", lambda m: f"{m[1]}{n:06d}", value) if re.search(r"\d$", value) else f"{value}_{n}"


def generate(root: Path, sources: dict[str, str], records: int, seed: int = 0) -> dict[str, FuzzSource]:
    rng = random.Random(seed)
    per_source = max(RECORDS_PER_FILE, records // len(sources))
    result: dict[str, FuzzSource] = {}
    counter = 0
    for source, location in sorted(sources.items()):
        real = _real_rows(location, source)
        layout = _Layout(source)
        out = FuzzSource(root / source)
        written, n_file = 0, 0
        while written < per_source:
            n_file += 1
            container = rng.choice(["json", "json", "jsonl", "parquet"])
            split = rng.choice(sorted({s for s, _ in real}))
            pool = [r for s, r in real if s == split]
            count = min(RECORDS_PER_FILE, per_source - written)
            # Parquet needs one type per column: its rows come from one fixture row's shape.
            schema = None
            if container == "parquet":
                template = rng.choice(pool)
                pool = [r for r in pool if json.dumps(_shape(r)) == json.dumps(_shape(template))]
                schema = pa.Table.from_pylist([template]).schema
            rows, payloads, marked = [], [], {}
            for _ in range(count):
                counter += 1
                row = copy.deepcopy(rng.choice(pool))
                _unique_id(row, counter)
                the_id = str(row.get("id", row.get("item_id")))
                mutations = PARQUET_MUTATIONS if container == "parquet" else JSON_MUTATIONS
                weights = None if container == "parquet" else JSON_WEIGHTS
                row, payload, tag = rng.choices(mutations, weights)[0](row, rng)
                marked.setdefault(tag, []).append(the_id)
                rows.append(row)
                payloads.append(payload)
            rel = layout.name(split, container, n_file)
            # Same file names under two folders: the report must keep them apart.
            rel = f"{'ab'[n_file % 2]}/{n_file:04d}/{rel}"
            data, expected, damage = _container(container, rows, payloads, schema, rng)
            path = out.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            out.files[rel] = FuzzFile(len(rows), expected, damage, marked)
            written += count
        result[source] = out
    return result


def _shape(value):
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def _container(container: str, rows: list[dict], payloads: list[str | None], schema: pa.Schema | None,
               rng: random.Random):
    """(bytes, expected read count or None, damage name)."""
    n = len(rows)
    damage = rng.choices(["none", "bom", "element", "truncated", "empty"], [6, 2, 3, 1, 0.3])[0]
    if damage == "empty":
        return b"", 0, "empty"
    if container == "parquet":
        damage = {"element": "flipped_row_group", "truncated": "truncated_footer", "bom": "none"}.get(damage, damage)
        return _write_parquet(rows, schema, rng, damage), None if damage == "truncated_footer" else n, damage
    indent = rng.choice([None, 2]) if container == "json" else None
    elements = [_element(r, p, indent) for r, p in zip(rows, payloads)]
    # An element without a payload of its own, so that the damage decides its reason.
    plain = [i for i in range(n) if payloads[i] is None]
    if damage == "element" and plain:
        at = rng.choice(plain[:5])
        elements[at], damage = _damage_element(elements[at], rng)
    elif damage == "element":
        damage = "none"
    if container == "jsonl":
        data = b"".join(e + b"\n" for e in elements)
    else:
        data = _json_array(elements, indent)
    if damage == "bom":
        data = b"\xef\xbb\xbf" + data
    if damage == "truncated":
        return data[:len(data) * 3 // 4], None, damage
    return data, n, damage
