"""From an EngineConfig to a loaded model and a sized KV cache (shared by every worker kind)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import EngineConfig, default_cpu_kv_cache_bytes
from pdserve.engine.cpu import native_bf16_flags
from pdserve.engine.dtypes import TORCH_DTYPES, dtype_name
from pdserve.engine.model.llama import CausalLM, ModelShape
from pdserve.engine.model.weights import CheckpointReader
from pdserve.engine.model_source import cache_dir, check_architecture, resolve_model
from pdserve.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pdserve.engine.sim import SimModel

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model_dir: Path
    hf_config: object
    model: CausalLM | SimModel  # SimModel: the simulated engine's shapes, no weights
    _tokenizer: object | None
    max_model_len: int
    eos_token_ids: frozenset[int]
    # where set, `tokenizer` is loaded from it at its first use (a simulated engine's whose
    # facts are recorded, see sim_facts: in a worker only structured output reads it)
    _tokenizer_source: Callable[[], object] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def shape(self) -> ModelShape:
        return self.model.shape

    @property
    def tokenizer(self) -> object | None:
        if self._tokenizer_source is not None:
            with self._lock:
                if self._tokenizer_source is not None:
                    self._tokenizer, self._tokenizer_source = self._tokenizer_source(), None
        return self._tokenizer


def load_model(config: EngineConfig) -> LoadedModel:
    """The model `config` names with its tokenizer and limits; for the simulated engine
    (`config.is_sim`) the tokenizer and shapes of `sim.like` and no weights (engine.sim.SimModel),
    what it reads of the checkpoint's config and tokenizer taken from `sim_facts`."""
    model_dir = resolve_model(config.checkpoint)
    facts = sim_facts(model_dir) if config.is_sim else None
    if facts is not None:
        hf_config = facts.config
    else:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(model_dir))
    check_architecture(hf_config)
    device, dtype = resolve_device_dtype(config)
    max_model_len = resolve_max_model_len(config, hf_config)
    if config.is_sim:
        from pdserve.engine.sim import SimModel

        model = SimModel(ModelShape.from_hf_config(hf_config), dtype, device)
    else:
        model = _load_weights(model_dir, hf_config, dtype, device, max_model_len)
    if facts is None:
        tokenizer = load_tokenizer(model_dir)
        return LoadedModel(model_dir, hf_config, model, tokenizer, max_model_len,
                           _eos_token_ids(model_dir, hf_config, tokenizer))
    if facts.tokenizer is not _NOT_READ or not facts.has_tokenizer:
        # read just now, or the checkpoint has none (loaded here all the same: its warning)
        tokenizer = facts.tokenizer if facts.tokenizer is not _NOT_READ else load_tokenizer(model_dir)
        return LoadedModel(model_dir, hf_config, model, tokenizer, max_model_len,
                           _eos_token_ids(model_dir, hf_config, tokenizer, facts.generation_eos))
    eos = _eos_token_ids(model_dir, hf_config, None, facts.generation_eos, facts.tokenizer_eos)
    return LoadedModel(model_dir, hf_config, model, None, max_model_len, eos,
                       _tokenizer_source=lambda: load_tokenizer(model_dir))


# What the simulated engine reads of a transformers config (ModelShape.from_hf_config,
# check_architecture, resolve_max_model_len, _eos_token_ids); an attribute the config lacks
# stays absent, so getattr's defaults apply as they would to the config itself.
_SIM_CONFIG_ATTRS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                     "sliding_window", "use_sliding_window", "eos_token_id")
_SIM_FACTS_VERSION = 1  # bump when what is recorded changes
_NOT_READ = object()
_NO_GENERATION_CONFIG = "absent"  # recorded: GenerationConfig.from_pretrained raised OSError
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_HASHED_UP_TO = 64 << 20  # a larger file is keyed by its size and mtime, not its bytes


@dataclass
class SimFacts:
    """What the simulated engine reads of its checkpoint (but the tokenizer's use)."""

    config: types.SimpleNamespace  # the _SIM_CONFIG_ATTRS that AutoConfig's config has
    generation_eos: object  # GenerationConfig's eos_token_id; _NO_GENERATION_CONFIG: none
    has_tokenizer: bool  # load_tokenizer returned one
    tokenizer_eos: object  # its eos_token_id
    tokenizer: object = _NOT_READ  # the tokenizer, where reading the facts loaded it


