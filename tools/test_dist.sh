#!/usr/bin/env bash
# `make test-dist`: each wheel in dist/ (`make dist`) installed into a fresh environment beside the torch release it
# names (requirements/torch-releases.txt), with no compiler on the PATH, and the library tests (ops, hook, policies,
# selectors, compressor, context, rolling prefill, the CLI's options) run against the installed package from a
# folder outside the checkout. Which Python each kind is tested on:
#   the CPU wheel of .venv's torch (2.15)  every Python in DIST_PYTHONS that torch has (3.11-3.13: no 3.10 build)
#   the CPU wheels of older releases      the oldest and the newest of DIST_PYTHONS they have: 3.10 (the newest
#                                         torch with cp310 wheels is 2.14, so a 3.10 user gets that wheel) and 3.13
#   every CUDA wheel                      3.11 (its kernels load here; with no GPU its CUDA tests report themselves
#                                         skipped)
# The test environment's packages: requirements/dist-test.txt, or dist-test-py310.txt on Python 3.10 (the same
# packages at the newest releases that still install there), with torch overridden by the wheel's release.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
UV="$ROOT/.venv/bin/uv"
PYTHONS=${DIST_PYTHONS:-3.10 3.11 3.12 3.13}
KINDS=${DIST_KINDS:-cpu-torch2.15 cuda-torch2.15 cpu-torch2.14 cuda-torch2.14 cpu-torch2.13 cuda-torch2.13}
VENV_RELEASE=$("$ROOT/.venv/bin/python" -c "import torch; print('.'.join(torch.__version__.split('.')[:2]))")
WORK=${DIST_TEST_DIR:-$(mktemp -d /tmp/ripplekv-test-dist.XXXXXX)}
TESTS=(test_ops.py test_allocators.py test_library.py test_gather_kv.py test_gather_kv_packed.py test_select_topk.py
       test_select_topk_packed.py test_select_topk_rows.py test_snapkv_scores.py test_snapkv_compress.py
       test_snapkv_compress_rows.py test_h2o_scores.py test_streaming_indices.py test_hook.py test_hook_batches.py
       test_hook_decode.py test_hook_threads.py test_masks.py test_policies.py test_selectors.py test_compressor.py
       test_context.py test_context_checks.py test_bounded_prefill.py test_cli_options.py test_cake.py test_adakv.py
       test_hook_cake.py test_hook_headwise.py test_composite.py)
# The benchmark harness (bench/e2e_bench.py) is the checkout's, not the wheel's: its rows of the CLI table stay out.
DESELECT="not e2e_bench"
# PYTEST_WORKERS (default "-n 2": two pytest-xdist workers) sets how the tests run; DIST_QUICK=1 (.ci/run) also leaves out the four slowest tests (minutes of generation on SmolLM2 and memory soaks,
# which depend on torch and transformers, not on the Python version; `make test` runs them) and runs a shorter list.
# A quick run keeps what the Python version can change: every op of the compiled module, the budgets, saved contexts
# (pickles) and the hook end to end; the other hook, CLI and selector tests exercise torch and transformers, which
# `make test` runs on the same code.
if [ "${DIST_QUICK:-0}" = 1 ]; then
    DESELECT="$DESELECT and not memory_is_flat and not batch_of_four and not fresh_process and not store_budget_groups"
    TESTS=(test_ops.py test_allocators.py test_library.py test_gather_kv.py test_gather_kv_packed.py test_select_topk.py
           test_select_topk_packed.py test_select_topk_rows.py test_snapkv_scores.py test_snapkv_compress.py
           test_snapkv_compress_rows.py test_h2o_scores.py test_streaming_indices.py test_policies.py test_context.py
           test_hook.py)
fi

find_python() {  # pyenv's build of that version, else one on the PATH
    local found
    found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -1)
    [ -n "$found" ] || found=$(command -v "python$1") || { echo "no Python $1 here (pyenv install $1)" >&2; return 1; }
    echo "$found"
}

# A PATH with no compiler on it: the environment's bin/ and a folder of the few tools a test may start (readelf
# reads which libraries the module links).
NO_CC="$WORK/no-compiler-bin"
mkdir -p "$NO_CC"
for tool in sh bash env uname cat ls rm mkdir readelf; do ln -sf "$(command -v $tool)" "$NO_CC/$tool"; done

