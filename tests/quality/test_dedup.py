"""Dedup and decontamination on the real fixtures: the known cross-source pairs are found, repeated
ids with different content are not merged, the duplicate map explains every drop, counts add up."""
from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.oracles import TOKEN, dedup_group, deduplicate, fold, jaccard
from tests.support.paths import FIXTURE_SOURCES
from trajforge.pipeline.build import BuildConfig, finalize, process_unit
from trajforge.pipeline.quality import dedup
from trajforge.pipeline.quality.dedup import (
    Contamination,
    DedupConfig,
    _folded,
    _task_tokens,
    _tokens,
    decontaminate,
    dedup_texts,
    exact_key,
    read_eval_tasks,
    shingle_hashes,
    shingles,
    signatures,
    word_shingle_hashes,
)
from trajforge.schemas import arrow_schema, validator
from trajforge.sources import get_source


@pytest.fixture(scope="module")
def build(fixtures_build):
    report = json.loads((fixtures_build / "report.json").read_text())
    sft = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    dups = pq.read_table(fixtures_build / "duplicates.parquet").to_pylist()
    return report, sft, dups


def test_cross_source_pairs_are_found_and_the_upstream_row_is_kept(build):
    report, sft, dups = build
    by_id = {d["id"]: d for d in dups}
    for item in ("movie_124", "sciworld_2200"):
        # The converted OpenManus-RL copies (three files hold the same rows) point at AgentTraj-L's row,
        # which has the upstream loss flags.
        copies = [d for d in dups if d["source"] == "openmanus_rl" and d["source_id"] == item]
        assert len(copies) == 3
        assert {d["kept_id"] for d in copies} == {f"agenttraj_l/{item}"}
        assert f"agenttraj_l/{item}" in {r["id"] for r in sft}
    assert by_id["openmanus_rl/todo_0"]["kept_id"] == "agenttraj_l/todo_0"  # the verl parquet's todo rows
    clusters = {c["kept_id"]: c for c in report["duplicates"]["cross_source_clusters"]}
    assert set(clusters) == {"agenttraj_l/movie_124", "agenttraj_l/sciworld_2200", "agenttraj_l/todo_0"}
    assert all(c["sources"] == ["agenttraj_l", "openmanus_rl"] for c in clusters.values())


def test_nothing_else_is_merged(build):
    report, sft, dups = build
    # Every drop is the same upstream row under another id suffix, file or mirror: same source_id.
    kept_source_id = {r["id"]: r["source_id"] for r in sft}
    assert all(kept_source_id[d["kept_id"]] == d["source_id"] for d in dups)
    assert {d["match"] for d in dups} == {"exact"}
    # The repeated maze id holds two different trajectories: both stay.
    assert {"agenttraj_l/lmrlgym_maze_18", "agenttraj_l/lmrlgym_maze_18~2"} <= {r["id"] for r in sft}
    # AgentInstruct db: db.jsonl and db-sample.parquet are the same 20 rows (17 valid: db_291, db_314
    # and db_326 are quarantined in both), ADP's content-only copy overlaps 6 of them; the rows with
    # upstream loss flags are kept.
    db = [d for d in dups if d["source"] == "agentinstruct"]
    assert Counter(d["source_file"] for d in db) == {"db.jsonl": 17, "adp_role_content/db.json": 6}
    assert all(d["kept_id"].split("/")[1].startswith("db_") for d in db)
    assert {r["loss_flags"] for r in sft if r["id"] in {d["kept_id"] for d in db}} == {"upstream"}


def test_a_published_id_is_suffixed_only_after_published_twins(build):
    """Ids are made unique after dedup: `x~n` is published only with x, x~2 ... x~(n-1), never
    because a dropped copy of x was counted (the fixtures' AgentInstruct db rows in three files)."""
    report, sft, dups = build
    published = {r["id"] for r in sft}
    for record_id in published:
        base, _, n = record_id.rpartition("~")
        if base and n.isdigit():
            assert {base, *(f"{base}~{k}" for k in range(2, int(n)))} <= published, record_id
    assert "agenttraj_l/lmrlgym_maze_18~2" in published  # two different trajectories, both kept
    # The kept db rows (the copies with loss flags) have the plain ids; their dropped copies the suffixes.
    db_35 = [d for d in dups if d["source_id"] == "db_35"]
    assert {d["kept_id"] for d in db_35} == {"agentinstruct/db_35"} and "agentinstruct/db_35" in published
    assert {d["id"] for d in db_35} == {"agentinstruct/db_35~2", "agentinstruct/db_35~3"}