def sim_facts(model_dir: Path) -> SimFacts:
    """What transformers makes of the checkpoint's files, as far as the simulated engine reads
    it: the _SIM_CONFIG_ATTRS of `AutoConfig.from_pretrained`, GenerationConfig's eos_token_id,
    and whether `load_tokenizer` gives a tokenizer and its eos_token_id. Recorded once per
    machine under the cache dir, keyed by the checkpoint's files but weights (their bytes) and
    transformers' and tokenizers' versions. With a record, a simulated worker starts without
    importing transformers (AutoConfig's LlamaConfig imports torch.distributed and sympy:
    ~0.8 s of CPU and ~70 MiB a process; transformers and the tokenizer ~0.5 s and ~70 MiB)
    and loads its tokenizer at its first use (a worker's: structured output only)."""
    path = _sim_facts_path(model_dir)
    if path is not None:
        try:
            recorded = json.loads(path.read_text())
            return SimFacts(types.SimpleNamespace(**recorded["config"]), recorded["generation_eos"],
                            bool(recorded["has_tokenizer"]), recorded["tokenizer_eos"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    attrs = {name: getattr(hf_config, name) for name in _SIM_CONFIG_ATTRS if hasattr(hf_config, name)}
    try:
        generation_eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:
        generation_eos = _NO_GENERATION_CONFIG
    tokenizer = load_tokenizer(model_dir)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    record = {"config": attrs, "generation_eos": generation_eos, "has_tokenizer": tokenizer is not None,
              "tokenizer_eos": tokenizer_eos}
    facts = SimFacts(types.SimpleNamespace(**attrs), generation_eos, tokenizer is not None, tokenizer_eos, tokenizer)
    try:
        encoded = json.dumps(record)
        if json.loads(encoded) != record:
            raise ValueError("a value JSON does not carry as it is")
    except (TypeError, ValueError):
        return facts  # not recorded: read by transformers every time
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(encoded)
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("cannot record the sim facts in %s: %s", path, exc)
    return facts


def _sim_facts_path(model_dir: Path) -> Path | None:
    """Where `sim_facts` records a checkpoint's: named by a hash of its files but weights and
    of transformers' and tokenizers' versions; None where they cannot be read."""
    digest = hashlib.sha256(f"v{_SIM_FACTS_VERSION}".encode())
    try:
        for package in ("transformers", "tokenizers"):
            digest.update(f"\0{package}={importlib.metadata.version(package)}".encode())
        files = sorted(p for p in Path(model_dir).iterdir()
                       if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_WEIGHT_SUFFIXES))
        if not any(p.name == "config.json" for p in files):
            return None
        for p in files:
            size = p.stat().st_size
            content = (hashlib.sha256(p.read_bytes()).hexdigest() if size <= _HASHED_UP_TO
                       else f"{size}:{p.stat().st_mtime_ns}")
            digest.update(f"\0{p.name}\0{content}".encode())
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return cache_dir() / "sim-facts" / f"{digest.hexdigest()[:32]}.json"


def _load_weights(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> CausalLM:
    if device.type == "cpu":
        from pdserve.engine.model.kernels import cpu_kernels

        cpu_kernels()  # built (once) at load, so no request waits for the compiler
    return CausalLM(hf_config, CheckpointReader(model_dir, dtype, device), max_model_len)


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA when a GPU is present (the simulated engine: always the CPU, which
    is all it needs), else CPU. `auto` dtype: see `auto_dtype`."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() and not config.is_sim else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA device is available")
    if config.dtype == "auto":
        dtype, why = auto_dtype(device)
        logger.info("dtype %s (auto: %s)", dtype_name(dtype), why)
    else:
        dtype = TORCH_DTYPES[config.dtype]
    return device, dtype


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """bf16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), fp32 on
    other CPUs, where bf16 is emulated and slower. Returns the dtype and why it was chosen."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = native_bf16_flags()
    if flags:
        return torch.bfloat16, f"this CPU has native bf16 ({', '.join(flags)})"
    return torch.float32, "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # no sliding-window attention: stay inside the window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len


def kv_block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """How many blocks the KV budget holds; raises if one max-length request cannot fit."""
    model = loaded.model
    per_block = kv_block_bytes(model.shape, config.block_size, model.dtype)
    budget = config.kv_cache_bytes
    if budget is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = default_cpu_kv_cache_bytes()
    num_blocks = budget // per_block
    needed = -(-loaded.max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {budget} bytes hold {num_blocks} blocks of {config.block_size} "
            f"tokens, but one request of max_model_len={loaded.max_model_len} needs {needed} "
            f"blocks ({needed * per_block} bytes). Raise kv_cache_bytes or lower max_model_len."
        )
    return num_blocks


def _eos_token_ids(model_dir: Path, hf_config, tokenizer, generation_eos: object = _NOT_READ,
                   tokenizer_eos: object = _NOT_READ) -> frozenset[int]:
    """`generation_eos`, `tokenizer_eos`: the eos_token_id of the checkpoint's GenerationConfig
    (_NO_GENERATION_CONFIG where it has none) and of its tokenizer, where the caller read
    them already (sim_facts)."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if tokenizer_eos is not _NOT_READ:
        candidates.append(tokenizer_eos)
    elif tokenizer is not None:
        candidates.append(getattr(tokenizer, "eos_token_id", None))
    if generation_eos is _NOT_READ:
        try:
            from transformers import GenerationConfig

            candidates.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
        except OSError:
            pass
    elif generation_eos != _NO_GENERATION_CONFIG:
        candidates.append(generation_eos)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
