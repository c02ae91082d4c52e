import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the CLI keeps the generic family's derived structures under PPLOADER_CACHE_DIR: the tests'
# runs (in process and in their subprocesses) keep them in a directory of their own
os.environ.setdefault("PPLOADER_CACHE_DIR", tempfile.mkdtemp(prefix="pploader-test-cache-"))

from helpers import make_model, reference_tensors, tiny_config  # noqa: E402

if TYPE_CHECKING:
    from family_table import HfCheckpoints


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny llama, written once per test session (several shards + index)."""
    return make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> "HfCheckpoints":
    """The family table's checkpoints written by transformers' ``save_pretrained`` (by case id
    and naming), each built on first use."""
    from family_table import HfCheckpoints
    return HfCheckpoints(tmp_path_factory.mktemp("hf-families"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``make-tiny`` checkpoints of the bundled configs, by stem (``tiny-bamba``), each
    written on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_model(tmp_path_factory.mktemp(name), tiny_config(name))
        return made[name]
    return get


@pytest.fixture(scope="session")
def references() -> Callable[[Path], dict[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory through ``safe_open``, read once per session."""
    cache: dict[Path, dict[str, torch.Tensor]] = {}

    def get(path: Path) -> dict[str, torch.Tensor]:
        if path not in cache:
            cache[path] = reference_tensors(path)
        return cache[path]
    return get
