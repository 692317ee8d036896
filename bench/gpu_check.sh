#!/usr/bin/env bash
# One-shot GPU check (target: under 5 minutes on one GPU): build the extension for the local GPU's
# architecture only, run the CUDA tests (the bad-input table on CUDA tensors included), the same tests
# under compute-sanitizer memcheck and racecheck, and the GPU benchmarks; print a summary.
#
#   bash bench/gpu_check.sh          (or: make gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOG=${LOG_DIR:-$(mktemp -d)}
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

# CUDA halves of the op tests only (the parametrized device id is "cuda"), plus the CUDA-only tests.
OP_TESTS="tests/test_gather_kv.py tests/test_gather_kv_packed.py tests/test_snapkv_scores.py tests/test_snapkv_compress.py
  tests/test_select_topk.py tests/test_select_topk_packed.py tests/test_h2o_scores.py tests/test_streaming_indices.py
  tests/test_ops_bad_inputs.py tests/test_opcheck.py"
"$PY" -m pytest -q -p no:cacheprovider $OP_TESTS -k "cuda" >"$LOG/tests.log" 2>&1
tests_rc=$?
tests_summary=$(tail -n 1 "$LOG/tests.log")

# The same CUDA tests under compute-sanitizer: out-of-bounds and misaligned accesses (memcheck) and shared-memory
# races (racecheck). Property tests (hypothesis) and torch.compile are left out to keep this within minutes; a
# finding makes the tool exit non-zero (--error-exitcode).
sanitizer_summary="compute-sanitizer not found"
sanitizer_rc=0
if command -v compute-sanitizer >/dev/null; then
  sanitizer_summary=""
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all --print-limit 20 \
      "$PY" -m pytest -q -p no:cacheprovider -x $OP_TESTS -k "cuda and not property and not compile and not opcheck" \
      >"$LOG/sanitizer-$tool.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && sanitizer_rc=1
    sanitizer_summary="$sanitizer_summary $tool: rc=$rc ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/sanitizer-$tool.log" | tail -n 1));"
  done
fi

"$PY" -m pytest -q -p no:cacheprovider bench/bench_gather_kv.py bench/bench_snapkv.py bench/bench_select.py \
  bench/bench_h2o.py -k "cuda" --benchmark-columns=min,median,rounds --benchmark-group-by=param:shape \
  --benchmark-json="$LOG/bench.json" >"$LOG/bench.log" 2>&1
bench_rc=$?

echo
echo "================ gpu_check summary ================"
echo "GPU: $gpu (sm_${arch/./}); build ${build_s}s; logs in $LOG"
echo "CUDA tests: $tests_summary"
[ $tests_rc -ne 0 ] && grep -E "^(FAILED|ERROR)" "$LOG/tests.log" | head -n 20
echo "compute-sanitizer:$sanitizer_summary"
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
echo "total: $(( $(date +%s) - start ))s; benchmarks rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 || sanitizer_rc != 0 ))
