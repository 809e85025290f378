"""Where the tests' inputs are: the repository, the real upstream records in tests/fixtures
(provenance in its README), and the fixture build's sources."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("TRAJFORGE_FIXTURES", REPO / "tests" / "fixtures"))
RAW = FIXTURES / "raw"
# Agent-FLAN rows we wrote in the upstream layout (no raw rows are public in reach).
AGENT_FLAN = FIXTURES / "agent_flan"

# The build over all real fixture records: source name -> folder in the upstream layout.
FIXTURE_SOURCES = {
    "agentinstruct": str(RAW / "agentinstruct"),
    "agenttraj_l": str(RAW / "agenttraj_l"),
    "openmanus_rl": str(RAW / "openmanus_rl"),
}
