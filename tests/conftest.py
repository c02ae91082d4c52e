import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny llama, written once per test session (several shards + index)."""
    return make_model(tmp_path_factory.mktemp("tiny-llama"))
