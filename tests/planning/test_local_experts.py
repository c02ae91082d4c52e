"""EP's expert split (planning/shard.py ``local_experts``): vLLM's ``linear`` placement, the
remainder on the first ranks (vLLM's own ``determine_expert_map``: tests/vllm)."""
from __future__ import annotations

import pytest

from pploader.errors import PlanError
from pploader.planning.shard import local_experts


def test_remainder_goes_to_the_first_ranks() -> None:
    assert [local_experts(8, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    assert [local_experts(7, 2, r) for r in range(2)] == [(0, 4), (4, 7)]
    assert [local_experts(60, 8, r)[1] - local_experts(60, 8, r)[0] for r in range(8)] == \
        [8, 8, 8, 8, 7, 7, 7, 7]


@pytest.mark.parametrize("num_experts", [1, 2, 3, 7, 8, 60, 64, 257])
def test_blocks_tile_the_experts_as_vllm_linear(num_experts: int) -> None:
    for ep in range(1, min(num_experts, 9) + 1):
        blocks = [local_experts(num_experts, ep, r) for r in range(ep)]
        assert blocks[0][0] == 0 and blocks[-1][1] == num_experts
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        base, extra = divmod(num_experts, ep)
        for r, (first, last) in enumerate(blocks):   # vLLM: start = r*base + min(r, extra)
            assert first == r * base + min(r, extra)
            assert last - first == base + (r < extra)


def test_fewer_experts_than_ranks_is_refused() -> None:
    with pytest.raises(PlanError, match="3 experts cannot be split over ep 4"):
        local_experts(3, 4, 0)
