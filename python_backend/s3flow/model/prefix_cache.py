"""What the estimator reads of the frames before a row: kept from one call, given to a later one (issue 50).

The estimator (``s3flow.model.estimator``) sees a frame's left neighbours in two ways only: every attention
layer's keys and values (attention is global over the row) and every causal convolution's last ``kernel - 1``
input frames. A :class:`PrefixCache` holds exactly those for the first P frames of each row of one call, so a
later call can leave those frames out of its rows and still read them:

    v_full, cache = estimator(x, ..., keep=P)            # the whole row [prefix | rest]; record the prefix
    v_rest = estimator(x[..., P:], ..., past=cache)      # the rest alone, reading the prefix from the cache
    v_rest == v_full[..., P:]                           # exactly (tests/test_prefix_cache.py)

A stream keeps its prompt's (and its last emitted frames') cache from the chunk that solved them, one per Euler
step and guidance half (``s3flow.engine.reuse``). A later chunk then reads those frames as they were: they no
longer attend to the frames after them, the approximation whose cost in quality results/stream_reuse.md measures.

The tensors are stacked: keys and values (layers, B, heads, P, head_dim), the convolutions' tails (convolutions, B,
widest input, kernel - 1; a narrower input fills its first channels), and the key mask (B, 1, P). Between
processes a cache crosses as ONE flat float32 tensor each way (``CacheShape.pack_past`` / ``unpack_kept``; the
estimator's Triton model takes ``past`` and returns ``kept``, ``s3flow_contract.tensors.CACHE_INPUTS``): nine of
them made a stream's first chunk (10 calls) 30 ms slower. A call's cost is mostly its bytes, though (about 1.1 ms
per MB crossing and 0.04 ms per tensor on the 2-core host, results/bls_cost.md); the cache crossing once instead
of at every call was tried and measured no faster served (docs/streaming.md, "What crosses per call"). Rows differ in prefix length: the mask marks each row's frames, and each row's
convolution tail is taken at its own length (zeros before a row's first frame, as the convolution's own left
padding gives). A :class:`PrefixWalk` is one call's pass over the layers in their fixed order, written in tensor
operations only, so the ONNX export traces it with the keep lengths as data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

#: Additive attention bias for masked-out keys (same constant as upstream; the estimator's).
MASK_BIAS_VALUE: float = -1.0e10


def mask_to_attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """Turns a frame mask into an additive attention bias over keys.

    Args:
        mask: (B, 1, T) float, 1 for valid frames and 0 for padding.

    Returns:
        (B, 1, 1, T) bias, 0 for valid keys and ``-1e10`` for padded keys;
        broadcasts over heads and queries.
    """
    return ((1.0 - mask) * MASK_BIAS_VALUE).unsqueeze(1)


@dataclass(frozen=True)
class CacheShape:
    """The layer counts and widths of one estimator's caches (``of``: from its config)."""
    layers: int          # attention layers
    heads: int
    head_dim: int
    convs: int           # causal convolutions
    width: int           # the widest causal convolution's input channels
    tail: int = 2        # kernel - 1

    def parameter(self) -> str:
        """As a config parameter: the six numbers, comma-separated (``parse`` reads it)."""
        return ",".join(str(v) for v in (self.layers, self.heads, self.head_dim, self.convs, self.width, self.tail))

    @classmethod
    def parse(cls, text: str) -> "CacheShape":
        values = [int(v) for v in text.split(",")]
        if len(values) != 6 or min(values) < 1:
            raise ValueError(f"a cache shape is six positive numbers (layers, heads, head_dim, convs, width, tail), "
                             f"got {text!r}")
        return cls(*values)

    # -- one flat tensor each way: past = keys | values | convs | mask | keep; kept = keys | values | convs | mask
    def pack_past(self, cache: PrefixCache, keep: torch.Tensor) -> torch.Tensor:
        """``cache`` and ``keep`` (B,) as the estimator's one ``past`` input."""
        return torch.cat([cache.keys.reshape(-1), cache.values.reshape(-1), cache.convs.reshape(-1),
                          cache.mask.reshape(-1), keep.to(cache.keys.dtype).reshape(-1)])

    def unpack_past(self, past: torch.Tensor, batch) -> tuple[PrefixCache, torch.Tensor]:
        """``pack_past``'s inverse for ``batch`` rows (an int, or a 0-d tensor: traced, the sizes stay data)."""
        tail = self.convs * self.width * self.tail
        frames = (torch._shape_as_tensor(past)[0] // batch - tail - 1) // (2 * self.layers * self.heads *
                                                                          self.head_dim + 1)
        keys, values, convs, mask, rest = self._split(past, batch, frames)
        return PrefixCache(keys, values, convs, mask), rest[:batch].long()

    def pack_kept(self, cache: PrefixCache) -> torch.Tensor:
        """A kept cache as the estimator's one ``kept`` output."""
        return torch.cat([cache.keys.reshape(-1), cache.values.reshape(-1), cache.convs.reshape(-1),
                          cache.mask.reshape(-1)])

    def unpack_kept(self, kept: torch.Tensor, batch: int) -> PrefixCache:
        """``pack_kept``'s inverse for ``batch`` rows."""
        tail = self.convs * self.width * self.tail
        frames = (kept.shape[0] // batch - tail) // (2 * self.layers * self.heads * self.head_dim + 1)
        keys, values, convs, mask, _ = self._split(kept, batch, frames)
        return PrefixCache(keys, values, convs, mask)

    def _split(self, flat: torch.Tensor, b, p):
        kv = self.layers * b * self.heads * p * self.head_dim
        cv = self.convs * b * self.width * self.tail
        keys = flat[:kv].reshape(self.layers, b, self.heads, p, self.head_dim)
        values = flat[kv:2 * kv].reshape(self.layers, b, self.heads, p, self.head_dim)
        convs = flat[2 * kv:2 * kv + cv].reshape(self.convs, b, self.width, self.tail)
        mask = flat[2 * kv + cv:2 * kv + cv + b * p].reshape(b, 1, p)
        return keys, values, convs, mask, flat[2 * kv + cv + b * p:]

    @classmethod
    def of(cls, config) -> "CacheShape":
        """From an ``EstimatorConfig`` (the one-level U-Net Chatterbox uses)."""
        stages = 2 * len(config.channels) + config.num_mid_blocks     # down, mid, up resnet + transformer stages
        c = config.channels[-1]
        return cls(layers=config.n_blocks * stages, heads=config.num_heads, head_dim=config.attention_head_dim,
                   convs=2 * stages + 2 * len(config.channels) + 1, width=max(config.in_channels, 2 * c))


@dataclass
class PrefixCache:
    """keys, values: (layers, B, heads, P, head_dim); convs: (convolutions, B, width, kernel - 1); mask (B, 1, P):
    1 on a row's prefix frames, 0 on the padding of shorter prefixes."""
    keys: torch.Tensor
    values: torch.Tensor
    convs: torch.Tensor
    mask: torch.Tensor

    @property
    def frames(self) -> int:
        return int(self.mask.shape[-1])

    def row(self, i: int, frames: Optional[int] = None) -> "PrefixCache":
        """Row ``i`` alone, cut to its own prefix length (``frames`` where the caller knows it: no read of the
        mask, a device sync on a GPU)."""
        p = int(self.mask[i].sum()) if frames is None else frames
        return PrefixCache(self.keys[:, i:i + 1, :, :p], self.values[:, i:i + 1, :, :p], self.convs[:, i:i + 1],
                           self.mask[i:i + 1, :, :p])

    def copy(self) -> "PrefixCache":
        """Its own memory (a kept cache outlives the call whose output buffers it came in)."""
        return PrefixCache(self.keys.clone(), self.values.clone(), self.convs.clone(), self.mask.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.convs))

    @staticmethod
    def empty(shape: CacheShape, batch: int, like: torch.Tensor) -> "PrefixCache":
        """A cache of one masked frame per row: what a row with no prefix reads (nothing)."""
        z = dict(dtype=like.dtype, device=like.device)
        kv = (shape.layers, batch, shape.heads, 1, shape.head_dim)
        return PrefixCache(torch.zeros(kv, **z), torch.zeros(kv, **z),
                           torch.zeros(shape.convs, batch, shape.width, shape.tail, **z), torch.zeros(batch, 1, 1, **z))

    @staticmethod
    def stack(rows: list[Optional["PrefixCache"]]) -> "PrefixCache":
        """One batch's cache from one-row caches (``None``: a row that reads no prefix: masked keys, zero tails),
        padded to the longest (at least one frame)."""
        like = next(r for r in rows if r is not None)
        longest = max(1, max(r.frames for r in rows if r is not None))
        b = len(rows)
        keys = like.keys.new_zeros((like.keys.shape[0], b, like.keys.shape[2], longest, like.keys.shape[4]))
        values, convs = torch.zeros_like(keys), like.convs.new_zeros((like.convs.shape[0], b, *like.convs.shape[2:]))
        mask = like.mask.new_zeros((b, 1, longest))
        for i, r in enumerate(rows):
            if r is not None:
                p = r.frames
                keys[:, i, :, :p], values[:, i, :, :p] = r.keys[:, 0], r.values[:, 0]
                convs[:, i], mask[i, :, :p] = r.convs[:, 0], r.mask[0]
        return PrefixCache(keys, values, convs, mask)


