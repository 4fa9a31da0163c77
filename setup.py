"""Installs the repository's top-level package directories under one namespace: `engine/` is
`pdserve.engine`, `router/` is `pdserve.router`, and so on. The wheel's only top-level name is
`pdserve` (an implicit namespace package); everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

# The directories that ship; tests/, benchmarks/ and deploy/ do not.
PACKAGES = ("engine", "kv_transfer", "protos", "rpc", "worker_base", "prefill_worker", "decode_worker",
            "router", "cluster", "testkit")

setup(
    package_dir={f"pdserve.{name}": name for name in PACKAGES},
    packages=[f"pdserve.{found}" for found in find_packages(include=[f"{name}{tail}" for name in PACKAGES
                                                                       for tail in ("", ".*")])],
)
