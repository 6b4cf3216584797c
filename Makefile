# flodl — developer entry points. `make setup` is idempotent; `make demo` and `make test`
# call it first, so each works on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.flodl-installed

.PHONY: setup demo test test-fast bench proto clean

$(STAMP): pyproject.toml coordinator/pyproject.toml worker/pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q -e . -e ./coordinator -e './worker[examples]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/flodl run --local --ranks 3 --task digits --slowdown 1,2,4 --epochs 12 --policy cadence --summary demo-summary.json --output demo-model

test: setup
	$(BIN)/python -m pytest -q tests --durations=30

test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not integration"

bench: setup
	$(BIN)/python bench/control_rtt.py
	$(BIN)/python bench/control_scale.py --quick
	$(BIN)/python bench/hetero.py
	$(BIN)/python bench/planes.py
	$(BIN)/python bench/faults.py
	$(BIN)/python bench/timeline_overhead.py
	$(BIN)/python bench/startup.py

proto: setup
	mkdir -p build/proto
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=build/proto --pyi_out=build/proto proto/flodl/v1/flodl.proto
	cp build/proto/flodl/v1/flodl_pb2.py build/proto/flodl/v1/flodl_pb2.pyi flodl/wire/

clean:
	rm -rf build $(VENV) .pytest_cache demo-summary.json demo-summary.dashboard.html demo-summary.status.json demo-model