class PrefixWalk:
    """One estimator call's pass over its layers: reads ``past`` in front of every row (or None) and records the
    first ``keep[i]`` frames of row ``i`` (``keep``: (B,) int64, or None; at least one frame is recorded, masked
    where a row keeps none); ``width``: the convolution tails' channels (``CacheShape.width``)."""

    def __init__(self, past: Optional[PrefixCache] = None, keep: Optional[torch.Tensor] = None, width: int = 0,
                 pad: int = 2, frames: Optional[int] = None):
        """``pad``: the causal convolutions' left frames (kernel - 1); ``frames``: the rows' length T (a traced size
        where exported). What every layer needs is made here once and no layer reads a shape (ONNX Runtime
        dispatches each graph op, a shape's too, for some 10-30 us whatever its size: shape arithmetic per layer
        made a 64-frame call 2 ms slower)."""
        self.past, self.keep, self.width = past, keep, width
        self._conv = self._attn = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._convs: list[torch.Tensor] = []
        if keep is not None:
            self._frames = torch.arange(torch.clamp(keep.max(), min=1), device=keep.device)
            self._key_mask = (self._frames[None, :] < keep[:, None]).float()[:, None, :]
            # row i's frames [keep_i - pad, keep_i) as one matrix product: (B, T, pad), zeros before its first
            at = keep[:, None] - pad + torch.arange(pad, device=keep.device)[None, :]
            self._tail = (torch.arange(frames, device=keep.device)[None, :, None] == at[:, None, :]).float()
        if past is not None:
            self._past_bias = mask_to_attention_bias(past.mask)   # (B, 1, 1, P)

    def conv_input(self, x: torch.Tensor, pad: int, channels: int) -> torch.Tensor:
        """A causal convolution's input (B, ``channels``, T), masked, with its ``pad`` left frames in front: the
        past prefix's last frames, or zeros (its own padding)."""
        if self.keep is not None:
            self._convs.append(torch.bmm(x, self._tail.to(x.dtype)))
        if self.past is not None:
            left = self.past.convs[self._conv, :, :channels]
            left = left if left.dtype == x.dtype else left.to(x.dtype)
        else:
            left = torch.nn.functional.pad(x[:, :, :0], (pad, 0))
        self._conv += 1
        return torch.cat([left, x], dim=-1)

    def attend(self, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
        """An attention layer's keys and values (B, H, T, D) and key bias (B, 1, 1, T) with the past prefix's in
        front; records the prefix's own."""
        if self.keep is not None:
            self._keys.append(k.index_select(2, self._frames))
            self._values.append(v.index_select(2, self._frames))
        if self.past is not None:
            j = self._attn
            pk, pv, pb = self.past.keys[j], self.past.values[j], self._past_bias
            if pk.dtype != k.dtype:
                pk, pv, pb = pk.to(k.dtype), pv.to(k.dtype), pb.to(bias.dtype)
            k, v, bias = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2), torch.cat([pb, bias], dim=-1)
        self._attn += 1
        return k, v, bias

    def recorded(self) -> PrefixCache:
        """What the call kept (``keep``), stacked."""
        convs = torch.stack([F.pad(t, (0, 0, 0, self.width - t.shape[1])) for t in self._convs])   # static widths
        return PrefixCache(torch.stack(self._keys), torch.stack(self._values), convs, self._key_mask)
