"""A published vision-language checkpoint through the generic family, at real scale.

google/medgemma-27b-it (Gemma3ForConditionalGeneration: 62 decoder layers, SigLIP tower of 27
layers stored as ``vision_tower.vision_model.*``, projector, head tied by the config class's
default; bfloat16): its 1247 published names in their 12 published shards
(tests/data/published_indexes), its published config, sparse files
(``real_layouts.build_published_layout``; the shapes give exactly the published
``total_size``). Checked independently of the planner, from the names alone: at PP=4 every
tower / projector tensor and the embedding on stage 0 only, each decoder layer's 13 tensors
on the one stage whose window holds it (the windows partition the 62 layers), the final norm
and the tied head (the embedding's bytes) on the last; at PP=2 x TP=8 the tower and projector
read whole by every TP rank, the split tensors' bytes adding up to the tensor. One-rank
planning times are printed (docs/families.md records them).
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from pathlib import Path

import pytest

from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import make_windows, plan_all, plan_rank
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from real_layouts import build_published_layout, published_weight_map

pytestmark = pytest.mark.slow  # the 27B meta model: ~10 s to derive on the 2-core VM

MODEL = "medgemma-27b-it"
LAYER = re.compile(r"language_model\.model\.layers\.(\d+)\.")
ENCODER = ("vision_tower.", "multi_modal_projector.")
EMBED, NORM = "language_model.model.embed_tokens.weight", "language_model.model.norm.weight"


@pytest.fixture(scope="module")
def medgemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_published_layout(MODEL, tmp_path_factory.mktemp("vl-layouts"))


def _one_rank_seconds(path: Path, pp: int, tp: int) -> float:
    """The last rank's plan from a fresh index, the family already derived."""
    spec = load_spec(path)
    t0 = time.perf_counter()
    index = open_checkpoint(path)
    spec = spec.for_checkpoint(index.weight_map)
    topo = Topology(pp, tp, 1, pp * tp - 1)
    plan_rank(spec, index, topo, make_windows(spec, index, pp)[topo.pp_rank])
    return time.perf_counter() - t0


def test_published_layout_is_the_published_index(medgemma: Path) -> None:
    weight_map, metadata = published_weight_map(MODEL)
    index = open_checkpoint(medgemma)
    assert dict(index.weight_map) == weight_map and len(weight_map) == 1247
    assert len(set(weight_map.values())) == 12
    assert sum(index.entry(n).nbytes for n in weight_map) == metadata["total_size"]
    assert all(index.entry(n).dtype == "BF16" for n in weight_map)
    assert not any("lm_head" in n for n in weight_map)  # tied: the config class's default


def test_medgemma_27b_exact_at_pp4(medgemma: Path, capsys: pytest.CaptureFixture) -> None:
    spec, index = load_spec(medgemma), open_checkpoint(medgemma)
    assert spec.family.name == "generic:gemma3" and spec.num_layers == 62
    resolved = spec.for_checkpoint(index.weight_map)
    assert resolved.family.format == "prefixed" and resolved.tie_word_embeddings
    plans = plan_all(spec, index, 4)
    windows = [(p.window.start_layer, p.window.end_layer) for p in plans]
    assert windows[0][0] == 0 and windows[-1][1] == 62
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    readers: dict[str, list[int]] = defaultdict(list)
    for stage, plan in enumerate(plans):
        for item in plan.items:
            assert item.nbytes == index.entry(item.name).nbytes  # whole tensors at TP=1
            readers[item.name].append(stage)
            if item.name != item.target:  # only the tied head: the embedding's bytes, last
                assert (item.name, stage) == (EMBED, 3) and "lm_head" in item.target
    assert set(readers) == set(index.weight_map)
    for name, stages in readers.items():
        m = LAYER.match(name)
        if m:
            layer = int(m.group(1))
            want = [s for s, (a, b) in enumerate(windows) if a <= layer < b]
        elif name.startswith(ENCODER):
            want = [0]
        elif name == EMBED:
            want = [0, 3]  # and as the tied head on the last stage
        else:
            assert name == NORM, name
            want = [3]
        assert stages == want, (name, stages)
    seconds = _one_rank_seconds(medgemma, 4, 1)
    with capsys.disabled():
        print(f"\nmedgemma-27b-it PP=4: one rank planned in {seconds * 1000:.0f} ms")


def test_medgemma_27b_pp2_tp8_replicates_the_tower(medgemma: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    spec, index = load_spec(medgemma), open_checkpoint(medgemma)
    plans = plan_all(spec, index, 2, 8, 1)
    per_rank: dict[tuple[int, str], list[int]] = defaultdict(list)
    for plan in plans:
        for item in plan.items:
            per_rank[plan.topology.pp_rank, item.name].append(item.nbytes)
    assert {n for _, n in per_rank} == set(index.weight_map)
    for (stage, name), sizes in per_rank.items():
        whole = index.entry(name).nbytes
        assert len(sizes) == 8, (stage, name)
        if name.startswith(ENCODER) or name.endswith(("norm.weight", "layernorm.weight")):
            assert sizes == [whole] * 8, name  # replicated
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                            "gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            assert sum(sizes) == whole and len(set(sizes)) == 1, name  # split 8 ways
    seconds = _one_rank_seconds(medgemma, 2, 8)
    with capsys.disabled():
        print(f"\nmedgemma-27b-it PP=2 x TP=8: one rank planned in {seconds * 1000:.0f} ms")
