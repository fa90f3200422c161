# bsr: two commands on a fresh machine.
#   make bench      - set up, then run the benchmark on built-in defaults (the main job)
#   make test       - set up (packages + system tools), then run the whole test suite, each phase
#                     timed (the table at the end)
#   make test-quick - the library suite without vLLM, for the edit-run loop
#   make docs       - the documentation site (docs/ and the API reference) into site/
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

VLLM_VENV ?= .venv-vllm
LMCACHE_VENV ?= .venv-lmcache
SGLANG_VENV ?= .venv-sglang
SGLANG ?= sglang==0.5.23

.PHONY: setup system-deps bench-deps docs test test-main test-bench-vllm test-quick test-vllm wheel-check \
	test-sglang test-bench-runs \
	lmcache-venv \
	lint-imports bench lint typecheck clean gpu-wheels gpu-dry-run

setup: $(VENV)/.bsr-installed

# bsr and its benchmark (bsr-bench, bench/pyproject.toml; `bsr bench` needs it, so do tests/bench),
# both editable, in one resolve (bsr-bench's `bsr-kv` requirement is met by the checkout)
$(VENV)/.bsr-installed: pyproject.toml bench/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# a CPU torch build unless one is already there (an unpinned torch would pull a CUDA build)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_CPU)"
	# bsr was installed as the distribution `bsr` before it was `bsr-kv`: drop that install first
	$(BIN)/python -m pip uninstall -q -y bsr 2>/dev/null || true
	$(BIN)/python -m pip install -q -e ".[dev,docs,mooncake,redis]" -e ./bench
	touch $@

# spin (model checker), libibverbs (Mooncake's transfer engine), fio (the bench's physical
# reference), redis-server (with redis-cli: the Redis tier's tests start real servers) and
# sshfs with openssh-server (a real network filesystem on loopback: tests/support/sshfs.py) from
# Debian packages
system-deps:
	@if ! command -v spin >/dev/null || ! ldconfig -p | grep -q libibverbs.so.1 \
			|| ! command -v fio >/dev/null || ! command -v redis-server >/dev/null \
			|| ! command -v redis-cli >/dev/null || ! command -v sshfs >/dev/null \
			|| ! test -x /usr/sbin/sshd; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q spin libibverbs1 gcc fio \
			redis-server sshfs openssh-server; \
	fi

# fio for the bench where apt-get works; without it the bench says so and uses its raw reader
bench-deps:
	@command -v fio >/dev/null || ($(SUDO) apt-get install -y -q fio \
		|| ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q fio)) \
		|| echo "fio not installed: bsr bench reports no bsr_bandwidth_vs_fio"

# The main suite on PYTEST_WORKERS pytest-xdist workers (1: one process, no xdist); a module is one
# unit of work, so a worker owns the servers and models its module's fixtures start
# (tests/conftest.py). Three on two cores: its tests wait much of the time (processes killed and
# restarted, deadlines, servers starting), and a third worker fills the cores (alone: 8:12 on
# three, 7:43 on four, where two left a third of the cores idle)
PYTEST_WORKERS ?= 3
XDIST = $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS),)
# the vLLM tests on three: their engines wait much of the time (process start-up, a held lock's
# timeout, a script's pauses), so a third worker fills the two cores (5:56 against 6:50 on two)
VLLM_WORKERS ?= 3
VLLM_XDIST = $(if $(filter-out 0 1,$(VLLM_WORKERS)),-n $(VLLM_WORKERS),)

# every phase, timed; the table of phases, times and test counts prints at the end. A "+" phase
# runs side by side with the one before it (tools/test_phases.py): vLLM's environment is built
# (downloads and unpacking, mostly) beside the main suite, which leaves out the few tests that
# need it (marked vllm_env: the bench's vLLM sections, minutes each); those run once it is built,
# still beside the main suite, whose tests leave the cores idle part of the time (beside the vLLM
# tests, with the GPU dry run and the wheel check, that phase took 8:52, against 4:43 alone).
# The GPU dry run runs alone: its steps have fixed time budgets (300 s in all) and beside the
# vLLM tests it ran out (its cuda tests 120 s instead of 14). The two suites run one after the
# other: side by side on two cores they took longer than in turn (20:31, against 12:48 and then
# 9:19).
test:
	@$(PY) tools/test_phases.py \
		"setup=$(MAKE) --no-print-directory setup system-deps" \
		"lint-imports=$(MAKE) --no-print-directory lint-imports" \
		"main suite=$(MAKE) --no-print-directory test-main MAIN_TESTS='-m \"not vllm_env\"'" \
		"+vLLM setup, bench vLLM tests=$(MAKE) --no-print-directory $(VLLM_VENV)/.bsr-installed \
			&& $(MAKE) --no-print-directory test-bench-vllm" \
		"+SGLang setup=$(MAKE) --no-print-directory $(SGLANG_VENV)/.bsr-installed" \
		"vLLM tests=$(MAKE) --no-print-directory test-vllm" \
		"+SGLang tests=$(MAKE) --no-print-directory test-sglang" \
		"gpu dry run=$(MAKE) --no-print-directory gpu-dry-run" \
		"+wheel check=$(MAKE) --no-print-directory wheel-check"

