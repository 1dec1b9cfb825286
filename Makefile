# Trellis: `make run` starts the whole stack on the demo model; `make test` runs every check.
# Both create what they need: the virtualenv (.venv), the demo model (models/demo), the stubs.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= models/demo
PROTOS := $(wildcard proto/trellis/generate/v1/*.proto)
GEN := gen/python/trellis/generate/v1/generate_pb2.py gen/python/trellis/generate/v1/generate_service_pb2.py
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test lint gateway-check proto proto-check bench bench-overhead bench-guided bench-prefix soak venv model clean system-deps aiperf vllm-venv

venv: $(STAMP)

# torch comes first, from the local CPU wheel: installing it as a dependency would pull the
# newest CUDA build (several GB). text-generation pins huggingface-hub<1.0, which transformers 5
# cannot use, so it goes in without its dependencies (its real imports are all present).
# xgrammar, the grammar library TensorRT-LLM compiles guides with (the version its
# requirements.txt pins), is for the tests of the TensorRT-LLM engines' XGrammar check. It goes
# in without its dependencies too: its metadata asks for triton (a GPU compiler, hundreds of MB)
# and ninja, which only its GPU kernels use; what it imports (torch, transformers, pydantic,
# numpy) is all present, and grammars compile on CPU without them.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[core,gateway,dev]"
	$(PY) -m pip install -q --no-deps text-generation==0.7.0
	$(PY) -m pip install -q --no-deps xgrammar==0.1.25
	touch $(STAMP)

model: $(MODEL)/config.json

# The script fixes the steps, seed and size: a change to it rebuilds the model.
$(MODEL)/config.json: scripts/make_demo_model.py | $(STAMP)
	$(PY) scripts/make_demo_model.py --output $(MODEL)

# Regenerates the committed stubs only when a .proto changed.
$(GEN): $(PROTOS) | $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh
	touch $(GEN)

proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

proto-check: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh --check

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# A gateway installs and answers without torch: a fresh virtualenv with only `.[gateway]`.
gateway-check:
	$(PYTHON) scripts/check_gateway_install.py

run: $(STAMP) $(GEN) model
	$(PY) scripts/run_stack.py --model $(MODEL)

# System packages the tests use, from Debian: haproxy (tests/integration/test_haproxy.py) and
# redis-server (tests/integration/test_response_store_redis.py).
system-deps:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy; }
	@command -v redis-server >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# The benchmark client of tests/integration/test_compat_aiperf.py in a virtualenv of its own:
# aiperf's pins clash with the project's (huggingface_hub<2, pandas 2.3), so it cannot share
# .venv. Every version is pinned in the requirements file; about 1.2 GB, a few minutes to create.
AIPERF_VENV ?= .cache/aiperf-venv
AIPERF_REQS := tests/integration/aiperf-requirements.txt
aiperf: $(AIPERF_VENV)/.installed

$(AIPERF_VENV)/.installed: $(AIPERF_REQS)
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q -r $(AIPERF_REQS)
	touch $@

# vLLM's CPU build, the comparator of `scripts/bench/prefix.py --baseline vllm` (not part of make
# test; about 2.5 GB). Every version is pinned in the requirements file and installed without
# dependencies (why: its header). torch 2.13.0+cpu is not on PyPI: pip finds it through the
# machine's pip configuration (a local wheel) or through VLLM_PIP_ARGS, e.g.
# VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_VENV ?= .cache/vllm-venv
VLLM_REQS := scripts/bench/vllm-requirements.txt
VLLM_PIP_ARGS ?=
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(VLLM_REQS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(VLLM_PIP_ARGS) -r $(VLLM_REQS)
	touch $@

test: proto-check lint system-deps aiperf
	TRELLIS_AIPERF=$(CURDIR)/$(AIPERF_VENV)/bin/aiperf $(PY) -m pytest -q

bench: $(STAMP) $(GEN) model
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench/run_all.py --model $(MODEL)

# The serving-overhead section alone (mock engine, about 3 minutes).
bench-overhead: $(STAMP) $(GEN) model
	$(PY) scripts/bench/run_all.py --model $(MODEL) --only overhead

# The guided-decoding section alone: JSON-schema-constrained vs free tokens/s at 16 streams.
bench-guided: $(STAMP) $(GEN) model
	$(PY) scripts/bench/run_all.py --model $(MODEL) --only guided

# The prefix section alone: the prefix cache on vs off, prefix routing vs round robin, memory.
bench-prefix: $(STAMP) $(GEN) model
	$(PY) scripts/bench/run_all.py --model $(MODEL) --only prefix

# The reliability suite's long run (about 18 minutes; mock engine, and the HF engine on the demo
# model for its engine process's stop and kill; every process on loopback): figures in
# bench-results/reliability.json. SOAK_ARGS passes flags, e.g. SOAK_ARGS="--soak-seconds 300", or
# SOAK_ARGS="--only abuse" for slow readers, compressed bombs and the engine process alone.
SOAK_ARGS ?=
soak: $(STAMP) $(GEN) model
	$(PY) scripts/bench/soak.py --model $(MODEL) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(AIPERF_VENV) $(VLLM_VENV) models bench-results .pytest_cache .ruff_cache .mypy_cache
