"""torch dtypes by the names configs and the KV layout on the wire use."""

from __future__ import annotations

import torch

from pdserve.engine.config import DTYPE_NAMES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The config/wire name of a torch dtype pdserve stores weights or KV in."""
    if dtype not in _NAMES:
        raise ValueError(f"unsupported dtype {dtype}; one of {', '.join(DTYPE_NAMES)}")
    return _NAMES[dtype]
