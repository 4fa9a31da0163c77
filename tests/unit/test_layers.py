"""The import rules that keep the layers apart (docs/design.md, "Layers").

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
NOT_PRODUCT = {"tests", "testkit", "benchmarks"}
FORBIDDEN = {
    # the shared core knows nothing of disaggregation, RPC, HTTP or Ray
    "engine": {"kv_transfer", "protos", "rpc", "grpc", "ray", "fastapi", "uvicorn"} | PROCESS_PACKAGES | NOT_PRODUCT,
    "kv_transfer": {"ray", "fastapi"} | PROCESS_PACKAGES | NOT_PRODUCT,
    "protos": {"torch", "kv_transfer", "rpc"} | PROCESS_PACKAGES | NOT_PRODUCT,
    "rpc": {"torch", "kv_transfer"} | PROCESS_PACKAGES | NOT_PRODUCT,
    "worker_base": {"router", "cluster", "prefill_worker", "decode_worker"} | NOT_PRODUCT,
    "prefill_worker": {"router", "cluster", "decode_worker"} | NOT_PRODUCT,
    "decode_worker": {"router", "cluster", "prefill_worker"} | NOT_PRODUCT,
    "router": {"torch", "kv_transfer", "cluster", "worker_base", "prefill_worker", "decode_worker"} | NOT_PRODUCT,
    "cluster": NOT_PRODUCT,
    "benchmarks": {"tests"},
}


def layer_of(module: str) -> str:
    """The layer an absolute import names: `pdserve.router.app` -> "router", `torch.nn` -> "torch"."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


def imported_top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(layer_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(layer_of(node.module))
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
    module.write_text("def f():\n    from pdserve.kv_transfer.layout import KVLayout\n    import torch.nn\n")
    assert imported_top_level_names(module) == {"kv_transfer", "torch"}


def test_router_process_never_loads_torch(smollm2_dir):
    code = (
        "import sys\n"
        "import pdserve.router.server, pdserve.router.app, pdserve.router.generation\n"
        "import pdserve.router.registry, pdserve.router.policies\n"
        "from pdserve.engine.model_source import resolve_model\n"
        "from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer\n"
        f"tokenizer = load_tokenizer(resolve_model({str(smollm2_dir)!r}, convert_in_subprocess=True))\n"
        "assert apply_chat_template(tokenizer, [{'role': 'user', 'content': 'hi'}])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, f'the router process imported {loaded[:5]}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_setup_installs_every_package_directory_under_pdserve():
    """setup.py maps each product directory to pdserve.<dir>; one it forgot would not install."""
    (packages,) = [ast.literal_eval(node.value) for node in ast.parse((ROOT / "setup.py").read_text()).body
                   if isinstance(node, ast.Assign) and node.targets[0].id == "PACKAGES"]
    directories = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert set(packages) == directories
