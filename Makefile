# The two set-up commands: `make demo` (run the main job) and `make test` (run the tests).
# Both create or reuse .venv, install what requirements/ pins, and build the extension in place.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.ripplekv-deps
EDITABLE_STAMP := $(VENV)/.ripplekv-editable
export MAX_JOBS ?= 2

.PHONY: build test demo bench cpp-test gpu-check peer-env clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements/base.txt requirements/dev.txt requirements/no-deps.txt | $(PY)
	$(PY) -m pip install -r requirements/dev.txt
	$(PY) -m pip install --no-deps -r requirements/no-deps.txt
	touch $@

$(EDITABLE_STAMP): $(DEPS_STAMP) pyproject.toml setup.py
	RIPPLEKV_SKIP_EXTENSION=1 $(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

# --force: setuptools only compares .cpp/.cu timestamps; ninja (with its header dependency files)
# decides what really needs recompiling.
build: $(EDITABLE_STAMP)
	$(PY) setup.py build_ext --inplace --force
	$(PY) -c "import ripplekv_ext; print(ripplekv_ext.build_report())"

# The second pytest line runs the scoring tests again on the portable CPU kernel, which machines
# without AVX2/FMA/F16C use (this one dispatches to the AVX2 kernel), and with SnapKV's second pass
# recomputing logits instead of reading the exps the first pass kept (what rows too long for the
# store budget get; the first line covers the store).
test: build cpp-test
	$(PY) -m pytest tests/
	RIPPLEKV_DISABLE_AVX2=1 RIPPLEKV_SNAPKV_STORE_MIB=0 $(PY) -m pytest -q tests/test_snapkv.py tests/test_h2o.py
	$(PY) -m pytest bench/ --benchmark-disable -q

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

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf build cmake-build ripplekv_ext/*.so
