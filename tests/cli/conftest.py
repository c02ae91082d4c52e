"""Fixtures of the CLI-phase tests: the bad-input matrix's private checkpoint copy."""
from __future__ import annotations

from pathlib import Path

import pytest
from bad_inputs import copy_model


@pytest.fixture()
def model(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny llama (8 layers, 12 shards + index) to damage."""
    return copy_model(tiny_llama, tmp_path / "model")
