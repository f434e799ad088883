# flashbook: two commands do all set-up on a fresh machine.
#   make book   create .venv, install everything, execute the notebooks, build the HTML book
#   make test   create or reuse .venv and run the whole suite (library tests, notebooks, the book)
# and, on a machine with a CUDA GPU (CI has none):
#   make test-gpu            the GPU tier: kernels on CUDA tensors, the whole suite, `flashlib check`
#   make test-gpu PY=python3 the same with a Python that already has torch, triton and pytest (no venv)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flashbook-installed

.PHONY: book test test-lib test-notebooks test-browser test-gpu bench-gpu set-repo clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is built: open $(CURDIR)/_build/html/index.html"

test-lib: $(STAMP)
	$(PY) -m pytest -n 2 -m "not book" tests

test-notebooks: $(STAMP)
	$(PY) -m pytest --nbval-lax -p no:randomly notebooks

test-browser: $(STAMP)
	$(PY) -m pytest -m book tests/test_book_browser.py

# The browser test reads the book that `book` has just built.
test: test-lib test-notebooks book
	$(MAKE) test-browser

# The GPU tier. tests/gpu exits non-zero on a machine without a CUDA GPU (it never passes having run
# nothing); then the whole library suite runs again, on the GPU this time; then the reader's first
# command. With PY given (make test-gpu PY=python3) no venv is created or needed.
# tests/gpu runs under FLASHLIB_REQUIRE_ALL=$(REQUIRE_ALL): a test whose package (cupy, transformers,
# nbclient) is missing FAILS; REQUIRE_ALL=0 (a GPU machine that cannot install them) lets those skip,
# each named at the end. What the GPU cannot run (bfloat16 below sm_80, ...) is never a skip: the tier
# chooses its cases by capability and tests the refusals. Multi-GPU: tests/gpu/test_multi_gpu.py is
# collected only where torch sees two GPUs or more; GPUS=N states how many the machine has, and fewer
# visible fails the tier (make test-gpu GPUS=2 on a two-GPU machine).
# Runs the tests in parallel where pytest-xdist is installed (compiling kernels is most of the time);
# -rfEs names every failure, error and skip at the end, --durations the slowest tests.
REQUIRE_ALL ?= 1
GPUS ?= 1
GPU_PYTEST = $(PY) -m pytest -rfEs --durations=10 $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n 4")
test-gpu:
	@if [ "$(PY)" = "$(VENV)/bin/python" ]; then $(MAKE) $(STAMP); fi
	FLASHLIB_REQUIRE_ALL=$(REQUIRE_ALL) FLASHLIB_GPU_COUNT=$(GPUS) $(GPU_PYTEST) tests/gpu
	$(GPU_PYTEST) -m "not book" tests
	$(PY) -m flashlib check

# The speed sweep on a GPU: float16 and bfloat16, d = 64 and 128, causal and not, each run saved under
# benchmarks/ (one file per run, named by the bench; commit them, then re-execute chapter 7). Each run
# times flashlib's rows, every SDPA backend and the small call in one process. BENCH_NS picks the lengths.
# Then decode alone at a Llama-like shape (one sequence, 32 query heads on 8 kv heads, d = 128) out to
# DECODE_NS cached tokens; then a tiny Llama's time per generated token through flashlib.auto (--generate).
# A run this GPU cannot make (bfloat16 below sm_80; --generate without transformers) exits with
# BENCH_SKIPPED (flashlib.tools.bench.EXIT_NOT_SUPPORTED) having run nothing: it is reported as skipped
# and the sweep goes on; any other failure stops it. Speed goals (flashlib.tools.bench.GOALS) are
# printed by each run as met or MISSED, and every MISSED one again at the end; they never fail the sweep.
BENCH_NS ?= 1024 2048 4096 8192 16384
DECODE_NS ?= 4096 16384 65536 131072
BENCH_SKIPPED := 4
BENCH_LOG ?= $(or $(TMPDIR),/tmp)/flashlib-bench-gpu.log
bench-gpu:
	@if [ "$(PY)" = "$(VENV)/bin/python" ]; then $(MAKE) $(STAMP); fi
	@: > $(BENCH_LOG); \
	bench() { { $(PY) -m flashlib bench "$$@"; echo $$? > $(BENCH_LOG).rc; } 2>&1 | tee -a $(BENCH_LOG); \
	  rc=$$(cat $(BENCH_LOG).rc); \
	  if [ "$$rc" = "$(BENCH_SKIPPED)" ]; then echo "bench-gpu: skipped, not supported here: bench $$*"; \
	  elif [ "$$rc" != 0 ]; then echo "bench-gpu: stopped, exit $$rc: bench $$*"; exit "$$rc"; fi; }; \
	for dtype in float16 bfloat16; do for d in 64 128; do for causal in "" --causal; do \
	  bench --dtype $$dtype --head-dim $$d $$causal --n $(BENCH_NS) --save benchmarks/ --out ""; \
	done; done; done; \
	for dtype in float16 bfloat16; do \
	  bench --only decode --dtype $$dtype --batch 1 --heads 32 --kv-heads 8 --head-dim 128 \
	    --n $(DECODE_NS) --no-small --save benchmarks/ --out ""; done; \
	bench --generate; \
	if grep -q "goal MISSED" $(BENCH_LOG); then echo "bench-gpu: speed goals MISSED on this GPU:"; \
	  grep "goal MISSED" $(BENCH_LOG); else echo "bench-gpu: no speed goal measured here was missed"; fi

# Publishing: make URL the book's repository (README: Publishing). Rewrites _config.yml (the address, and
# the Colab and repository buttons: on for a real address, off for the placeholder), every chapter's setup
# cell, the README and the landing page's "not published yet" note (removed for a real address). A second
# run changes nothing. Needs only Python and numpy (the venv's Python where there is one).
set-repo:
	@test -n "$(URL)" || { echo "usage: make set-repo URL=https://github.com/OWNER/REPO" >&2; exit 2; }
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m flashlib set-repo "$(URL)"

clean:
	rm -rf _build