wheel_pattern() {  # kind -> the glob of its wheel in dist/
    local kernels=${1%-torch*} release=${1#*-torch}
    echo "$ROOT/dist/ripplekv_ext-*+$([ "$kernels" = cpu ] && echo cpu || echo cu)*.torch$release-*.whl"
}

run_one() {  # kind python-version
    local kind=$1 version=$2 wheel env tests requirements
    local kernels=${kind%-torch*} release=${kind#*-torch}
    # shellcheck disable=SC2086  # the pattern is a glob
    wheel=$(ls $(wheel_pattern "$kind"))
    env="$WORK/$kind-py$version"
    tests="$WORK/$kind-py$version-tests"
    requirements="$ROOT/requirements/dist-test.txt"
    [ "$version" = 3.10 ] && requirements="$ROOT/requirements/dist-test-py310.txt"
    grep -E "^torch==$release\.[0-9]+$" "$ROOT/requirements/torch-releases.txt" > "$WORK/override-$kind.txt"
    echo "== $kind wheel on Python $version: $(basename "$wheel")"
    rm -rf "$env" "$tests"
    "$UV" venv -q --python "$(find_python "$version")" "$env"
    "$UV" pip install -q --python "$env/bin/python" -r "$requirements" --override "$WORK/override-$kind.txt"
    "$UV" pip install -q --python "$env/bin/python" --no-deps -r "$ROOT/requirements/no-deps.txt"
    # the CLI's dependencies come with [eval]
    "$UV" pip install -q --python "$env/bin/python" "$wheel[eval]" --override "$WORK/override-$kind.txt"
    mkdir -p "$tests"
    cp -r "$ROOT"/tests/. "$tests/"  # the selected tests import the shared helpers and each other's samples
    find "$tests" -name __pycache__ -prune -exec rm -rf {} +
    local paths=() name
    for name in "${TESTS[@]}"; do
        paths+=("$(cd "$tests" && find . -name "$name" | head -1)")
        [ -n "${paths[-1]}" ] || { echo "no test file $name under tests/ (renamed? update TESTS)" >&2; return 1; }
    done
    local bare_path="$env/bin:$NO_CC" status=0
    for cc in cc c++ gcc g++ clang nvcc; do
        if PATH=$bare_path command -v "$cc" >/dev/null; then echo "a compiler is on the PATH: $cc" >&2; return 1; fi
    done
    (cd "$tests" && PATH=$bare_path python -c "import ripplekv_ext, torch, sys; f = ripplekv_ext.__file__; \
assert f.startswith(sys.prefix), f; \
assert ripplekv_ext.cuda_built() == ('$kernels' == 'cuda'), ripplekv_ext.build_report(); \
assert torch.__version__.startswith('$release.'), torch.__version__; \
print('testing', f, 'Python', sys.version.split()[0], 'torch', torch.__version__)")
    (cd "$tests" && PATH=$bare_path python -m pytest ${PYTEST_WORKERS--n 2} -q -p no:cacheprovider -ra --durations=25 -k "$DESELECT" "${paths[@]}") \
        > "$WORK/$kind-py$version.log" 2>&1 || status=$?
    grep -v "^SKIPPED" "$WORK/$kind-py$version.log" | tail -5
    echo "$kind py$version: $(grep -E '[0-9]+ (passed|failed|error)' "$WORK/$kind-py$version.log" | tail -1)" \
        >> "$WORK/summary.txt"
    return "$status"
}

pythons_for() {  # kind -> the Pythons of DIST_PYTHONS it is tested on (the table at the top)
    local kernels=${1%-torch*} release=${1#*-torch} version have=()
    for version in $PYTHONS; do
        # torch 2.15 publishes no 3.10 wheels
        if [ "$release" = 2.15 ] && [ "$version" = 3.10 ]; then continue; fi
        have+=("$version")
    done
    [ ${#have[@]} -gt 0 ] || return 0
    if [ "$kernels" = cuda ]; then
        for version in "${have[@]}"; do [ "$version" = 3.11 ] && echo 3.11; done
    elif [ "$release" = "$VENV_RELEASE" ] || [ ${#have[@]} -eq 1 ]; then
        echo "${have[@]}"
    else
        echo "${have[0]}" "${have[-1]}"
    fi
}

rm -f "$WORK/summary.txt"
status=0
for kind in $KINDS; do
    # shellcheck disable=SC2046  # the pattern is a glob
    ls $(wheel_pattern "$kind") >/dev/null 2>&1 || DIST_KINDS=$kind "$ROOT/tools/make_dist.sh"  # no wheel yet: make it
    for version in $(pythons_for "$kind"); do
        run_one "$kind" "$version" || status=$?
    done
done
echo "== test-dist summary ($WORK)"
cat "$WORK/summary.txt"
exit "$status"
