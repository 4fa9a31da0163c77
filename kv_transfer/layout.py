"""The shape of a paged KV cache, as both ends of a transfer must agree on it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from pdserve.engine.dtypes import TORCH_DTYPES, dtype_name


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
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"KV layout dtype must be one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor) -> KVLayout:
        """Layout of a cache tensor `[layers, 2, blocks, block_size, kv_heads, head_dim]`."""
        layers, _, _, block_size, kv_heads, head_dim = kv_cache.shape
        return cls(layers, block_size, kv_heads, head_dim, dtype_name(kv_cache.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def token_elements(self) -> int:
        """Elements of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return self.token_elements * torch.empty((), dtype=self.torch_dtype).element_size()

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of the K and V of `num_tokens` tokens in every layer: what a transfer moves."""
        return num_tokens * self.token_bytes * self.num_layers

    def mismatch(self, other: KVLayout) -> str | None:
        """None if equal, else a message naming every field that differs."""
        diffs = [f"{k}: {v} vs {getattr(other, k)}" for k, v in asdict(self).items()
                 if v != getattr(other, k)]
        if not diffs:
            return None
        hint = ("; give both pools the same engine dtype (`auto` picks bf16 only on CPUs with "
                "native bf16)") if self.dtype != other.dtype else ""
        return "KV layouts differ (" + ", ".join(diffs) + ")" + hint

    def to_proto(self, message) -> None:
        message.num_layers, message.block_size = self.num_layers, self.block_size
        message.num_kv_heads, message.head_dim, message.dtype = self.num_kv_heads, self.head_dim, self.dtype

    @classmethod
    def from_proto(cls, message) -> KVLayout:
        return cls(int(message.num_layers), int(message.block_size), int(message.num_kv_heads),
                   int(message.head_dim), str(message.dtype))


# CPU copies on transport threads go through numpy. A numpy copy runs on the calling thread
# and releases the GIL; torch's `copy_` of a large tensor runs on its OpenMP pool, whose
# spinning threads steal the core the socket needs (measured: gloo receive 0.9 GB/s with
# parallel copies vs 2.4 GB/s with serial ones), and torch copies cut into pieces small
# enough to stay serial pay per-call overhead (a 3 MB strided K/V piece: 15 GB/s that way,
# 34 GB/s through numpy).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# `host_scatter` copies runs of consecutive rows as slices when they average at least this
# many rows; shorter runs go as one fancy-index assignment (a C loop over rows).
_MIN_MEAN_RUN = 16


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory, whatever its dtype (bf16 shows as int16):
    for moving bytes, not for arithmetic."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for same-shape CPU tensors, on this thread."""
    if dst.dtype != src.dtype:
        raise TypeError(f"host_copy of {src.dtype} into {dst.dtype}: the KV layout's dtype must match")
    np.copyto(as_numpy(dst), as_numpy(src))


def host_scatter(dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    """`dst[rows] = src` on this thread, rows along the first axis (`rows` distinct)."""
    if len(rows) == 0:
        return
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    if len(rows) < _MIN_MEAN_RUN * (len(breaks) + 1):
        dst[rows] = src
        return
    bounds = [0, *breaks.tolist(), len(rows)]
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        first = int(rows[begin])
        np.copyto(dst[first : first + end - begin], src[begin:end])