def test_duplicate_map_explains_every_drop_and_counts_add_up(build):
    report, sft, dups = build
    kept = {r["id"] for r in sft}
    assert all(d["kept_id"] in kept and d["id"] not in kept for d in dups)
    assert len({d["id"] for d in dups}) == len(dups)
    for row in dups:
        assert not list(validator("duplicates").iter_errors(row))
    total = report["total"]
    assert total["read"] == total["written"] + total["quarantined"] + total["duplicates"]
    for name, entry in report["sources"].items():
        assert entry["read"] == entry["written"] + entry["quarantined"] + entry["duplicates"], name
        for file, counts in entry["files"].items():
            assert counts["read"] == counts["written"] + counts["quarantined"] + counts["duplicates"], file
    assert len(sft) == total["written"] and len(dups) == total["duplicates"]
    assert report["duplicates"]["by_source"] == dict(Counter(d["source"] for d in dups))


def test_dedup_is_deterministic_and_the_preference_does_not_depend_on_order(merged):
    assert deduplicate(merged) == deduplicate(merged)
    kept, dups = deduplicate(merged)
    kept2, dups2 = deduplicate(list(reversed(merged)))
    # Build order only breaks ties between equally preferred rows (same source, same loss flags).
    describe = lambda rows: Counter((r["source"], r["source_id"], r["loss_flags"]) for r in rows)  # noqa: E731
    assert describe(kept) == describe(kept2)
    assert len(dups) == len(dups2)


def test_near_duplicate_of_a_reworded_row_is_found(merged):
    original = next(r for r in merged if r["id"] == "agenttraj_l/sciworld_2200")
    turns = [dict(t) for t in original["conversations"]]
    first = next(i for i, t in enumerate(turns) if t["role"] == "assistant" and t["loss"])
    turns[first] = {**turns[first], "thought": turns[first]["thought"] + " Let me be careful here."}
    edited = {**original, "id": "synthetic/sciworld_2200_edit", "source": "synthetic", "conversations": turns}
    edited_text, original_text = dedup_texts([edited, original])
    assert exact_key(dedup_group(edited), edited_text) != exact_key(dedup_group(original), original_text)
    kept, dups = deduplicate([original, edited], DedupConfig(threshold=0.8))
    assert [d["id"] for d in dups] == [edited["id"]]
    assert dups[0]["match"] == "near" and 0.8 <= dups[0]["similarity"] < 1
    assert deduplicate([original, edited], DedupConfig(near=False))[1] == []