# bytecode for bsr, the bench and the tests, written once: every process the suites start reads
# it instead of compiling the modules again (where PYTHONDONTWRITEBYTECODE is set, as on this
# project's machines, nothing else would write it; Python checks each file's time stamp)
BYTECODE = -m compileall -q -j 0 src bench tests tools >/dev/null

# MAIN_TESTS: pytest arguments that narrow the main suite (make test leaves out the vllm_env
# tests here and runs them in test-bench-vllm, once .venv-vllm is built)
MAIN_TESTS ?=
test-main: setup
	$(BIN)/python $(BYTECODE)
	$(BIN)/python -m pytest -q $(XDIST) $(MAIN_TESTS)

# the main suite's tests that need .venv-vllm (marked vllm_env), in the main suite's Python
test-bench-vllm: setup $(VLLM_VENV)/.bsr-installed
	$(BIN)/python $(BYTECODE)
	$(BIN)/python -m pytest -q $(XDIST) -m "vllm_env and not bench_run" --ignore=tests/vllm_connector

# the bench sections whose test runs the whole section (many engine starts: the fleet's twelve),
# left out of make test: the bench is where many engine starts belong
test-bench-runs: setup $(VLLM_VENV)/.bsr-installed
	$(BIN)/python $(BYTECODE)
	$(BIN)/python -m pytest -q -m bench_run --ignore=tests/vllm_connector

# the edit-run loop: the library suite without vLLM, the slowest model checks and bench runs
# (marked slow; make test runs them), the GPU dry run and the wheel check
test-quick: setup
	$(BIN)/python $(BYTECODE)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" --ignore=tests/vllm_connector

# build the sdist and the wheel, install the wheel into a fresh venv and use it there
wheel-check: setup
	bash tools/wheel_check.sh $(BIN)/python "$(TORCH_CPU)"

# vLLM's CPU build in its own environment (its dependency stack is large and pins its own
# transformers); torch is pinned first so pip never pulls a CUDA build. vLLM's torchvision,
# torchaudio and torchcodec wheels do not match torch 2.13.0 and break `import transformers`.
$(VLLM_VENV)/.bsr-installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_CPU)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y bsr 2>/dev/null || true  # now bsr-kv
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_CPU)" -e ".[vllm,test,redis,mooncake]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# the vLLM connector tests on VLLM_WORKERS workers (a module is one unit, as in the main suite:
# its engines and servers belong to one worker)
test-vllm: $(VLLM_VENV)/.bsr-installed
	$(VLLM_VENV)/bin/python $(BYTECODE)
	$(VLLM_VENV)/bin/python -m pytest -q $(VLLM_XDIST) tests/vllm_connector

# SGLang's storage interface for bsr.sglang's tests (tests/sglang): sglang without its
# dependencies (they pull CUDA builds of torch and its kernels), then only what
# sglang.srt.mem_cache.hicache_storage and its storage backend factory import, with the CPU torch
# pinned in the same resolve so pip never replaces it; SGLang's engine itself does not run here
SGLANG_IMPORTS = orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm \
	aiohttp ipython triton
$(SGLANG_VENV)/.bsr-installed: pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "$(TORCH_CPU)"
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps "$(SGLANG)"
	$(SGLANG_VENV)/bin/python -m pip install -q "$(TORCH_CPU)" -e ".[test]" $(SGLANG_IMPORTS)
	touch $@

# bsr.sglang's tests in that environment (about 10 s)
test-sglang: $(SGLANG_VENV)/.bsr-installed
	$(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/sglang

# LMCache 0.5.6 for `bsr bench --l1-ladder --lmcache` (its own environment; the CPU torch first
# so pip never pulls a CUDA build). Optional: without it the ladder says so and skips LMCache.
lmcache-venv: $(LMCACHE_VENV)/.bsr-installed

$(LMCACHE_VENV)/.bsr-installed:
	test -x $(LMCACHE_VENV)/bin/python || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q "$(TORCH_CPU)"
	$(LMCACHE_VENV)/bin/python -m pip install -q lmcache==0.5.6 "$(TORCH_CPU)"
	touch $@

# The GPU validation run (bench/gpu, docs/gpu.md). gpu-wheels fills .whl/ with the pinned wheels a
# GPU machine without network needs, for its Python (GPU_PY) and for this one, and checks them
# offline; gpu-dry-run runs the whole script here on the CPU at tiny sizes (about a minute).
GPU_PY ?= 3.12
gpu-wheels: setup
	$(BIN)/python bench/gpu/wheels.py ensure --python-version $(GPU_PY) --python-version host

gpu-dry-run: gpu-wheels
	$(BIN)/python bench/gpu/run.py --dry-run

# the documentation site (mkdocs.yml; docs/index.md says how it is built) into site/, git-ignored:
# strict, so a warning (a broken link, a docstring that does not parse) fails it. It reads the
# source statically, so vLLM need not be installed. make test builds it in its main suite
# (tests/docs/test_reference.py: the same strict build, and every public name has its entry).
docs: setup
	$(BIN)/mkdocs build --strict -q

# the layering contracts in pyproject.toml ([tool.importlinter])
lint-imports: setup
	$(BIN)/lint-imports

bench: setup bench-deps
	$(BIN)/bsr bench

lint:
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools

typecheck:
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(LMCACHE_VENV) site .pytest_cache .mypy_cache \
		.ruff_cache .hypothesis
