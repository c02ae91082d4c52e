"""ModelSpec: what the model is, read from config.json through its family's data."""
from __future__ import annotations

import builtins
import logging
import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from ..errors import ConfigError
from ..families import FAMILIES, Family, find_family
from ..families.base import cfg
from .config_limits import (MAX_CONFIG_BYTES, check_config_counts, check_config_types,
                            check_counts_against_checkpoint, parse_json_limited,
                            read_bytes_limited)
from .dtype_table import CONFIG_DTYPES

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ModelSpec", "load_spec", "read_config", "spec_from_config"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """The model as pploader sees it: layers, their kinds, experts, dtype, tying.

    The dtype is kept by name (``dtype_name``, e.g. ``"bfloat16"``) so planning never imports
    torch; ``dtype`` gives the torch dtype to code that makes tensors."""

    family: Family
    architecture: str
    config: Mapping[str, object]         # the language-model config (text_config for VL)
    full_config: Mapping[str, object]    # config.json as written
    num_layers: builtins.int
    layer_kinds: tuple[str, ...]
    moe_layers: frozenset[builtins.int]
    num_experts: builtins.int
    num_mtp_layers: builtins.int
    dtype_name: str                      # torch dtype name: "bfloat16", "float16", ...
    tie_word_embeddings: bool

    @property
    def dtype(self) -> "torch.dtype":
        """The model dtype as a torch dtype (imports torch)."""
        from .dtype_table import torch_dtype
        return torch_dtype(self.dtype_name)

    def get(self, *keys: str) -> object:
        """A config value by the first present key (clear error otherwise)."""
        return cfg(self.config, *keys)

    def int(self, *keys: str) -> builtins.int:
        return builtins.int(cfg(self.config, *keys))

    @property
    def hidden_size(self) -> builtins.int:
        return self.int("hidden_size", "d_model")

    @property
    def vocab_size(self) -> builtins.int:
        return self.int("vocab_size")

    @property
    def num_heads(self) -> builtins.int:
        return self.int("num_attention_heads")

    @property
    def num_kv_heads(self) -> builtins.int:
        if self.config.get("num_key_value_heads") is None:
            return self.num_heads
        return self.int("num_key_value_heads")

    @property
    def head_dim(self) -> builtins.int:
        if self.config.get("head_dim") is not None:
            return self.int("head_dim")
        return self.hidden_size // self.num_heads

    def layers_of_kind(self, *kinds: str) -> tuple[builtins.int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in kinds)

    def for_checkpoint(self, names: Iterable[str]) -> "ModelSpec":
        """This spec with its family resolved to the naming the checkpoint uses (e.g. fused
        3-D experts written by transformers); the planner calls it with the index's names.

        A tied config whose checkpoint also stores the head is read untied: the stored head
        is the head, as transformers does (it ties only when both copies are equal, and then
        either is right)."""
        if not isinstance(names, (Mapping, set, frozenset)):
            names = set(names)
        spec = self if not self.family.formats else replace(
            self, family=self.family.for_checkpoint(names))
        check_counts_against_checkpoint(spec, names)  # before anything builds the template
        if spec.tie_word_embeddings:
            head = spec.family.head_name()
            if head is not None and head in names:
                logger.info("%s: tie_word_embeddings is set but the checkpoint stores %s; it is "
                            "read as the head (as transformers does)", spec.architecture, head)
                spec = replace(spec, tie_word_embeddings=False)
        return spec


def _dtype(config: Mapping, outer: Mapping) -> str:
    raw = config.get("dtype") or config.get("torch_dtype") or outer.get("dtype") \
        or outer.get("torch_dtype")
    if raw is None:
        raise ConfigError("config.json has no dtype / torch_dtype: pploader will not guess the "
                          "checkpoint's dtype", file="config.json")
    name = str(raw).replace("torch.", "")
    if name not in CONFIG_DTYPES:
        raise ConfigError(f"unsupported dtype {raw!r} (known: {', '.join(CONFIG_DTYPES)})",
                          file="config.json")
    return CONFIG_DTYPES[name]


def spec_from_config(config: Mapping[str, object], *, family: Optional[Family] = None) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json (pure; used by tests and `plan`)."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json is not a JSON object", file="config.json")
    check_config_counts(config)  # before a family (or transformers) loops over any count
    check_config_types(config)  # "false" as a string, a quantization_config that is text
    archs: Any = config.get("architectures")
    fam, arch = (family, (archs or [family.name])[0]) if family \
        else _find_family(config)
    text = config
    if fam.text_config_key and isinstance(config.get(fam.text_config_key), Mapping):
        text = config[fam.text_config_key]  # type: ignore[assignment]
    if fam.config_defaults:  # standard names of keys the config spells its own way
        text = {**fam.config_defaults, **text}
    try:
        layout = fam.layout(text)
    except ConfigError as exc:
        raise ConfigError(f"{fam.name}: {exc.detail}", file="config.json") from None
    tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return ModelSpec(
        family=fam, architecture=arch, config=MappingProxyType(dict(text)),
        full_config=MappingProxyType(dict(config)), num_layers=layout.num_layers,
        layer_kinds=layout.layer_kinds, moe_layers=layout.moe_layers,
        num_experts=layout.num_experts, num_mtp_layers=layout.num_mtp_layers,
        dtype_name=_dtype(text, config), tie_word_embeddings=bool(tie))


def _find_family(config: Mapping[str, object]) -> tuple[Family, str]:
    """find_family, with a message that says so when ``architectures`` names a hand-written
    family whose ``model_type`` the config contradicts (not "unsupported ... X ... supported:
    X")."""
    try:
        return find_family(config)
    except ConfigError:
        archs = config.get("architectures")
        model_type = config.get("model_type")
        for fam in FAMILIES if isinstance(archs, list) else ():
            arch = next((a for a in archs if a in fam.architectures), None)  # type: ignore[attr-defined]
            if arch is not None and fam.model_types and model_type not in fam.model_types:
                raise ConfigError(
                    f"architectures names {arch} (written for model_type "
                    f"{' / '.join(sorted(fam.model_types))}) but model_type is "
                    f"{model_type!r}: the two fields contradict each other; fix model_type or "
                    "architectures", file="config.json") from None
        raise


def read_config(model_dir: os.PathLike | str, *,
                allowed_roots: Sequence[os.PathLike | str] = ()) -> object:
    """The parsed ``config.json`` of a model directory (clear errors when missing or bad).

    Like the shards, config.json may be a symlink only into the allowed roots (the model
    directory, its Hugging Face cache repo, ``allowed_roots``). An ``s3://bucket/prefix``
    fetches it from the object store (planning/remote.py)."""
    from ..storage import check_model_location
    from .checkpoint import check_model_dir, inside_roots, is_remote
    check_model_location(model_dir, "model_dir")
    if is_remote(model_dir):  # the same limits for every storage: fetched bounded, one parse
        from .remote import remote_bytes
        raw, name = remote_bytes(str(model_dir), "config.json", MAX_CONFIG_BYTES)
        return parse_json_limited(raw, name)
    root = check_model_dir(model_dir)
    if not os.access(root, os.R_OK | os.X_OK):
        raise ConfigError("cannot read the model directory (permission denied): give this "
                          "user read access to it (chmod / chown) or copy the model",
                          file=str(root))
    path = root / "config.json"
    if not path.is_file():
        what = "is not a regular file" if os.path.lexists(path) else "is missing"
        raise ConfigError(f"config.json {what} in the model directory: --model must be the "
                          "directory holding config.json and the *.safetensors shards",
                          file=str(path))
    inside_roots(root, path, allowed_roots, "config.json")
    return parse_json_limited(read_bytes_limited(path, MAX_CONFIG_BYTES), str(path))


def load_spec(model_dir: os.PathLike | str, *,
              allowed_roots: Sequence[os.PathLike | str] = ()) -> ModelSpec:
    """Read ``config.json`` of a model directory into a ModelSpec (a config without a dtype
    takes the checkpoint's stored one, ``dtypes.stored_dtype``, as engines do)."""
    config = read_config(model_dir, allowed_roots=allowed_roots)
    if isinstance(config, Mapping) and not _declares_dtype(config):
        from .dtypes import stored_dtype
        config = {**config, "dtype": stored_dtype(model_dir, allowed_roots=allowed_roots)}
    return spec_from_config(config)  # type: ignore[arg-type]


def _declares_dtype(config: Mapping) -> bool:
    text = config.get("text_config")
    return any(isinstance(c, Mapping) and (c.get("dtype") or c.get("torch_dtype"))
               for c in (config, text))
