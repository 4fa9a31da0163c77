"""Engine configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SIM_MODEL = "sim"  # the model name of the simulated engine (engine.sim)
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
CPU_KV_CACHE_ENV = "PDSERVE_CPU_KV_CACHE_BYTES"  # overrides DEFAULT_CPU_KV_CACHE_BYTES


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what weights and KV may be stored in
DEFAULT_KV_TIER_BYTES = 8 * 1024**3  # the second KV tier's store (KVTierConfig.budget_bytes)
DEFAULT_KV_TIER_HOST_BYTES = 4 * 1024**3  # its pinned host level per GPU worker (KVTierConfig.host_bytes)
KV_TIER_DIRNAME = "kv-tier"  # its default directory, under $PDSERVE_CACHE
KV_TIER_DIR_ENV = "PDSERVE_KV_TIER_DIR"  # names that directory for every worker of a host (KVTierConfig.directory)


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine (`model: sim`, engine.sim): the real engine with its forward pass
    replaced by the latency model of a `pdserve profile`. Read only when the model is `sim`."""

    like: str = field(default=DEFAULT_MODEL, metadata={
        "help": "the model whose tokenizer and shapes (config.json) the simulated engine takes; its weights are "
                "never loaded"})
    profile: str | None = field(default=None, metadata={
        "help": "a `pdserve profile` JSON whose latency model sets each step's time (default: the committed "
                "2-core profile of SmolLM2-135M, engine/sim_profile.json)"})
    speed: float = field(default=1.0, metadata={"help": "step times are the profile's divided by this"})
    kv_bytes: bool = field(default=True, metadata={
        "help": "ship KV of the real size; --no-sim-kv-bytes: a stand-in of one element per token and layer, "
                "for clusters larger than memory allows"})

    def __post_init__(self) -> None:
        if not isinstance(self.like, str) or not self.like or self.like == SIM_MODEL:
            raise ValueError(f"sim.like must name a real model (its tokenizer and shapes), got {self.like!r}")
        if self.profile is not None and (not isinstance(self.profile, str) or not self.profile):
            raise ValueError(f"sim.profile must be a path to a `pdserve profile` JSON or null, got {self.profile!r}")
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"sim.speed must be a finite number > 0, got {speed!r}")
        if not isinstance(self.kv_bytes, bool):
            raise ValueError(f"sim.kv_bytes must be true or false, got {self.kv_bytes!r}")


@dataclass(frozen=True)
class KVTierConfig:
    """The second KV tier (engine.kv_tier): every full prefix block's KV, as the engine
    computes it, is written through to a file store on the node (engine.kv_store) that the
    workers naming the same directory share, and a prompt's blocks found there are loaded
    back instead of recomputed when reading them is predicted to be faster. Needs prefix
    caching (the tier keys blocks by their chained hashes); the simulated engine computes no
    KV, so it runs without the tier (enabling both is refused)."""

    enabled: bool | None = field(default=None, metadata={
        "help": "keep computed prefix blocks' KV in a store on this node, shared by its workers, and load a "
                "prompt's blocks back from it when that beats recomputing them (default: on in a serving "
                "worker with a real model and prefix caching, off in the offline engine and `pdserve generate`)"})
    budget_bytes: int = field(default=DEFAULT_KV_TIER_BYTES, metadata={
        "help": "bytes of KV the store keeps; past it the least recently used blocks go"})
    host_bytes: int = field(default=DEFAULT_KV_TIER_HOST_BYTES, metadata={
        "help": "on a GPU worker, bytes of its own pinned host memory that keep blocks in front of the node's "
                "store, least recently used dropped first (0: none; CPU workers have none: their pool is host "
                "memory already)"})
    directory: str | None = field(default=None, metadata={
        "help": f"the store's directory (default: ${KV_TIER_DIR_ENV}, else $PDSERVE_CACHE/{KV_TIER_DIRNAME}); "
                "each KV layout (model, dtype, block size, shapes) keeps a subdirectory of its own"})

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ValueError(f"kv_tier.enabled must be true, false or null (the default), got {self.enabled!r}")
        _check_range("kv_tier.budget_bytes", self.budget_bytes, 1, 1 << 60)
        _check_range("kv_tier.host_bytes", self.host_bytes, 0, 1 << 50)
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ValueError(f"kv_tier.directory must be a path or null, got {self.directory!r}")


