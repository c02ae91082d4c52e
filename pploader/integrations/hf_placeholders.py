"""Placeholders for the modules a pipeline stage does not own (integrations/hf.py builds the
stage): decoder layers of other stages (:class:`PassThrough`), last-stage modules on earlier
stages, first-stage modules beside the text model on later stages, and a memory-free input
embedding for non-first stages. None holds parameters; attribute reads fall through to the meta
original, so the model's own code keeps working."""
from __future__ import annotations

import typing
from typing import Any, Optional

import torch
from torch import nn

from ..errors import PPLoaderError

__all__ = ["StubModule", "DroppedModule", "AbsentModule", "PassThrough", "ZeroEmbedding"]


class StubModule(nn.Module):
    """Stands in for a module another stage owns: no parameters, no state dict; attribute
    reads it cannot answer go to the (meta, unregistered) original, so the model's own code
    (``layer.attention_type``, weight initialisers reading ``module.weight``) still works."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self._original_ref = (original,)  # a tuple: not a submodule, no params, no state_dict

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            ref = vars(self).get("_original_ref")
            if ref is None:
                raise
            return getattr(ref[0], name)


class DroppedModule(StubModule):
    """A last-stage module (final norm, head) on an earlier stage: never run there (the stage
    stops before the next stage's first layer); passes its input through if it is."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


class AbsentModule(StubModule):
    """A first-stage module beside the text model (a vision tower) on a later stage."""

    def __init__(self, original: nn.Module, path: str) -> None:
        super().__init__(original)
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PPLoaderError(f"{self.path} lives on the first pipeline stage; multimodal inputs "
                            "must be embedded there")


class PassThrough(StubModule):
    """Stands in for a decoder layer another stage owns. Holds no parameters.

    Before this stage's first layer it returns the previous stage's last layer output (set by
    :meth:`HFStage.forward` through :meth:`replay`), so the loop code between layers sees a real
    layer output; the inputs of the first owned layer are then replaced by the captured ones.
    Attributes it lacks are read from the (meta, unregistered) original layer.
    """

    def __init__(self, original: nn.Module, layer_idx: int) -> None:
        super().__init__(original)
        self.layer_idx = layer_idx
        self._replay: list[Any] = []

    def replay(self, output: Any) -> None:
        """Return ``output`` from now on (``None``: clear)."""
        self._replay[:] = [] if output is None else [output]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._replay:
            raise PPLoaderError(f"decoder layer {self.layer_idx} belongs to another pipeline "
                                "stage; run the stage through HFStage.forward")
        return self._replay[0]


class ZeroEmbedding(nn.Module):
    """Input embedding of a non-first stage: zeros of the right shape (the inputs of the first
    owned layer are replaced by those received from the previous stage).

    ``weight`` is one zero row expanded to the embedding's shape (no memory): models that read
    the embedding's device, dtype or shape, or index a row of it (Gemma 4's pad embedding),
    find them.
    """

    def __init__(self, num_embeddings: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.hidden_size, self.dtype = num_embeddings, hidden_size, dtype
        self.register_buffer("zero_row", torch.zeros(1, hidden_size, dtype=dtype),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        row = typing.cast(torch.Tensor, self.zero_row)
        cached: Optional[tuple[torch.Tensor, torch.Tensor]] = self.__dict__.get("_weight_view")
        if cached is None or cached[0] is not row:  # (re)built after .to() moved the row
            view = row.expand(self.num_embeddings, self.hidden_size)
            setattr(view, "_is_hf_initialized", True)  # transformers' initialisers skip it
            cached = (row, view)
            self.__dict__["_weight_view"] = cached
        return cached[1]

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.hidden_size, dtype=self.dtype,
                           device=input_ids.device)
