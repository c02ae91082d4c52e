"""pploader's DCP reader on 2 GPUs over NCCL (``pytest -m gpu``; skipped without 2 GPUs): the
example of test_dcp.py with CUDA destinations (the pinned-ring backend straight into DTensor
local shards on the device), PP=2 and TP=2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import run_ranks
from test_dcp import CONFIG, example

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dcp-llama-gpu")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(
        out, max_shard_size="300KB")
    return out


def _rank(rank: int, world: int, model_dir: str, pp: int, tp: int) -> dict:
    return example().run(model_dir, pp=pp, tp=tp, device="cuda", check=True)


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_dcp_load_on_gpus(llama: Path, pp: int, tp: int) -> None:
    results = run_ranks(_rank, 2, str(llama), pp, tp, backend="nccl", timeout_s=240)
    for r, res in enumerate(results):
        assert res["bitwise_equal"], f"rank {r} differs from torch's HuggingFaceStorageReader"
        assert res["read_bytes"] == res["local_bytes"], res
        assert res["devices"] == [f"cuda:{r}"], res
    last = results[-1]
    assert last["max_abs_diff"] <= 1e-4, last
