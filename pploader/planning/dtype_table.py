"""The dtype table, without torch: safetensors codes, torch dtype names and item sizes.

Planning needs only names and sizes (bytes = numel x itemsize), so ``pploader plan`` and the
planning API never import torch (``python -c "import torch"`` alone costs ~2 s on a small
machine). A torch dtype is resolved from its name only where a tensor is made (io/, bind/,
cache pools): :func:`torch_dtype`, or :data:`DTYPES`, whose values resolve on first access.
tests/planning/test_dtype_table.py checks every entry against torch's own dtypes.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CODES", "ITEMSIZE", "NAME_ITEMSIZE", "CONFIG_DTYPES", "DTYPES", "dtype_code",
           "dtype_name", "itemsize_of", "torch_dtype"]

#: safetensors dtype code -> (torch dtype name, bytes per element)
CODES: Mapping[str, tuple[str, int]] = MappingProxyType({
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
})
#: safetensors code -> bytes per element (the header parser's lookup)
ITEMSIZE: Mapping[str, int] = MappingProxyType({c: s for c, (_, s) in CODES.items()})
#: torch dtype name -> bytes per element: the safetensors dtypes plus cache-only ones
NAME_ITEMSIZE: Mapping[str, int] = MappingProxyType({
    **{n: s for n, s in CODES.values()},
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
})
_CODE_OF_NAME = {n: c for c, (n, _) in CODES.items()}
#: config.json ``dtype`` / ``torch_dtype`` spellings -> torch dtype name
CONFIG_DTYPES: Mapping[str, str] = MappingProxyType({
    "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})


def dtype_name(dtype: object) -> str:
    """The torch name of ``dtype`` (a torch.dtype or a name, ``"torch."`` prefix optional):
    ``torch.bfloat16`` -> ``"bfloat16"``. No torch import."""
    return str(dtype).removeprefix("torch.")


def dtype_code(dtype: object) -> str:
    """safetensors code of a torch dtype or dtype name (``torch.bfloat16`` -> ``"BF16"``);
    KeyError for a dtype safetensors has no code for."""
    return _CODE_OF_NAME[dtype_name(dtype)]


def itemsize_of(dtype: object) -> int:
    """Bytes per element of a torch dtype or dtype name; torch is imported only for a name
    outside the table (ValueError when torch has no such dtype)."""
    name = dtype_name(dtype)
    size = NAME_ITEMSIZE.get(name)
    if size is None:
        size = torch_dtype(name).itemsize
    return size


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of a name or safetensors code (imports torch: tensor-making code only);
    ValueError when torch has none of that name."""
    import torch
    name = CODES[name][0] if name in CODES else dtype_name(name)
    out = getattr(torch, name, None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return out


class _TorchDtypes(Mapping[str, "tuple[torch.dtype, int]"]):
    """safetensors code -> (torch dtype, itemsize), torch imported on the first value read.

    Keys, ``in`` and ``len`` need no torch (the header parser's checks use them)."""

    def __init__(self) -> None:
        self._resolved: dict[str, "tuple[torch.dtype, int]"] = {}

    def __getitem__(self, code: str) -> "tuple[torch.dtype, int]":
        try:
            return self._resolved[code]
        except KeyError:
            name, size = CODES[code]  # KeyError for an unknown code, as a dict
            value = self._resolved[code] = (torch_dtype(name), size)
            return value

    def __contains__(self, code: object) -> bool:
        return code in CODES

    def __iter__(self) -> Iterator[str]:
        return iter(CODES)

    def __len__(self) -> int:
        return len(CODES)


#: safetensors dtype code -> (torch dtype, bytes per element); values resolve torch lazily
DTYPES: Mapping[str, "tuple[torch.dtype, int]"] = _TorchDtypes()
