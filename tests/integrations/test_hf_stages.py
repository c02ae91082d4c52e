"""Pipeline stages of transformers models whose layout is not "embedding beside the layer list,
hidden states between layers" (``pploader.integrations.hf`` + ``hf_boundary``).

- BERT-style ``*LMHeadModel``: the embedding lives in ``bert.embeddings`` (with positions,
  token types and a LayerNorm), the layers in ``bert.encoder.layer``, the head in ``cls``;
- HY-V4: layers thread state besides the hidden states (DSA top-k indices of a previous
  layer) and the hidden states carry an extra hyper-connection dimension;
- Dory: the model loops over a block of layers; a boundary outside the loop works, one inside
  it is refused;
- the wire format of a stage boundary (send / recv through a Comm-like object).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import generic_sweep
from pploader.errors import PPLoaderError
from pploader.integrations.hf import HFStage, StageBoundary, build_stage
from pploader.integrations.hf_boundary import recv_boundary, send_boundary
from pploader.planning.partition import StageWindow
from pploader.planning.topology import Topology


@pytest.fixture(scope="module", autouse=True)
def quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _save(config: Any, arch: str, out: Path) -> Path:
    import transformers
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)._from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def _reference(path: Path) -> torch.Tensor:
    import transformers
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def _stages(path: Path, windows: Any = None) -> list[HFStage]:
    return [build_stage(path, Topology(2, rank=r), window=None if windows is None else windows[r])
            for r in range(2)]


def _materialised(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if not p.is_meta)


def test_bert_style_stages_match_transformers(tmp_path: Path) -> None:
    path = _save(generic_sweep.tiny_config("bert"), "BertLMHeadModel", tmp_path / "bert")
    first, last = _stages(path)
    boundary = first.forward(IDS)
    assert isinstance(boundary, StageBoundary) and boundary.layer == 2
    assert torch.equal(last.forward(IDS, boundary), _reference(path))
    # the embedding block lives on stage 0 only, the prediction head on stage 1 only
    assert _materialised(first.model.bert.embeddings.word_embeddings) > 0
    assert _materialised(last.model.bert.embeddings.word_embeddings) == 0
    assert _materialised(first.model.cls) == 0 and _materialised(last.model.cls) > 0
    with pytest.raises(ValueError, match="boundary must be given"):
        last.forward(IDS)


def test_state_threaded_through_layers_crosses_the_boundary(tmp_path: Path) -> None:
    """HY-V4's layer 2 reuses layer 1's DSA top-k indices (``prev_topk_indices``): a
    hidden-states-only boundary cannot run stage 1 ("Shared DSA layers require top-k
    indices"); the captured inputs carry them."""
    path = _save(generic_sweep.tiny_config("hy_v4"), "HYV4ForCausalLM", tmp_path / "hy_v4")
    first, last = _stages(path)
    boundary = first.forward(IDS)
    assert isinstance(boundary, StageBoundary)
    layout = json.loads(boundary.layout)
    kwargs = dict(layout["kwargs"]["dict"])
    assert "t" in kwargs["prev_topk_indices"]  # a tensor, sent
    hidden = boundary.tensors[layout["args"]["list"][0]["t"]]
    assert hidden.dim() == 4  # [batch, tokens, hc streams, hidden]
    assert torch.equal(last.forward(IDS, boundary), _reference(path))


def test_layer_loop_inside_a_stage_works_and_across_a_boundary_is_refused(tmp_path: Path) -> None:
    config = generic_sweep.tiny_config("dory")
    config.num_hidden_layers, config.layer_types = 4, (list(config.layer_types) * 4)[:4]
    config.n_input_layers, config.n_recurrent_layers, config.n_output_layers = 1, 2, 1
    config.n_recurrent_loops = 2  # layers run 0, 1, 2, 1, 2, 3
    path = _save(config, "DoryForCausalLM", tmp_path / "dory")
    windows = (StageWindow(0, 0, 1, True, False), StageWindow(1, 1, 4, False, True))
    first, last = _stages(path, windows)
    assert torch.equal(last.forward(IDS, first.forward(IDS)), _reference(path))
    first, last = _stages(path, (StageWindow(0, 0, 2, True, False),
                                 StageWindow(1, 2, 4, False, True)))
    with pytest.raises(PPLoaderError, match="layer 1 runs again after layer 2"):
        last.forward(IDS, first.forward(IDS))


class _Wire:
    """Comm's point-to-point part, in one process: a queue of sent tensors."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.sent.append((dst, tensor.clone()))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        _, data = self.sent.pop(0)
        assert data.dtype == tensor.dtype and data.shape == tensor.shape
        tensor.copy_(data)


def test_boundary_wire_round_trip() -> None:
    hidden = torch.randn(2, 3, 4)
    args = (hidden, None)
    kwargs = {"mask": torch.tensor([[True, False]]), "idx": torch.arange(5),
              "pos": (torch.randn(3, 2, dtype=torch.bfloat16), torch.tensor(1.5)),
              "types": {"full": 1, "window": None}, "flag": False, "cache": object()}
    output = (hidden, torch.zeros(1, dtype=torch.float16))
    boundary = StageBoundary.capture(3, args, kwargs, output)
    assert len(boundary.tensors) == 6  # hidden sent once
    wire = _Wire()
    send_boundary(wire, boundary, 1, torch.device("cpu"))  # type: ignore[arg-type]
    got = recv_boundary(wire, 0, torch.device("cpu"))  # type: ignore[arg-type]
    assert not wire.sent and got.layer == 3 and got.layout == boundary.layout
    local_cache = object()
    new_args, new_kwargs = got.inputs((torch.zeros(1), None), {"cache": local_cache})
    assert torch.equal(new_args[0], hidden) and new_args[1] is None
    assert new_kwargs["cache"] is local_cache  # not sent: the receiver's own object
    for key in ("mask", "idx"):
        assert torch.equal(new_kwargs[key], kwargs[key]) and new_kwargs[key].dtype == kwargs[key].dtype
    assert new_kwargs["pos"][0].dtype == torch.bfloat16 and torch.equal(new_kwargs["pos"][0],
                                                                        kwargs["pos"][0])
    assert new_kwargs["pos"][1].shape == () and new_kwargs["types"] == kwargs["types"]
    out = got.output()
    assert isinstance(out, tuple) and torch.equal(out[0], hidden) and out[1].dtype == torch.float16
    with pytest.raises(PPLoaderError, match="cache.*object"):
        got.inputs((torch.zeros(1), None), {})  # nothing local to take the cache from


def test_boundary_slices_mappings_namedtuples_and_skipped_layers() -> None:
    """What hf_boundary carries besides plain tensors: slices of one pre-loop tensor (the
    base travels; later layers' slices are re-cut from the received copy), a mapping object
    the layers fill (refilled in place on the receiver), namedtuple outputs; and a boundary
    with no layer inputs (the loop skipped every later layer) refuses a layer run."""
    import collections
    from pploader.integrations.hf_boundary import StageRun
    Out = collections.namedtuple("Out", ["hidden_states", "extra"])

    class Shared(collections.UserDict):
        pass
    sent_base = torch.randn(1, 3, 4, 2)  # per-layer inputs of 4 layers
    sent_kv = Shared(full=(torch.randn(2), torch.randn(2)))
    boundary = StageBoundary.capture(2, (torch.randn(3), sent_base[:, :, 2]),
                                     {"kv": sent_kv}, Out(torch.ones(2), None))
    assert sum(t is sent_base for t in boundary.tensors) == 1
    wire = _Wire()
    send_boundary(wire, boundary, 1, torch.device("cpu"))  # type: ignore[arg-type]
    got = recv_boundary(wire, 0, torch.device("cpu"))  # type: ignore[arg-type]
    out = got.output()
    assert type(out).__name__ == "Out" and torch.equal(out.hidden_states, torch.ones(2))
    run = StageRun(StageWindow(1, 2, 4, False, True), got, rank=1)
    local_base, local_kv = torch.zeros(1, 3, 4, 2), Shared()
    args, kwargs = run.before(2, torch.nn.Identity(), (torch.zeros(3), local_base[:, :, 2]),
                              {"kv": local_kv})  # type: ignore[misc]
    assert torch.equal(args[1], sent_base[:, :, 2]) and kwargs["kv"] is local_kv
    assert torch.equal(local_kv["full"][0], sent_kv["full"][0])
    args, _ = run.before(3, torch.nn.Identity(), (torch.zeros(3), local_base[:, :, 3]),
                         {"kv": local_kv})  # type: ignore[misc]
    assert torch.equal(args[1], sent_base[:, :, 3])  # layer 3's slice of the received base
    none = StageBoundary.capture(2, None, None, torch.ones(2))
    with pytest.raises(PPLoaderError, match="ran no layer after its own"):
        StageRun(StageWindow(1, 2, 4, False, True), none, rank=1).before(
            2, torch.nn.Identity(), (torch.zeros(3),), {})


@pytest.mark.parametrize("model_type,first,last", [
    # the head module is registered before the encoder: placed by RobertaForCausalLM.forward
    ("camembert", "roberta.embeddings.word_embeddings.weight", "lm_head.dense.weight"),
    # embeddings registered after the encoder, used before it by CpmAntModel.forward
    ("cpmant", "cpmant.input_embedding.weight", "cpmant.encoder.output_layernorm.weight"),
])
def test_first_and_last_stage_from_every_ancestors_forward(model_type: str, first: str,
                                                          last: str) -> None:
    """The generic family places modules off the path to the layer list by where each
    ancestor's forward uses them, and names the embedding by its saved (tie source) name."""
    from pploader.families.hf_meta import derive
    config = generic_sweep.tiny_config(model_type)
    config.architectures = [generic_sweep.causal_lm_types()[model_type]]
    naming = derive(config.to_dict()).namings[0]
    assert first in naming.first and first not in naming.last
    assert last in naming.last and last not in naming.first
    assert naming.embed == first
