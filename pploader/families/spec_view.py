"""The lowest layer of model knowledge: what a family reads of a model spec (:class:`SpecView`),
how a tensor splits over TP ranks (:class:`ShardRule`) and the config readers (``cfg``,
``cfg_opt``).

Below ``base.py`` and the mixer-size readers (``blocks.py``, ``windows.py``, ``cache_dims.py``),
which all import it, so none of them imports another in a circle.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Union

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SpecView", "ShardRule", "cfg", "cfg_opt"]


class SpecView(Protocol):
    """What a family reads of a ``planning.spec.ModelSpec`` (which satisfies it): the config
    and the layout the family derived from it. Read-only."""

    @property
    def architecture(self) -> str: ...

    @property
    def config(self) -> Mapping[str, object]: ...

    @property
    def full_config(self) -> Mapping[str, object]: ...

    @property
    def num_layers(self) -> builtins.int: ...

    @property
    def layer_kinds(self) -> tuple[str, ...]: ...

    @property
    def moe_layers(self) -> frozenset[builtins.int]: ...

    @property
    def num_experts(self) -> builtins.int: ...

    @property
    def num_mtp_layers(self) -> builtins.int: ...

    @property
    def dtype(self) -> "torch.dtype": ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def hidden_size(self) -> builtins.int: ...

    @property
    def vocab_size(self) -> builtins.int: ...

    @property
    def num_heads(self) -> builtins.int: ...

    @property
    def num_kv_heads(self) -> builtins.int: ...

    @property
    def head_dim(self) -> builtins.int: ...

    def get(self, *keys: str) -> object: ...

    def int(self, *keys: str) -> builtins.int: ...


@dataclass(frozen=True)
class ShardRule:
    """How a tensor splits over the TP ranks of a stage.

    ``dim`` None = replicated. ``segments(spec)`` gives the sizes of independent parts along
    ``dim`` (e.g. Mamba2 in_proj = [z, x, B, C, dt]); each part is split on its own and the
    rank's pieces are concatenated in order. ``units(spec)`` gives the number of indivisible
    units (e.g. kv heads) of every segment, or a tuple with one count per segment (Mamba2
    in_proj: heads for z/x/dt, groups for B/C): with fewer units than TP ranks, units are
    replicated (rank r takes unit r * units // tp). ``pad`` pads dim 0 to a multiple of tp.
    ``ceil`` splits the units unevenly, as an engine does for that tensor: each rank takes
    ``ceil(units / tp)`` of them and the last ranks fewer (``families.heads.ceil_share``:
    vLLM's gpt-oss experts: MXFP4 in whole 32-value blocks of the intermediate dim, bf16 in
    elements). ``replicate`` False refuses a segment with fewer units than TP ranks instead
    of replicating them: units that hold query heads the engine splits and never copies
    (Falcon's KV groups, CodeGen's four qkv blocks; families/fused_qkv.py).
    """

    pattern: str
    dim: Optional[int]
    segments: Optional[Callable[[SpecView], tuple[int, ...]]] = None
    units: Optional[Callable[[SpecView], Union[int, tuple[int, ...]]]] = None
    pad: bool = False
    ceil: bool = False
    replicate: bool = True


def cfg(config: Mapping, *keys: str) -> Any:  # JSON: the caller converts
    """The first present key of ``config``; a clear error naming all keys when none is."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    raise ConfigError(f"config.json lacks {' / '.join(keys)}")


def cfg_opt(config: Mapping, key: str, default: Any) -> Any:
    value = config.get(key)
    return default if value is None else value
