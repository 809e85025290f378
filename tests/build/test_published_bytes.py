"""The fixture build's published files against their sha256 digests as they last changed on purpose.

A change to the build's speed keeps every published byte (docs/scale.md); this names each file a
change altered. A change that alters them on purpose records them again: `python
bench/profile_build.py fixtures --work DIR`, then `python bench/build_digest.py DIR/build >
tests/build/fixtures_build_digest.json`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.build_digest import comparison, differing, digests
from tests.support.paths import FIXTURES, REPO

KEPT = Path(__file__).with_name("fixtures_build_digest.json")


def test_fixture_build_publishes_the_kept_bytes(fixtures_build):
    if FIXTURES.resolve() != (REPO / "tests" / "fixtures").resolve():
        pytest.skip(f"TRAJFORGE_FIXTURES is {FIXTURES}: the kept digests are of tests/fixtures' records")
    found, kept = digests(fixtures_build), json.loads(KEPT.read_text())
    assert not differing(found, kept), "\n".join(comparison(found, kept))


def test_a_changed_byte_is_named(fixtures_build):
    """The comparison names the file whose bytes changed, or that one build lacks, and only it."""
    found = digests(fixtures_build)
    shard = next(rel for rel in sorted(found) if rel.endswith(".parquet"))
    altered = {**found, shard: "0" * 64}
    lacking = {rel: digest for rel, digest in found.items() if rel != shard}
    for other in (altered, lacking):
        assert differing(other, found) == [shard]
        assert comparison(other, found)[-1] == f"{len(found) - 1} of {len(found)} files identical"
