"""Zamba2's shared-block LoRA adapters: a stage reads only the adapters of its own hybrid
layers.

The shared transformer block holds one adapter per hybrid layer
(``feed_forward.gate_up_proj_adapter_list.{k}``, ``self_attn.linear_{q,k,v}_adapter_list.{k}``)
and the k-th hybrid layer runs entry k only; the block is stored once, in the first hybrid
layer of each shared block, and tied into the later ones. The reference here comes from the
config alone (``hybrid_layer_ids``: entry k for the k-th hybrid layer, stored under the first
hybrid layer of block ``k % num_mem_blocks``): per stage, exactly those adapters, under the
names of the layers that run them, bitwise equal to the stored tensors; no other adapter.
Before, every stage holding a hybrid layer read every hybrid layer's adapters (PP=3: stage 2,
running only layer 4 with adapter 1, read adapter 0 too).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

transformers = pytest.importorskip("transformers")
_ADAPTER = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.(.+_adapter_list)\.(\d+)\.(.+)$")


def _zamba2(path: Path, types: list[str], mem_blocks: int) -> list[int]:
    config = generic_sweep.model_config(generic_sweep.tiny_config("zamba2"),
                                        transformers.Zamba2ForCausalLM)
    config.num_hidden_layers, config.num_mem_blocks = len(types), mem_blocks
    config.layers_block_type = types
    config.hybrid_layer_ids = [i for i, t in enumerate(types) if t == "hybrid"]
    config.use_shared_attention_adapter = True
    config.architectures = ["Zamba2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Zamba2ForCausalLM._from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, max_shard_size="40KB")
    return list(config.hybrid_layer_ids)


@pytest.mark.parametrize("types,mem_blocks,pps", [
    (["linear_attention", "hybrid", "linear_attention", "linear_attention", "hybrid",
      "linear_attention"], 1, (1, 2, 3, 6)),
    (["hybrid", "linear_attention", "hybrid", "hybrid", "linear_attention", "hybrid"], 2,
     (1, 2, 3, 6))])
def test_each_stage_reads_only_its_hybrid_layers_adapters(types: list[str], mem_blocks: int,
                                                          pps: tuple[int, ...],
                                                          tmp_path: Path) -> None:
    hybrid = _zamba2(tmp_path, types, mem_blocks)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    stored = {n for n in index.weight_map if _ADAPTER.match(n)}
    assert stored
    for pp in pps:
        for plan in plan_all(spec, index, pp):
            w = plan.window
            want: dict[str, str] = {}  # target -> stored source, from the config alone
            for k, layer in enumerate(hybrid):
                if not w.start_layer <= layer < w.end_layer:
                    continue
                home = hybrid[k % mem_blocks]  # the block's first hybrid layer stores it
                for name in stored:
                    m = _ADAPTER.match(name)
                    assert m is not None
                    if int(m.group(1)) == home and int(m.group(3)) == k:
                        want[f"model.layers.{layer}.shared_transformer.{m.group(2)}.{k}."
                             f"{m.group(4)}"] = name
            got = {i.target: i.name for i in plan.items if _ADAPTER.match(i.target)}
            assert got == want, (pp, w.pp_rank)
            assert not {i.name for i in plan.items if i.name in stored} - set(want.values())
            tensors = dict(Reader(plan))
            for target, source in want.items():
                assert torch.equal(tensors[target], ref[source]), (pp, target)
    if 3 in pps:  # every stored adapter read by exactly one stage at PP=3
        readers: dict[str, int] = {}
        for plan in plan_all(spec, index, 3):
            for i in plan.items:
                if i.name in stored:
                    readers[i.name] = readers.get(i.name, 0) + 1
        assert readers == dict.fromkeys(stored, 1)