def checkpoint_of(model: str, sim: SimConfig) -> str:
    """The model whose tokenizer and config.json `model` loads: `sim.like` for the simulated
    engine, `model` itself otherwise."""
    return sim.like if model == SIM_MODEL else model


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance runs and with how much memory.

    `model` is a model name or path as accepted by `engine.model_source.resolve_model`, or
    `sim` (SIM_MODEL): the simulated engine configured by `sim` (a mapping is taken as its fields).
    `max_model_len=None` takes the model's own limit (capped by a sliding window).
    `kv_cache_bytes=None` means: on CPU `$PDSERVE_CPU_KV_CACHE_BYTES` or else 2 GiB (see
    `default_cpu_kv_cache_bytes`), on CUDA `gpu_memory_utilization` of the free GPU memory
    (after weights).
    `kv_tier` is the second KV tier (KVTierConfig, a mapping taken as its fields); `kv_tier_on`
    says whether an engine runs it.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    sim: SimConfig = field(default_factory=SimConfig)
    kv_tier: KVTierConfig = field(default_factory=KVTierConfig)

    def __post_init__(self) -> None:
        for name, kind in (("sim", SimConfig), ("kv_tier", KVTierConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):  # flags and YAML give nested settings as mappings
                object.__setattr__(self, name, value := kind(**value))
            if not isinstance(value, kind):
                raise ValueError(f"{name} must be a {kind.__name__} or a mapping of its fields, "
                                 f"got {type(value).__name__}")
        if self.kv_tier.enabled is True and not self._kv_tier_can_run:
            raise ValueError("kv_tier.enabled needs prefix caching (the tier keys blocks by their hashes) and a real "
                             "model (the simulated engine computes no KV to keep)")
        _check_range("block_size", self.block_size, 1, 1024)
        _check_range("max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24)
        if self.max_model_len is not None:
            _check_range("max_model_len", self.max_model_len, 2, 1 << 24)
        if self.kv_cache_bytes is not None:
            _check_range("kv_cache_bytes", self.kv_cache_bytes, 1, 1 << 50)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")

    @property
    def is_sim(self) -> bool:
        """Whether this is the simulated engine (engine.sim)."""
        return self.model == SIM_MODEL

    @property
    def _kv_tier_can_run(self) -> bool:
        return not self.is_sim and self.enable_prefix_caching is True

    def kv_tier_on(self, serving: bool) -> bool:
        """Whether an engine runs the second KV tier: as `kv_tier.enabled` says, and when that
        is null (the default) in a serving worker's engine (`serving`) with a real model and
        prefix caching. It pays there: a worker serves turns that come back after their blocks
        left its pool, and workers on one node share the store; loading is chosen per request
        only when it beats recomputing. The offline engine runs batches whose shared prefixes
        are scheduled together, so it keeps the tier off unless asked."""
        if self.kv_tier.enabled is None:
            return serving and self._kv_tier_can_run
        return self.kv_tier.enabled

    @property
    def checkpoint(self) -> str:
        """The model whose tokenizer and config.json the engine loads (`checkpoint_of`)."""
        return checkpoint_of(self.model, self.sim)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments, naming any that are not engine options."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)


def _check_range(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def default_cpu_kv_cache_bytes() -> int:
    """The CPU KV budget of an engine given no `kv_cache_bytes`: `$PDSERVE_CPU_KV_CACHE_BYTES`
    when set (like vLLM's `VLLM_CPU_KVCACHE_SPACE`: one knob for every engine a host starts,
    bare workers and Ray actors included, since they inherit the environment), else 2 GiB.
    The whole budget is allocated (and zeroed) at start-up."""
    import os

    raw = os.environ.get(CPU_KV_CACHE_ENV, "").strip()
    if not raw:
        return DEFAULT_CPU_KV_CACHE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CPU_KV_CACHE_ENV} must be a positive number of bytes (e.g. {512 << 20} for "
                         f"512 MiB), got {raw!r}; unset it for the 2 GiB default")
    return value
