#!/usr/bin/env bash
# One-shot GPU check (target: under 5 minutes on one GPU): build the extension for the local GPU's
# architecture only, run the CUDA tests (the bad-input table on CUDA tensors included), the same tests
# under compute-sanitizer memcheck and racecheck, the kernel table (bench/gpu_kernels.py: each routed op's fused
# kernel, the torch reference and `auto` at Llama-3.1-8B shapes, N = 2K..32K, bf16 and fp16, as JSON under $OUT or
# the log folder) and the GPU benchmarks; print a summary.
#
#   bash bench/gpu_check.sh          (or: make gpu-check)
#
# PHASES (default tests,bench,sanitizer) picks what runs after the build. PY picks the interpreter (default: .venv/bin/python, else python3: a machine whose image already holds a CUDA
# torch needs no .venv); LOG_DIR keeps the logs (default: a new temporary folder). Each phase has a time limit
# (TEST_S, SANITIZER_S per tool, BENCH_S seconds) so that the whole check fits a short lease; a phase cut off
# says so in the summary. With pytest-xdist installed the tests run in parallel processes (XDIST, default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# The checkout itself, not an install: ripplekv_ext from the root, the reference (ripplekv_ref) from python/.
export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# GPU images lag the torch releases the package supports (the H200 image has torch 2.11): check on what is there; the
# summary names the torch it ran on.
export RIPPLEKV_ALLOW_UNSUPPORTED=${RIPPLEKV_ALLOW_UNSUPPORTED:-1}
# The system compiler where there is one (BUILD_CC / BUILD_CXX choose another): the H200 image's CC/CXX
# (/opt/gcc/bin, a wrapper around the same GCC 13.3) gave a module whose every error path segfaulted in libstdc++'s
# number formatting inside the module itself (a copy of its own, not the libstdc++ torch uses); /usr/bin/g++'s
# build raises the same errors as it should.
if [ -x /usr/bin/g++ ]; then
  export CC=${BUILD_CC:-/usr/bin/gcc} CXX=${BUILD_CXX:-/usr/bin/g++}
fi
LOG=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG"
PHASES=${PHASES:-tests,kernels,bench,sanitizer}  # which of the four phases to run, after the build
TEST_S=${TEST_S:-240}
SANITIZER_S=${SANITIZER_S:-150}
BENCH_S=${BENCH_S:-150}
KERNELS_S=${KERNELS_S:-150}
start=$(date +%s)

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed); nothing to check" >&2
  exit 1
fi
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' ')
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
echo "gpu_check: $gpu, compute capability $arch"

echo "gpu_check: building for sm_${arch/./} only ..."
if ! TORCH_CUDA_ARCH_LIST="$arch" FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PY" setup.py build_ext --inplace --force >"$LOG/build.log" 2>&1; then
  tail -n 40 "$LOG/build.log"; echo "gpu_check: BUILD FAILED (log: $LOG/build.log)"; exit 1
fi
build_s=$(( $(date +%s) - start ))
"$PY" -c "import ripplekv_ext, torch; assert ripplekv_ext.cuda_built() and torch.cuda.is_available(); print(ripplekv_ext.build_report())" || exit 1
# An error path must raise, not crash (see the compiler choice above), on both devices.
if ! "$PY" - >"$LOG/error-path.log" 2>&1 <<'PYEOF'
import torch, ripplekv_ext
for device in ("cpu", "cuda"):
    try:
        torch.ops.ripplekv.select_topk(torch.rand(1, 1, 10, device=device), 5, -1)
    except RuntimeError as error:
        assert "window must be >= 0, got -1" in str(error), error
    else:
        raise AssertionError("select_topk accepted window=-1")
PYEOF
then
  tail -n 5 "$LOG/error-path.log"
  echo "gpu_check: an error path crashed or did not raise (compiler: ${CXX:-c++}); the module's errors would crash a user's process"
  exit 1
fi

# CUDA halves of the op tests only (the parametrized device id is "cuda"), plus the CUDA-only tests; then the
# hook end to end on a model that lives on the GPU (tests/test_cuda_e2e.py, against the same model on the CPU).
OP_TESTS="tests/test_gather_kv.py tests/test_gather_kv_packed.py tests/test_snapkv_scores.py tests/test_snapkv_compress.py
  tests/test_select_topk.py tests/test_select_topk_packed.py tests/test_select_topk_rows.py
  tests/test_snapkv_compress_rows.py tests/test_h2o_scores.py tests/test_streaming_indices.py"
E2E_TESTS="tests/test_cuda_e2e.py"
PARALLEL=""
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL="-n ${XDIST:-8}"; fi
tests_rc=0; tests_summary="not run (PHASES=$PHASES)"
if [[ ",$PHASES," == *,tests,* ]]; then
  # The end-to-end tests first and in one process: their result must not depend on the op tests' workers.
  timeout "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider $E2E_TESTS >"$LOG/tests-e2e.log" 2>&1
  e2e_rc=$?
  timeout "$TEST_S" "$PY" -m pytest -q -p no:cacheprovider $PARALLEL $OP_TESTS -k "cuda" >"$LOG/tests.log" 2>&1
  tests_rc=$?
  [ $tests_rc -eq 124 ] && echo "(tests cut off after ${TEST_S}s)" >>"$LOG/tests.log"
  [ $e2e_rc -eq 124 ] && echo "(tests cut off after ${TEST_S}s)" >>"$LOG/tests-e2e.log"
  tests_summary="ops: $(tail -n 1 "$LOG/tests.log"); end to end: $(tail -n 1 "$LOG/tests-e2e.log")"
  [ $e2e_rc -ne 0 ] && tests_rc=1