@pytest.mark.parametrize("backend", ["numpy", "datasketch"])
def test_signature_estimates_jaccard(backend):
    sets = [shingles(t.split(), 3) for t in
            ("a b c d e f g h i j k l m n o p", "a b c d e f g h i j k l m n o q", "z y x w v u t s")]
    sig = signatures(sets, DedupConfig(backend=backend, num_perm=256))
    estimate = (sig[0] == sig[1]).mean()
    assert abs(estimate - jaccard(sets[0], sets[1])) < 0.15
    assert (sig[0] == sig[2]).mean() < 0.1


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_word_shingle_hashes_are_those_of_the_shingle_strings(monkeypatch, compiled_from):
    """Per text, the hashes of its `shingles` (as `shingle_hashes` makes them of the strings): no
    words, fewer than a shingle, exactly one, many; shingles within 12 bytes and longer, multi-byte
    words; the views made in the compiled pass and in numpy."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    rng = random.Random(2)
    vocab = ["a", "bb", "δέλτα", "x_1", "2", "е\u0301", "longerword", "日本語"]
    words = [" ".join(rng.choice(vocab) for _ in range(n)) for n in [0, 1, 2, 4, 5, 6, 0, 30, *range(12)] * 5]
    for batch in (words, words[4:5], words[:2], ["a b c"]):  # and batches of fewer words than a shingle
        for size in (1, 5):
            texts = [f"{w} ".encode() if w else b"" for w in batch]  # as `DedupTokens.words` holds them
            sizes, hashed = word_shingle_hashes(b"".join(texts), np.cumsum([0, *map(len, texts)]), size, seed=3)
            expected_sizes, expected = shingle_hashes([shingles(w.split(), size) for w in batch], seed=3)
            assert [set(part.tolist()) for part in np.split(hashed, np.cumsum(sizes)[:-1])] == \
                [set(part.tolist()) for part in np.split(expected, np.cumsum(expected_sizes)[:-1])]


def test_word_shingle_hashes_are_the_same_compiled_and_in_numpy(monkeypatch):
    """The same sizes and hashes, in the same order, whichever makes the views: texts without words,
    shorter than a shingle, words of 1 to 40 bytes (views within 12 bytes and longer)."""
    rng = random.Random(5)
    vocab = ["a", "bb", "ccc", "dddd", "eeeee", "f" * 12, "g" * 13, "é", "日本", "x" * 40]
    for _ in range(200):
        texts = [b"".join(f"{rng.choice(vocab)} ".encode() for _ in range(rng.choice([0, 1, 2, 4, 5, 6, 9, 20])))
                 for _ in range(rng.randint(0, 8))]
        words, bounds = b"".join(texts), np.cumsum([0, *map(len, texts)])
        for size in (1, 2, 5):
            made = []
            for compiled_from in (0, 1 << 62):
                monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
                made.append(word_shingle_hashes(words, bounds, size, seed=3))
            assert np.array_equal(made[0][0], made[1][0]) and np.array_equal(made[0][1], made[1][1])


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        DedupConfig(threshold=0)
    with pytest.raises(ValueError):
        DedupConfig(bands=20, rows=10)
    with pytest.raises(ValueError):
        DedupConfig(bands=4, rows=None)


def test_decontamination_quarantines_overlapping_tasks(tmp_path, fixtures_build):
    sft = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    target = next(r for r in sft if r["id"] == "agenttraj_l/webshop_1418")
    tasks = tmp_path / "eval_tasks.txt"
    # An evaluation task that embeds the row's task in other words, and an unrelated short one.
    tasks.write_text(f"Eval: {target['task'].upper()}  (test split)\nbuy a hat\n")
    index = Contamination(read_eval_tasks(tasks), n=8)
    clean, removed = decontaminate(sft, index)
    assert [r["id"] for r, _ in removed] == [target["id"]]
    assert len(clean) == len(sft) - 1

    staging = tmp_path / "staging"
    units = [process_unit(name, f, staging, BuildConfig())
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    out = tmp_path / "out"
    report = finalize(units, out, replace(BuildConfig(), decontaminate=str(tasks)))
    quarantine = pq.read_table(out / "quarantine" / "quarantine.parquet").to_pylist()
    [entry] = [q for q in quarantine if q["reason"] == "contaminated"]
    assert entry["source_id"] == "webshop_1418" and "evaluation task #0" in entry["detail"]
    total = report["total"]
    assert total["reasons"]["contaminated"] == 1
    assert total["read"] == total["written"] + total["quarantined"] + total["duplicates"]
    assert target["id"] not in {r["id"] for r in pq.read_table(out / "data" / "sft").to_pylist()}


def test_eval_task_files_in_json_forms(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(["task one here", {"task": "task two"}]))
    (tmp_path / "b.jsonl").write_text('{"instruction": "task three"}\n"task four"\n')
    assert read_eval_tasks(tmp_path / "a.json") == ["task one here", "task two"]
    assert read_eval_tasks(tmp_path / "b.jsonl") == ["task three", "task four"]


def test_keep_rank_is_stated_by_every_source():
    from trajforge.sources import REGISTRY, KeepRank, Source, keep_rank

    assert {name: keep_rank(name) for name in REGISTRY} == {
        "agentinstruct": KeepRank.ORIGINAL, "agent_flan": KeepRank.ORIGINAL, "agenttraj_l": KeepRank.ORIGINAL,
        "openmanus_rl": KeepRank.RE_RELEASE, "synthetic": KeepRank.SYNTHETIC}
    with pytest.raises(TypeError, match="must state its keep_rank"):
        type("Unranked", (Source,), {"name": "unranked"})


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_dedup_texts_tokenize_as_fold_does_on_every_kind_of_text(monkeypatch, compiled_from):
    """Both tokenizers (the compiled loop, numpy) split every text as `fold` (Python's `re`) does,
    whatever the code points (marks, numerals, separators, the turn markers' own characters inside a
    text), turn by turn."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    rng = random.Random(0)
    alphabet = ([chr(c) for c in range(128)] + list("éİ²–ﬁΣ\u0301\u00a0\u2028\u0660\u203f\u180e\u3000") + ["\\n", "\\", "\x1b[1m"]
                + [chr(rng.choice([rng.randrange(0x80, 0x3000), rng.randrange(0xE000, 0x110000)])) for _ in range(300)])

    def text():
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))

    records = []
    for _ in range(1500):
        turns = [{"role": "user", "content": text(), "loss": False}]
        for _ in range(rng.randint(0, 3)):
            turns += [{"role": "assistant", "content": "", "thought": rng.choice([None, text()]), "action": text(),
                       "loss": True}, {"role": "user", "content": text(), "loss": False}]
        records.append({"task": text(), "conversations": turns})
    for record, found in zip(records, dedup_texts(records)):
        tokens = fold(record["task"])
        for turn in record["conversations"][1:]:
            tokens += ["\x1e", *(fold(turn["thought"] or "") + ["\x1d"] + fold(turn["action"])
                                  if turn["role"] == "assistant" else fold(turn["content"]))]
        assert found.bare == "".join(tokens)
        assert found.words == " ".join(t for t in tokens if re.fullmatch(r"\w+", t))


