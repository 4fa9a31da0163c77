"""Command-line flags derived from a config class's fields, so that each setting is declared
once: its name, type, default, bounds and help live on the field, and the flag follows.

The config class is a dataclass (EngineConfig) or a pydantic model (the router's and the
workers' settings); pydantic is read by duck typing (`model_fields`), so this module, the
lowest layer, imports nothing beyond the standard library and EngineConfig. Each field gives
one flag (`ConfigOption`):

- its name with dashes, `max_num_seqs` -> `--max-num-seqs`; the fields of a nested config
  class are prefixed with its name, `cache_aware.kv_tokens` -> `--cache-aware-kv-tokens`;
  or the `flag` its metadata names (a dataclass field's `metadata={"flag": ...}`, a pydantic
  field's `json_schema_extra={"flag": ...}`);
- its type: `X | None` is X, a bool gives `--x/--no-x`, a Literal the choices, a list or
  tuple a repeatable flag (`action="append"`), anything else converts the text with the type;
- its default, and its help (`metadata={"help": ...}`, a pydantic `description`, or the
  `helps` given), with " (default: ...)" added unless it is None or the text explains it.

Values come back as the class takes them (`config_values`, `config_from_args`): nested
fields as mappings, which a pydantic model validates. Bounds are the class's to check: a
pydantic error is reported naming the flags."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Literal

from pdserve.engine.config import EngineConfig

_HELP = {
    "model": "model name, local HF checkpoint dir, .gguf file, or cached hub id, or `sim`: the simulated engine "
             "(--sim-* flags; default: the embedded SmolLM2-135M-Instruct)",
    "device": "auto | cpu | cuda[:N] (auto: CUDA if present)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and on CPUs with native bf16 "
             "arithmetic, avx512_bf16 or amx_bf16; fp32 on other CPUs)",
    "block_size": "tokens per KV-cache block",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
    "kv_cache_bytes": ("KV cache budget in bytes (default: $PDSERVE_CPU_KV_CACHE_BYTES or 2 GiB on CPU, "
                       "a fraction of free GPU memory)"),
    "gpu_memory_utilization": "fraction of free GPU memory for the KV cache",
    "seed": "seed for requests that bring none",
    "enable_prefix_caching": "reuse the KV of cached full blocks of earlier prompts and replies",
}
_REQUIRED = object()  # a field without a default


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """The flag of one field: `path` names the field from the top-level class down."""

    path: tuple[str, ...]
    flag: str
    kwargs: dict  # add_argument's keywords but `dest`

    @property
    def dest(self) -> str:
        return "_".join(self.path)


def config_options(schema: type, exclude: Collection[str] = (), helps: Mapping[str, str] | None = None,
                   ) -> list[ConfigOption]:
    """The flags of `schema`'s fields but those whose dotted path is in `exclude` (a nested
    class's path excludes all of its fields); `helps` (by field name) overrides help texts."""
    return list(_options(schema, None, (), set(exclude), helps or {}))


def add_config_args(parser, schema: type, exclude: Collection[str] = (),
                    helps: Mapping[str, str] | None = None) -> list[ConfigOption]:
    """Add `schema`'s flags to `parser` (a parser or an argument group); returns them."""
    options = config_options(schema, exclude, helps)
    for option in options:
        parser.add_argument(option.flag, dest=option.dest, **option.kwargs)
    return options


def config_values(args: argparse.Namespace, options: list[ConfigOption]) -> dict:
    """The parsed values of `options`, keyed as the class takes them (nested: mappings)."""
    values: dict = {}
    for option in options:
        *parents, leaf = option.path
        node = values
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = getattr(args, option.dest)
    return values


def config_from_args(schema: type, args: argparse.Namespace, exclude: Collection[str] = (), **given: Any):
    """`schema` built from the parsed flags (those `add_config_args` added with the same
    `exclude`) and the fields `given`; ValueError naming the flag of any bad value."""
    options = config_options(schema, {*exclude, *given})
    try:
        return schema(**config_values(args, options), **given)
    except ValueError as exc:
        raise ValueError(_name_flags(exc, options)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser.add_argument_group("engine"), EngineConfig, helps=_HELP)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def _options(schema: type, instance: Any, prefix: tuple[str, ...], exclude: set[str],
             helps: Mapping[str, str]) -> Iterator[ConfigOption]:
    for name, annotation, default, meta in _fields(schema, instance):
        path = (*prefix, name)
        if ".".join(path) in exclude:
            continue
        if _is_config_class(annotation):
            yield from _options(annotation, None if default is _REQUIRED else default, path, exclude, helps)
            continue
        text = helps.get(name, meta.get("help") or "").replace("%", "%%")
        if default is not None and default is not _REQUIRED and "(default:" not in text:
            text += " (default: %(default)s)"
        flag = meta.get("flag") or "--" + "-".join(path).replace("_", "-")
        kwargs = {**_kind(annotation), "help": text.strip()}
        if "type" in kwargs and "choices" not in kwargs:  # --api-key KEY, not API_KEYS
            kwargs["metavar"] = flag.removeprefix("--").replace("-", "_").upper()
        kwargs.update({"required": True} if default is _REQUIRED else {"default": default})
        yield ConfigOption(path, flag, kwargs)


def _fields(schema: type, instance: Any) -> Iterator[tuple[str, Any, Any, dict]]:
    """(name, type, default, {help, flag}) of each field; defaults from `instance` if given."""
    if dataclasses.is_dataclass(schema):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED)
            yield f.name, hints[f.name], getattr(instance, f.name, default), dict(f.metadata)
        return
    for name, info in schema.model_fields.items():
        default = _REQUIRED if info.is_required() else info.get_default(call_default_factory=True)
        meta = {"help": info.description, **(info.json_schema_extra or {})}
        yield name, info.annotation, getattr(instance, name, default), meta


def _is_config_class(annotation: Any) -> bool:
    return isinstance(annotation, type) and (dataclasses.is_dataclass(annotation) or
                                             hasattr(annotation, "model_fields"))


def _kind(annotation: Any) -> dict:
    """add_argument's type, action or choices for a field of this type."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(args), "type": type(args[0])}
    if origin in (list, tuple):
        return {"action": "append", "type": args[0]}
    return {"type": annotation}


def _name_flags(exc: ValueError, options: list[ConfigOption]) -> str:
    """A pydantic error's problems, each named by its flag (or flags); other errors as they are."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    problems = []
    for error in errors():
        loc = tuple(str(part) for part in error["loc"])
        flags = [o.flag for o in options if loc and o.path[:len(loc)] == loc]
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{'/'.join(flags) or '.'.join(loc)}: {message}" if flags or loc else message)
    return "; ".join(problems)
