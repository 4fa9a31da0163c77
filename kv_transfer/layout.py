"""The shape of a paged KV cache, as both ends of a transfer must agree on it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KV layout {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KV layout dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        """Layout of a cache tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]`."""
        layers, _, _, block_size, kv_heads, head_dim = kv_cache.shape
        return cls(layers, block_size, kv_heads, head_dim, _DTYPE_NAMES[kv_cache.dtype])

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def token_elements(self) -> int:
        """Elements of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        return self.token_elements * torch.empty((), dtype=self.torch_dtype).element_size()

    def mismatch(self, other: KVLayout) -> str | None:
        """None if equal, else a message naming every field that differs."""
        diffs = [f"{k}: {v} vs {getattr(other, k)}" for k, v in asdict(self).items()
                 if v != getattr(other, k)]
        return "KV layouts differ (" + ", ".join(diffs) + ")" if diffs else None

    def to_proto(self, message) -> None:
        message.num_layers, message.block_size = self.num_layers, self.block_size
        message.num_kv_heads, message.head_dim, message.dtype = self.num_kv_heads, self.head_dim, self.dtype

    @classmethod
    def from_proto(cls, message) -> KVLayout:
        return cls(int(message.num_layers), int(message.block_size), int(message.num_kv_heads),
                   int(message.head_dim), str(message.dtype))


# Ops on tensors larger than this many elements run on torch's OpenMP pool, whose threads
# then spin for a while; on a transport's I/O thread that steals the core its socket needs
# (measured: gloo receive 0.9 GB/s with parallel copies vs 2.4 GB/s with serial ones).
_SERIAL_ELEMENTS = 32768


# A run of consecutive destination rows is copied as one slice (a plain memcpy, ~5x faster
# than index_copy_) when the runs average at least this many rows.
_MIN_MEAN_RUN = 64


def serial_index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                      index_np: np.ndarray | None = None) -> None:
    """`dst.index_copy_(0, index, src)` in pieces small enough to stay on this thread.
    With `index_np` (the same index in numpy), runs of consecutive rows go as slice copies."""
    if index_np is not None and len(index_np) > 1:
        breaks = np.flatnonzero(np.diff(index_np) != 1) + 1
        if len(index_np) >= _MIN_MEAN_RUN * (len(breaks) + 1):
            bounds = [0, *breaks.tolist(), len(index_np)]
            for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
                first = int(index_np[begin])
                serial_copy(dst[first : first + end - begin], src[begin:end])
            return
    rows = max(1, _SERIAL_ELEMENTS // max(1, src[0].numel()))
    for start in range(0, src.shape[0], rows):
        dst.index_copy_(0, index[start : start + rows], src[start : start + rows])


def serial_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for same-shape tensors, in pieces that stay on this thread."""
    rows = max(1, _SERIAL_ELEMENTS // max(1, src[0].numel()))
    for start in range(0, src.shape[0], rows):
        dst[start : start + rows].copy_(src[start : start + rows])
