"""integrations/written.py: which parameters a model's ``load_weights`` wrote, for engines
whose models return nothing (SGLang). Each way SGLang's models write a parameter is recorded
(its own loader, the default loader, a module's loader method, an in-place write into its
storage), nothing else is, and every wrapper is gone afterwards."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pploader.integrations.written import tracking_writes


def _default(param: nn.Parameter, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class _Experts(nn.Module):
    """A fused-MoE stand-in: one stacked parameter, written through the module's method."""

    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(2, 4), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, *,
                      expert_id: int) -> None:
        param.data[expert_id].copy_(loaded)


def _model() -> nn.Module:
    model = nn.Module()
    model.own = nn.Parameter(torch.zeros(2), requires_grad=False)
    model.own.weight_loader = _default  # type: ignore[attr-defined]
    model.plain = nn.Parameter(torch.zeros(2), requires_grad=False)     # the default loader
    model.experts = _Experts()
    model.sinks = nn.Parameter(torch.zeros(2, 3), requires_grad=False)  # copied in directly
    model.rows = nn.Parameter(torch.zeros(4), requires_grad=False)      # assigned by slice
    model.untouched = nn.Parameter(torch.zeros(2), requires_grad=False)
    model.read_only = nn.Parameter(torch.ones(2), requires_grad=False)  # only read
    return model


def test_every_way_of_writing_is_recorded_and_nothing_else() -> None:
    model = _model()
    with tracking_writes(model, _default) as written:
        model.own.weight_loader(model.own, torch.ones(2))  # type: ignore[attr-defined]
        getattr(model.plain, "weight_loader")(model.plain, torch.ones(2))
        model.experts.weight_loader(model.experts.w13_weight, torch.ones(4), "x", expert_id=1)
        model.sinks.data.narrow(0, 1, 1).copy_(torch.ones(1, 3))  # gpt-oss's sinks in SGLang
        model.rows.data[1:3] = torch.ones(2)
        scratch = torch.zeros(2)
        scratch.copy_(model.read_only.data * 2)  # reading a parameter writes nothing of it
    assert written == {"own", "plain", "experts.w13_weight", "sinks", "rows"}
    assert model.experts.w13_weight[1].tolist() == [1.0] * 4
    assert model.sinks[1].tolist() == [1.0] * 3 and model.rows.tolist() == [0, 1, 1, 0]


def test_everything_is_put_back_even_when_the_load_raises() -> None:
    model = _model()
    try:
        with tracking_writes(model, _default):
            from torch.overrides import _get_current_function_mode_stack
            assert model.own.weight_loader is not _default  # type: ignore[attr-defined]
            assert _get_current_function_mode_stack()
            raise ValueError("a bad tensor")
    except ValueError:
        pass
    assert model.own.weight_loader is _default  # type: ignore[attr-defined]
    assert "weight_loader" not in model.plain.__dict__
    assert "weight_loader" not in model.experts.__dict__
    assert model.experts.weight_loader.__func__ is _Experts.weight_loader  # type: ignore
    from torch.overrides import _get_current_function_mode_stack
    assert not _get_current_function_mode_stack()  # no mode of ours is left on the stack


def test_a_write_on_another_thread_is_not_the_loads() -> None:
    """The storage mode is the loading thread's: a reader thread's copies are not seen (nor
    slowed)."""
    import threading
    model = _model()
    seen: list[Any] = []
    with tracking_writes(model, _default) as written:
        thread = threading.Thread(target=lambda: seen.append(model.untouched.data.fill_(1)))
        thread.start()
        thread.join()
    assert seen and written == set()