fi

kernels_rc=0; kernels_summary="not run (PHASES=$PHASES)"
if [[ ",$PHASES," == *,kernels,* ]]; then
  device_name=$(echo "$gpu" | tr 'A-Z' 'a-z' | grep -oE '[a-z][0-9]+' | head -n1)
  kernels_json="${OUT:-$LOG}/gpu_kernels_${device_name:-gpu}.json"
  timeout "$KERNELS_S" "$PY" bench/gpu_kernels.py --out "$kernels_json" >"$LOG/kernels.log" 2>&1
  kernels_rc=$?
  [ $kernels_rc -eq 124 ] && echo "(cut off after ${KERNELS_S}s)" >>"$LOG/kernels.log"
  kernels_summary="rc=$kernels_rc, $kernels_json"
fi

bench_rc=0
if [[ ",$PHASES," == *,bench,* ]]; then
  timeout "$BENCH_S" "$PY" -m pytest -q -p no:cacheprovider bench/bench_gather_kv.py bench/bench_snapkv.py bench/bench_select.py \
    bench/bench_h2o.py -k "cuda" --benchmark-columns=min,median,rounds --benchmark-group-by=param:shape \
    --benchmark-json="$LOG/bench.json" >"$LOG/bench.log" 2>&1
  bench_rc=$?
  # The per-row ops against a Python loop of the one-prompt op and the reference (grouped by op: no shape parameter).
  timeout "$BENCH_S" "$PY" -m pytest -q -p no:cacheprovider bench/bench_rows.py -k "cuda" \
    --benchmark-columns=min,median,rounds --benchmark-group-by=param:op >"$LOG/bench-rows.log" 2>&1
  [ $? -ne 0 ] && bench_rc=1
fi

# The same CUDA tests under compute-sanitizer: out-of-bounds and misaligned accesses (memcheck) and shared-memory
# races (racecheck). Property tests (hypothesis) and torch.compile are left out to keep this within minutes; a
# finding makes the tool exit non-zero (--error-exitcode).
# The bad-input tables are left out: their rejected calls launch nothing.
SANITIZER_TESTS="$OP_TESTS"
sanitizer_summary="compute-sanitizer not found"
sanitizer_rc=0
if [[ ",$PHASES," != *,sanitizer,* ]]; then
  sanitizer_summary=" not run (PHASES=$PHASES)"
elif command -v compute-sanitizer >/dev/null; then
  sanitizer_summary=""
  for tool in memcheck racecheck; do
    timeout "$SANITIZER_S" compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all --print-limit 20 \
      "$PY" -m pytest -q -p no:cacheprovider $SANITIZER_TESTS -k "cuda and not property and not compile and not opcheck and not bad_input_table" \
      >"$LOG/sanitizer-$tool.log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && echo "(cut off after ${SANITIZER_S}s)" >>"$LOG/sanitizer-$tool.log"
    [ $rc -ne 0 ] && sanitizer_rc=1
    sanitizer_summary="$sanitizer_summary $tool: rc=$rc ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cut off" "$LOG/sanitizer-$tool.log" | tail -n 1));"
  done
fi


echo
echo "================ gpu_check summary ================"
echo "GPU: $gpu (sm_${arch/./}); torch $("$PY" -c 'import torch; print(torch.__version__)'); compiler ${CXX:-c++}; build ${build_s}s; logs in $LOG"
echo "CUDA tests: $tests_summary"
[ $tests_rc -ne 0 ] && cat "$LOG"/tests*.log | grep -E "^(FAILED|ERROR)" | head -n 20
echo "compute-sanitizer:$sanitizer_summary"
echo "kernel table: $kernels_summary"
[ -f "$LOG/kernels.log" ] && cat "$LOG/kernels.log"
"$PY" - "$LOG/bench.json" <<'PYEOF'
import collections, json, sys
try:
    data = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("benchmarks: no results (see bench.log)"); sys.exit(0)
groups = collections.defaultdict(dict)
for b in data["benchmarks"]:
    name = b["name"].split("[")[0]
    params = b.get("params") or {}
    groups[(name, params.get("shape"))][params.get("impl")] = b
for (name, shape), impls in sorted(groups.items(), key=lambda x: (x[0][0], str(x[0][1]))):
    ref, ext = impls.get("reference"), impls.get("extension")
    if ref and ext:
        r, e = ref["stats"]["median"], ext["stats"]["median"]
        line = f"{name:32s} {shape:28s} reference {r*1e3:9.3f} ms  extension {e*1e3:9.3f} ms  speedup {r/e:6.1f}x"
        nbytes = ext.get("extra_info", {}).get("bytes")
        if nbytes:
            line += f"  {nbytes / e / 1e9:7.1f} GB/s"
        print(line)
    for b in impls.values():
        info = b.get("extra_info", {})
        if "ratio" in info:
            print(f"{name:32s} {shape:28s} peak extra memory: reference {info['reference_extra_MiB']:.1f} MiB, "
                  f"extension {info['extension_extra_MiB']:.1f} MiB (ratio {info['ratio']:.3f})")
PYEOF
[ -f "$LOG/bench-rows.log" ] && grep -E "^bench_|^Name" "$LOG/bench-rows.log" | cut -c1-110
echo "total: $(( $(date +%s) - start ))s; benchmarks rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 || sanitizer_rc != 0 || kernels_rc != 0 ))
