"""Read tensors from a safetensors checkpoint (single file or sharded) onto a device/dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm


class CheckpointReader:
    """Name-addressed access to a checkpoint's tensors, cast to `dtype` on `device`.

    A missing required tensor raises `ValueError` naming it and the checkpoint directory.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        self.model_dir, self.dtype, self.device = Path(model_dir), dtype, device
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {self.model_dir}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"checkpoint {self.model_dir} has no tensor {name!r}")
        tensor = self._where[name].get_tensor(name)
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def stacked(self, names: list[str]) -> torch.Tensor:
        """Concatenate tensors along dim 0 (e.g. q/k/v projections into one matmul)."""
        return torch.cat([self.get(n) for n in names], dim=0)

    def stacked_optional(self, names: list[str]) -> torch.Tensor | None:
        present = [self.has(n) for n in names]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"checkpoint {self.model_dir} has only some of {names}")
        return self.stacked(names)

    def progress(self, num_layers: int):
        """Iterate layer indices with a progress bar (quiet for small models)."""
        return tqdm(range(num_layers), desc="Loading layers", leave=False,
                    disable=num_layers < 40)
