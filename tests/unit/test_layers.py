"""The import rules that keep the layers apart (README, "Layers").

A static check reads every module's imports (including the ones inside functions); a
runtime check starts what the router process imports and loads a tokenizer, and looks at
`sys.modules`: the router needs the tokenizer, never the model, so it never loads torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESS_PACKAGES = {"router", "cluster", "worker_base", "prefill_worker", "decode_worker"}
NOT_SHIPPED = {"tests", "testkit", "benchmarks"}
FORBIDDEN = {
    # the shared core knows nothing of disaggregation, RPC, HTTP or Ray
    "engine": {"kv_transfer", "protos", "grpc", "ray", "fastapi", "uvicorn"} | PROCESS_PACKAGES | NOT_SHIPPED,
    "kv_transfer": {"ray", "fastapi"} | PROCESS_PACKAGES | NOT_SHIPPED,
    "protos": {"torch", "kv_transfer"} | PROCESS_PACKAGES | NOT_SHIPPED,
    "worker_base": {"router", "cluster", "prefill_worker", "decode_worker"} | NOT_SHIPPED,
    "prefill_worker": {"router", "cluster", "decode_worker"} | NOT_SHIPPED,
    "decode_worker": {"router", "cluster", "prefill_worker"} | NOT_SHIPPED,
    "router": {"torch", "kv_transfer", "cluster", "worker_base", "prefill_worker", "decode_worker"} | NOT_SHIPPED,
    "cluster": NOT_SHIPPED,
    "benchmarks": {"tests"},
}


def imported_top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layers(package):
    files = [p for p in (ROOT / package).rglob("*.py") if not p.name.startswith("pdserve_pb2")]
    assert files, f"no modules found in {package}/"
    broken = {f"{path.relative_to(ROOT)} imports {name}"
              for path in files for name in imported_top_level_names(path) & FORBIDDEN[package]}
    assert not broken, sorted(broken)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kv_transfer.layout import KVLayout\n    import torch.nn\n")
    assert imported_top_level_names(module) == {"kv_transfer", "torch"}


def test_router_process_never_loads_torch(smollm2_dir):
    code = (
        "import sys\n"
        "import router.server, router.app, router.generation, router.registry, router.policies\n"
        "from engine.model_source import resolve_model\n"
        "from engine.tokenizer import apply_chat_template, load_tokenizer\n"
        f"tokenizer = load_tokenizer(resolve_model({str(smollm2_dir)!r}, convert_in_subprocess=True))\n"
        "assert apply_chat_template(tokenizer, [{'role': 'user', 'content': 'hi'}])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, f'the router process imported {loaded[:5]}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


SHIPPED_PACKAGES = ["engine", "kv_transfer", "protos", "worker_base", "prefill_worker", "decode_worker",
                    "router", "cluster"]


def test_no_other_installed_distribution_ships_our_top_level_packages():
    """pdserve installs these as top-level packages (README: "Top-level package names"); any
    other installed distribution providing one of them would shadow or be shadowed."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    clashes = {name: sorted(set(providers[name]) - {"pdserve"}) for name in SHIPPED_PACKAGES
               if set(providers.get(name, ())) - {"pdserve"}}
    assert not clashes, f"installed distributions that also provide our packages: {clashes}"


def test_the_wheel_config_ships_exactly_these_packages():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(SHIPPED_PACKAGES)
