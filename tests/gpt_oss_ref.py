"""gpt-oss under TP, written independently of the planner: what each TP rank holds of each
tensor (the serving engine's rule, spelled as vLLM's gpt-oss loader computes it), and where
a ``ReadItem``'s output elements come from in the file, interpreted here from the item's
fields (ranges concatenated into ``buffer_shape``, then ``gather`` per-dim intervals).

``engine_slices`` is the reference: the MXFP4 experts by vLLM's ``_load_weights_mxfp4``
arithmetic (``per = cdiv(I // 32, tp) * 32``, rank r from ``r * per`` to ``min((r + 1) * per,
I)``; gate_up rows ``[2 s, 2 e)``, down's packed input ``[s / 2, e / 2)`` bytes, scales
``[s / 32, e / 32)``, down's bias whole; unquantized experts by ``_load_weights_other``:
``cdiv(I, tp)`` elements, gate_up's columns ``[2 s, 2 e)``, down's rows ``[s, e)``), attention
by heads (sinks with q), the vocabulary in ``ceil(V / tp)`` rows (padding after), everything
else whole.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

Slices = tuple[slice, ...]


def mxfp4_bounds(intermediate: int, tp: int, rank: int) -> tuple[int, int]:
    """vLLM's element bounds ``[tp_rank_start, tp_rank_end)`` of the intermediate dim."""
    per = -(-(intermediate // 32) // tp) * 32
    start = rank * per
    return min(start, intermediate), min((rank + 1) * per, intermediate)


def plain_bounds(intermediate: int, tp: int, rank: int) -> tuple[int, int]:
    """The same for unquantized experts (``_load_weights_other``: ``cdiv(I, tp)`` elements)."""
    per = -(-intermediate // tp)
    start = rank * per
    return min(start, intermediate), min((rank + 1) * per, intermediate)


def engine_slices(name: str, shape: Sequence[int], config: Mapping[str, Any], tp: int,
                  rank: int) -> tuple[Slices, int]:
    """``(slices of the full tensor, zero rows padded after dim 0)`` TP rank ``rank`` holds."""
    whole: Slices = tuple(slice(0, n) for n in shape)
    if tp == 1:
        return whole, 0
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    leaf = name.rsplit(".", 1)[-1]
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""

    def dim(d: int, a: int, b: int) -> Slices:
        out = list(whole)
        out[d] = slice(a, b)
        return tuple(out)

    if ".experts." in name and not leaf.endswith(("_blocks", "_scales")) and \
            (config.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        s, e = plain_bounds(config["intermediate_size"], tp, rank)
        if leaf == "gate_up_proj":                    # [E, H, 2I]: columns 2s..2e
            return dim(2, 2 * s, 2 * e), 0
        if leaf == "gate_up_proj_bias":
            return dim(1, 2 * s, 2 * e), 0
        if leaf == "down_proj":                       # [E, I, H]: rows s..e
            return dim(1, s, e), 0
        if leaf == "down_proj_bias":
            return whole, 0
        raise AssertionError(f"no reference for {name}")
    if ".experts." in name:
        s, e = mxfp4_bounds(config["intermediate_size"], tp, rank)
        if leaf.startswith("gate_up_proj"):           # blocks, scales, bias: rows 2s..2e
            return dim(1, 2 * s, 2 * e), 0
        if leaf == "down_proj_blocks":                # [E, H, I/32, 16] = [E, H, I/2] bytes
            return dim(2, s // 32, e // 32), 0        # (s / 2 bytes = s / 32 blocks of 16)
        if leaf == "down_proj_scales":
            return dim(2, s // 32, e // 32), 0
        if leaf == "down_proj_bias":
            return whole, 0
        raise AssertionError(f"no reference for {name}")
    if leaf == "sinks" or module == "q_proj":
        per = heads // tp
        step = 1 if leaf == "sinks" else hd
        return dim(0, rank * per * step, (rank + 1) * per * step), 0
    if module in ("k_proj", "v_proj"):
        if kv >= tp:
            per = kv // tp
            return dim(0, rank * per * hd, (rank + 1) * per * hd), 0
        head = rank * kv // tp                        # replicated over tp / kv ranks
        return dim(0, head * hd, (head + 1) * hd), 0
    if module == "o_proj":
        if leaf == "bias":
            return whole, 0
        per = heads // tp
        return dim(1, rank * per * hd, (rank + 1) * per * hd), 0
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return dim(0, start, stop), per - (stop - start)
    return whole, 0                                   # norms, router weight and bias


def sliced_shape(shape: Sequence[int], slices: Slices, pad: int) -> tuple[int, ...]:
    out = tuple(s.stop - s.start for s in slices)
    return ((out[0] + pad,) + out[1:]) if out and pad else out


def _grid(shape: Sequence[int], limit: int, seed: int) -> np.ndarray:
    """Output indices to check: every one when few, else the corners of every dim and
    ``limit`` random ones."""
    total = math.prod(shape)
    if total == 0:
        return np.zeros((0, len(shape)), dtype=np.int64)
    if total <= limit:
        return np.stack(np.unravel_index(np.arange(total), shape), axis=1).astype(np.int64)
    rng = np.random.default_rng(seed)
    rand = np.stack([rng.integers(0, n, limit) for n in shape], axis=1)
    corners = np.array(np.meshgrid(*[[0, n - 1] for n in shape], indexing="ij")
                       ).reshape(len(shape), -1).T
    return np.concatenate([rand, corners]).astype(np.int64)


def item_offsets(item: Any, idx: np.ndarray) -> np.ndarray:
    """File byte offset of each output element ``idx`` (rows of multi-indices) of ``item``,
    from its fields alone: output index -> buffer index through ``gather`` -> byte position
    in the concatenated ``ranges`` -> file offset."""
    buf = idx.copy()
    for d, intervals in item.gather:
        starts = np.array([a for a, _ in intervals], dtype=np.int64)
        lengths = np.array([n for _, n in intervals], dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(lengths)])
        which = np.searchsorted(cum, idx[:, d], side="right") - 1
        buf[:, d] = starts[which] + idx[:, d] - cum[which]
    pos = np.ravel_multi_index(tuple(buf.T), item.buffer_shape) * item.itemsize
    offsets = np.array([o for o, _ in item.ranges], dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum([n for _, n in item.ranges])]).astype(np.int64)
    which = np.searchsorted(cum, pos, side="right") - 1
    return offsets[which] + pos - cum[which]


def check_item(item: Any, start: int, shape: Sequence[int], slices: Slices, pad: int,
               limit: int = 4096, seed: int = 0) -> Optional[str]:
    """None when ``item`` delivers exactly ``full[slices]`` (+ ``pad`` zero rows) of the tensor
    at file offset ``start`` of ``shape``; else what differs. Checks every element of small
    items, corners and ``limit`` random elements of large ones."""
    want = sliced_shape(shape, slices, pad)
    if tuple(item.shape) != want or item.pad_rows != pad:
        return f"shape {item.shape} pad {item.pad_rows}, want {want} pad {pad}"
    real = (want[0] - pad,) + tuple(want[1:]) if want else want
    if math.prod(real) * item.itemsize != item.ideal_bytes:
        return f"ideal bytes {item.ideal_bytes} != {math.prod(real) * item.itemsize}"
    if any(n < 0 for n in real):
        return f"negative extent {real}"
    idx = _grid(real, limit, seed)
    if len(idx) == 0:
        return None if item.ideal_bytes == 0 else "empty slice with bytes"
    got = item_offsets(item, idx)
    lo = np.array([s.start for s in slices], dtype=np.int64)
    expected = start + np.ravel_multi_index(tuple((idx + lo).T), tuple(shape)) * item.itemsize
    bad = np.nonzero(got != expected)[0]
    if len(bad):
        return f"element {idx[bad[0]].tolist()} from offset {got[bad[0]]}, want {expected[bad[0]]}"
    return None