def test_staged_records_join_the_texts_of_their_dicts():
    """The texts of staged records, joined from their Arrow buffers (keys_kernel.record_texts), are
    `_unlowered_text`'s of their dicts, joined as `_joined` joins them (record after record, over
    several record batches too); or None where a text holds what only the dicts' path folds (an
    escape code, a turn marker of its own)."""
    rng = random.Random(1)
    alphabet = ([chr(c) for c in range(32, 128)] + list("éİ²–ﬁΣ\u00a0\u3000\n\t")
                + ["\\n", "\\t", "\\r", "\\x", "\\", "\\\\n"])

    def text():
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))

    def record():
        turns = [{"role": "user", "content": text(), "loss": False}]
        for _ in range(rng.randint(0, 4)):
            turns += [{"role": "assistant", "content": text(), "thought": rng.choice([None, text()]),
                       "action": rng.choice([None, text()]), "loss": rng.random() < 0.7},
                      {"role": rng.choice(["user", "tool"]), "content": text(), "loss": False}]
        return {"task": text(), "conversations": turns}

    schema = arrow_schema("trajectory")
    schema = pa.schema([schema.field("task"), schema.field("conversations")])
    for inside in ["", "\x1b", "\x07", "\x1e", "\x1d"]:
        records = [record() for _ in range(300)]
        if inside:
            records[7]["task"] += inside
        staged = pa.concat_tables([pa.Table.from_pylist(records[:100], schema=schema),
                                   pa.Table.from_pylist(records[100:], schema=schema)])
        found = dedup._staged_texts(staged)
        if inside:
            assert found is None
            continue
        joined, bounds = dedup._joined([dedup._unlowered_text(r)[0] for r in records])
        assert found[0].tobytes() == joined and found[1].tolist() == bounds


