"""Layerwise loading from a (name, tensor) stream: buffer per layer, warn once when several
layers are buffered, tracker empty afterwards, peak buffered bytes as reported."""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Iterable, Iterator

import pytest
import torch

from pploader import (LayerOrderWarning, LayerTracker, LoadRecord, NotReadyError, PlanError,
                      Topology, is_ready, iter_stage_weights, load_layerwise, load_stage_into,
                      plan_stage)

from bind_models import one_thread  # noqa: F401 - autouse fixture
from bind_models import TinyLM, checksum, param_ptrs
from helpers import make_model, tiny_config

CFG = tiny_config()
TOPO = Topology(2, rank=1)  # layers 4-7 + norm + head
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("layerwise")
    return make_model(root / "a", seed=3), make_model(root / "b", seed=4)


def loaded(model_dir: Path) -> tuple[TinyLM, LoadRecord]:
    """A module loaded from ``model_dir`` and the record that load_layerwise takes."""
    module = TinyLM(CFG, plan_stage(model_dir, TOPO).plan.window, device="meta")
    return module, load_stage_into(module, model_dir, TOPO).record


def expected_peak(stream: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """Independent accounting: a layer's pieces stay buffered until all of them arrived;
    tensors outside layers are never buffered. Returns (peak bytes, peak layers)."""
    total: dict[str, int] = {}
    for name, _ in stream:
        m = LAYER.match(name)
        if m:
            total[m.group(1)] = total.get(m.group(1), 0) + 1
    held: dict[str, list[int]] = {}
    peak_bytes = peak_layers = 0
    for name, t in stream:
        m = LAYER.match(name)
        if not m:
            continue
        held.setdefault(m.group(1), []).append(t.numel() * t.element_size())
        peak_bytes = max(peak_bytes, sum(sum(v) for v in held.values()))
        peak_layers = max(peak_layers, len(held))
        if len(held[m.group(1)]) == total[m.group(1)]:
            del held[m.group(1)]
    return peak_bytes, peak_layers


def run(loaded_model: tuple[TinyLM, LoadRecord], stream: Iterable[tuple[str, torch.Tensor]],
        tracker: LayerTracker) -> tuple[object, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, record = loaded_model
        report = load_layerwise(model, stream, record=record, tracker=tracker)
    return report, [w for w in caught if issubclass(w.category, LayerOrderWarning)]


def test_in_order_stream_buffers_one_layer_and_never_warns(ckpts: tuple[Path, Path]) -> None:
    a, b = ckpts
    (model, record), want = loaded(a), checksum(loaded(b)[0])
    ptrs = param_ptrs(model)
    stream = list(iter_stage_weights(b, TOPO))
    tracker = LayerTracker()
    report, warned = run((model, record), stream, tracker)
    assert warned == [] and not report.warned and report.peak_buffered_layers == 1
    assert (report.peak_buffered_bytes, report.peak_buffered_layers) == expected_peak(stream)
    assert tracker.buffered == {}
    assert checksum(model) == want and param_ptrs(model) == ptrs and is_ready(model)
    assert report.groups_applied == 4 + 2  # four layers, then norm and head on their own
    assert "model.layers.5.mlp.down_proj" in report.processed


def interleaved(stream: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Layers 4 and 5 interleaved piece by piece, then the rest (a trainer pushing by param
    group rather than by layer)."""
    four = [p for p in stream if p[0].startswith("model.layers.4.")]
    five = [p for p in stream if p[0].startswith("model.layers.5.")]
    rest = [p for p in stream if p not in four and p not in five]
    mixed = [p for pair in zip(four, five) for p in pair]
    return mixed + rest[::-1]  # and the remaining layers backwards


def test_out_of_order_stream_warns_exactly_once(ckpts: tuple[Path, Path]) -> None:
    a, b = ckpts
    (model, record), want = loaded(a), checksum(loaded(b)[0])
    stream = interleaved(list(iter_stage_weights(b, TOPO)))
    tracker = LayerTracker()
    report, warned = run((model, record), stream, tracker)
    assert len(warned) == 1 and report.warned
    msg = str(warned[0].message)
    assert "model.layers.4" in msg and "model.layers.5" in msg and " MB" in msg
    assert "order the weight stream by layer" in msg
    assert (report.peak_buffered_bytes, report.peak_buffered_layers) == expected_peak(stream)
    assert report.peak_buffered_layers >= 2
    assert tracker.buffered == {} and checksum(model) == want and is_ready(model)


def test_borrowed_stream_is_kept_with_owned(ckpts: tuple[Path, Path]) -> None:
    """A borrowed stream reuses its buffers while layers are buffered; pploader keeps pieces
    with owned(), so the result equals an owned-mode load."""
    a, b = ckpts
    plan = plan_stage(b, TOPO).plan
    (model, record), want = loaded(a), checksum(loaded(b)[0])
    stream = iter_stage_weights(b, TOPO, mode="borrowed",
                                window_bytes=2 * plan.largest_item_bytes)
    report, warned = run((model, record), stream, LayerTracker())
    assert warned == [] and checksum(model) == want


def test_incomplete_stream_leaves_model_not_ready(ckpts: tuple[Path, Path]) -> None:
    a, b = ckpts
    model, record = loaded(a)
    stream = [p for p in iter_stage_weights(b, TOPO) if p[0] != "model.layers.6.mlp.up_proj.weight"]
    tracker = LayerTracker()
    with pytest.raises(PlanError, match=r"model\.layers\.6\.mlp\.up_proj\.weight"), \
            pytest.warns(LayerOrderWarning, match="model.layers.6, model.layers.7"):
        load_layerwise(model, stream, record=record, tracker=tracker)  # layer 6 never completes
    assert tracker.buffered == {} and not is_ready(model)
    with pytest.raises(NotReadyError):
        model(torch.tensor([1, 2]))
    load_layerwise(model, iter_stage_weights(b, TOPO), record=record)  # complete: restores it
    assert is_ready(model)


def test_unknown_name_fails_before_any_write(ckpts: tuple[Path, Path]) -> None:
    a, _ = ckpts
    model, record = loaded(a)
    before = checksum(model)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        yield "model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16)

    with pytest.raises(PlanError, match="not a tensor of this rank's stage"):
        load_layerwise(model, stream(), record=record)
    assert checksum(model) == before and is_ready(model)
