"""A torch-native PP x TP job filled by ``dcp.load`` with pploader's storage reader.

A Hugging Face llama (``save_pretrained`` directory) is split into PP stages with
``torch.distributed.pipelining``; each stage's module is made TP with DTensor
(``parallelize_module``: ColwiseParallel / RowwiseParallel) on a (pp, tp) ``DeviceMesh``; its
state dict (DTensor local shards) is filled by
``dcp.load(state_dict, storage_reader=PPLoaderStorageReader(model_dir))``; then a GPipe
schedule runs a forward. With ``--check`` every rank also loads the same state dict with
torch's ``HuggingFaceStorageReader`` (must be bitwise equal) and the last stage compares the
schedule's logits with a single-process transformers forward::

    python -m torch.distributed.run --standalone --nproc_per_node=4 \\
        docs/examples/dcp_pipeline_tp.py MODEL_DIR --pp 2 --tp 2 --check          # CPU, gloo
    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        docs/examples/dcp_pipeline_tp.py MODEL_DIR --pp 2 --tp 1 --device cuda --check  # NCCL
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from pploader.integrations.dcp import PPLoaderStorageReader
from pploader.planning.mesh import mesh_topology, pipeline_window
from pploader.report import proc_io


class LlamaStage(nn.Module):
    """Layers ``[start, end)`` of a transformers llama, keeping its state-dict names
    (``model.layers.{i}...``: the checkpoint's names, as DCP's HF keys are)."""

    def __init__(self, full: nn.Module, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = full.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i]
                                           for i in range(start, end)})
        self.model.norm = full.model.norm if last else None
        self.lm_head = full.lm_head if last else None
        self.rotary = full.model.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary(h, positions)
        for layer in self.model.layers.values():  # no mask: sdpa's causal attention
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        if self.lm_head is None:
            return h
        return self.lm_head(self.model.norm(h))


def tp_plan(stage: LlamaStage) -> dict[str, Any]:
    """Megatron-style TP: q/k/v/gate/up column-parallel (dim 0), o/down row-parallel (dim 1,
    strided reads), vocab-parallel embedding and head."""
    plan: dict[str, Any] = {}
    for i in stage.model.layers:
        pre = f"model.layers.{i}."
        plan.update({pre + n: ColwiseParallel() for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")})
        plan.update({pre + n: RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")})
    if stage.model.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if stage.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def build_stage(config: Any, mesh: DeviceMesh, device: torch.device) -> LlamaStage:
    """This rank's stage: built on the meta device, made TP, then given (empty) storage."""
    import transformers
    pp_rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    n = config.num_hidden_layers
    start, end = pp_rank * n // pp, (pp_rank + 1) * n // pp
    with torch.device("meta"):
        full = transformers.LlamaForCausalLM(config)
    stage = LlamaStage(full, start, end, pp_rank == 0, pp_rank == pp - 1)
    if mesh["tp"].size() > 1:
        parallelize_module(stage, mesh["tp"], tp_plan(stage))
    stage.to_empty(device=device)
    stage.rotary = type(full.model.rotary_emb)(config).to(device)  # its buffer is computed
    return stage.eval()


def local_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of this rank's shards of ``state`` (a DTensor's local tensor)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in state.values())


def fresh_state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of ``stage``'s layout (DTensors on its mesh), filled with NaN: every value
    that is not loaded shows."""
    out = {}
    for k, t in stage.state_dict().items():
        if isinstance(t, DTensor):
            out[k] = DTensor.from_local(torch.full_like(t.to_local(), float("nan")),
                                        t.device_mesh, t.placements, run_check=False,
                                        shape=t.shape, stride=t.stride())
        else:
            out[k] = torch.full_like(t, float("nan"))
    return out


def run(model_dir: str, *, pp: int, tp: int, device: str = "cpu", check: bool = False,
        tokens: int = 8, microbatches: int = 2, threads: Optional[int] = None) -> dict[str, Any]:
    """The job on this rank; returns what it measured (the test asserts on it)."""
    import transformers
    rank = dist.get_rank()
    dev = torch.device(device, rank % torch.cuda.device_count()) if device == "cuda" \
        else torch.device(device)
    mesh = init_device_mesh(device, (pp, tp), mesh_dim_names=("pp", "tp"))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    stage_mod = build_stage(config, mesh, dev)
    reader = PPLoaderStorageReader(model_dir, topology=mesh_topology(mesh), threads=threads,
                                   staging_device=dev if dev.type == "cuda" else None)
    state = stage_mod.state_dict()
    dist.barrier()
    io0, t0 = proc_io(), time.perf_counter()
    dcp.load(state, storage_reader=reader)
    seconds, io1 = time.perf_counter() - t0, proc_io()
    stage = PipelineStage(stage_mod, mesh["pp"].get_local_rank(), pp, dev,
                          group=mesh["pp"].get_group())
    layers = [int(i) for i in stage_mod.model.layers]
    out: dict[str, Any] = {
        "rank": rank, "topology": reader.topology, "window": pipeline_window(stage, layers),
        "local_bytes": local_bytes(state), "read_bytes": reader.read_bytes,
        "header_bytes": reader.header_bytes, "seconds": seconds,
        "devices": sorted({str(_local_raw(t).device) for t in state.values()}),
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "storage_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)}
    if check:
        torch_state = fresh_state(stage_mod)
        dcp.load(torch_state, storage_reader=dcp.HuggingFaceStorageReader(model_dir))
        out["bitwise_equal"] = all(
            torch.equal(_local(state[k]).view(torch.uint8), _local(v).view(torch.uint8))
            for k, v in torch_state.items())
    ids = torch.randint(0, config.vocab_size, (microbatches, tokens),
                        generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        if pp == 1:  # one stage: nothing to pipeline
            logits = stage_mod(ids)
        else:
            schedule = ScheduleGPipe(stage, n_microbatches=microbatches)
            logits = schedule.step(ids) if stage.is_first else schedule.step()
    if stage.is_last and check:
        ref = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=config.dtype)
        with torch.no_grad():
            want = ref.eval()(input_ids=ids.cpu(), use_cache=False).logits
        out["max_abs_diff"] = (logits.float().cpu() - want.float()).abs().max().item()
    return out


def _local_raw(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return _local_raw(t).contiguous().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--check", action="store_true",
                        help="compare with torch's HF reader and single-process transformers")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    try:
        res = run(args.model_dir, pp=args.pp, tp=args.tp, device=args.device, check=args.check)
        print({k: v for k, v in res.items()}, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
