"""Fixtures of the trainer tests: the tiny model, and torch on one thread."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: the test machines have 2 cores shared by several processes, and
    torch's default of one thread per core oversubscribes them (measured 4x slower here)."""
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(fixtures_build, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), fixtures_build)