def test_exact_key_is_equal_exactly_when_the_tokens_are():
    """The key is taken of the words and the text without whitespace: equal for the same tokens
    however spaced, different where only the split of a word run or the punctuation differs."""
    tasks = ["Go to (a b) , now", "go to(a   b),now", "go to (ab), now", "go to a b now", "go\nto ( a b ) ,now"]
    texts = dedup_texts([{"task": task, "conversations": []} for task in tasks])
    keys = [exact_key("positive:", text) for text in texts]
    assert [[re.findall(r"\w+|[^\w\s]", t.lower()) == re.findall(r"\w+|[^\w\s]", u.lower()) for u in tasks]
            for t in tasks] == [[a == b for b in keys] for a in keys]
    assert len(set(keys)) == 3


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_tokens_are_those_of_re_on_every_code_point(monkeypatch, compiled_from):
    """Each code point between two letters: one word with them, a space, or a token of its own,
    as Python's `re` decides (the turn markers, always tokens, aside), in the build's tokens (the
    compiled loop or numpy over UTF-8 bytes) and in the decontamination's words (the same tokens, of
    the folded text)."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    every = "".join(f"a{chr(c)}b" for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and chr(c) not in "\x1d\x1e")
    found = _tokens([every, "", every[:999]]).text(0)
    assert found.bare == "".join(TOKEN.findall(every))
    assert found.words == " ".join(re.findall(r"\w+", every))
    assert _task_tokens([every]).word_text(0) == " ".join(re.findall(r"\w+", _folded(every)))


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_every_code_point_is_lowered_as_str_lower_does(monkeypatch, compiled_from):
    """Records whose texts hold every code point between two capitals: the compiled loop lowers
    them itself (`_lowered`), numpy's caller by `str.lower`; a batch with U+0130 or U+03A3 in a text
    (which `str.lower` lowers into two, or as its neighbours say) is lowered by `str.lower` in
    either. The tokens are `fold`'s."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    every = [chr(c) for c in range(0x80, 0x110000) if not 0xD800 <= c <= 0xDFFF and c not in (0x130, 0x3A3)]
    texts = ["".join(f"A{c}B" for c in every[start:start + 20_000]) for start in range(0, len(every), 20_000)]
    for special in ([], ["\u0130 ΑΣ Σ. aΣb"]):
        records = [{"task": text, "conversations": []} for text in texts + special]
        for record, found in zip(records, dedup_texts(records)):
            tokens = fold(record["task"])
            assert found.bare == "".join(tokens)
            assert found.words == " ".join(t for t in tokens if re.fullmatch(r"\w+", t))


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_ascii_tokens_are_those_of_re_on_every_ascii_code_point(monkeypatch, compiled_from):
    """An ASCII text (read by bytes.translate in numpy): each ASCII code point between two letters is
    one word with them, a space, or a token of its own, as Python's `re` decides."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    every = "".join(f"a{chr(c)}b" for c in range(128) if chr(c) not in "\x1d\x1e")
    for text in (every, f"  {every} \t"):
        [found] = dedup_texts([{"task": text, "conversations": []}])
        assert found.bare == "".join(fold(text))
        assert found.words == " ".join(t for t in fold(text) if re.fullmatch(r"\w+", t))


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "every text"])
def test_contamination_reports_the_first_overlap_a_scan_of_re_words_finds(monkeypatch, compiled_from):
    """Each text's first n-gram hit (then the whole short tasks, shortest first), as a plain scan
    of Python's `re` words over the folded texts finds it, with misses and non-ASCII words: of the
    texts the compiled pass finds a window with an entry's key in, or of every text; from strings
    and from an Arrow string array (a staged batch's tasks, read from its buffers unless a text
    holds an escape code or a turn marker)."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    rng = random.Random(1)
    vocab = ["alpha", "Beta", "gamma", "δέλτα", "x_1", "2", "e\u0301", "²"]

    def text(words: int) -> str:
        return "".join(rng.choice(vocab) + rng.choice([" ", ", ", "\u3000", "-", "\x1e"]) for _ in range(words))

    evals = [text(rng.randint(0, 9)) for _ in range(40)]
    texts = [text(rng.randint(0, 30)) for _ in range(400)]

    def words(t: str) -> tuple[str, ...]:
        return tuple(re.findall(r"\w+", t.lower()))

    grams: dict = {}
    short: dict = {}
    for i, task in enumerate(evals):
        w = words(task)
        if 0 < len(w) < 4:
            short.setdefault(len(w), {}).setdefault(w, i)
        for k in range(len(w) - 3):
            grams.setdefault(w[k:k + 4], i)

    def first_hit(t: str):
        w = words(t)
        for size, table in [(4, grams), *sorted(short.items())]:
            for k in range(len(w) - size + 1):
                if w[k:k + size] in table:
                    return table[w[k:k + size]], " ".join(w[k:k + size])
        return None

    expected = [first_hit(t) for t in texts]
    assert 0 < sum(hit is not None for hit in expected) < len(texts)
    index = Contamination(evals, n=4)
    assert index.matches(texts) == expected
    # The staged path takes no marker: the same words with literal escapes (spaces) for them.
    plain = [t.replace("\x1e", "\\t") + "\\n" for t in texts]
    assert sum("\\t" in t for t in plain) > len(plain) // 2
    assert index.matches(pa.array(plain)) == expected == index.matches(plain)
    assert index.matches(pa.array(texts)) == index.matches(texts)
