#!/usr/bin/env bash
# What the GPU machine lacks, packed into wheels/ (git-ignored) to travel with the device tool's `carry`:
#
#   bash benchmarks/gpu_bundle.sh          # here, with network to the package registry
#   AOT=1 bash benchmarks/gpu_bundle.sh    # also FlashInfer's kernels, built here without a GPU (~8 min, 2 cores)
#
# - FlashInfer 0.7.0.post1 (the version vLLM 0.32 pins) as a pruned tar.xz (~8 MB instead of a 34 MB wheel): the
#   package with the JIT sources its prefill/cascade kernels need; the sources of kernels the backend never
#   builds (KDA, GDN, Blackwell MSA, MoE, ...) and CUTLASS/CCCL's examples, tests and Python are left out;
# - apache-tvm-ffi (FlashInfer's FFI) and msgspec as CPython 3.12 manylinux wheels (the GPU image's Python).
# The image has torch, nvcc, ninja, einops, nvidia-ml-py, click and tabulate (FlashInfer's other imports).
# With AOT=1 the kernels the backend uses (benchmarks/flashinfer_warmup.py: FA2 prefill for bfloat16/float16 x head
# sizes 64/128, cascade, quantization) are compiled for sm_90a (H100/H200) with nvcc 13.0 from pip (CUDA 13.0: the
# GPU image's PyTorch is cu130) and put in the tarball's flashinfer/data/aot/, where FlashInfer loads them without
# compiling; the GPU then spends no time on nvcc. Needs python3 with torch here (the project's .venv).
#
# The device tool carries at most 64 MiB a call and the tracked tree is ~89 MB with the four embedded checkpoints:
# most steps of gpu_suite.sh need llada-tiny only, so move the others out of the work tree for the call (deleted
# tracked files do not travel) and restore them with `git checkout` after (docs/gpu.md says which step needs what).
set -euo pipefail
cd "$(dirname "$0")/.."
W=wheels
mkdir -p "$W"
rm -f "$W"/*.whl "$W"/*.tar.xz
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W" "apache-tvm-ffi>=0.1.11,<0.2" msgspec
python3 -m pip download -q --no-deps -d "$TMP" flashinfer-python==0.7.0.post1
mkdir "$TMP/site"
(cd "$TMP/site" && python3 -m zipfile -e "$TMP"/flashinfer_python-*.whl .)
D="$TMP/site/flashinfer/data"
rm -rf "$D"/csrc/{kda,gdn,blackwell_msa,cake_*,dcp,nv_internal,fmha_v2,xqa,fused_moe} \
       "$D"/cutlass/{examples,python,test,tools} "$D"/cccl/{benchmarks,ci,docs,python}
if [ "${AOT:-0}" = 1 ]; then
    TC="$TMP/cuda"  # nvcc, NVVM, CRT and the runtime's headers from pip, laid out as a CUDA_HOME
    python3 -m pip download -q --no-deps -d "$TMP/cudawhl" nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.88
    for w in "$TMP"/cudawhl/*.whl; do python3 -m zipfile -e "$w" "$TC"; done
    H="$TC/nvidia/cu13"
    chmod +x "$H"/bin/* "$H"/nvvm/bin/* 2>/dev/null || true
    ln -sfn lib "$H/lib64"
    ln -sf libcudart.so.13 "$H/lib/libcudart.so"
    mkdir -p "$H/lib/stubs"  # FlashInfer links -lcuda: an empty stub (the driver provides libcuda.so.1 there)
    echo "" > "$TMP/empty.c" && cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$H/lib/stubs/libcuda.so" "$TMP/empty.c"
    VENV_PY=${VENV_PY:-.venv/bin/python}  # FlashInfer's imports for this machine's Python, beside it only
    "$VENV_PY" -m pip install -q --no-deps --target "$TMP/deps" "apache-tvm-ffi>=0.1.11,<0.2" nvidia-ml-py einops \
        tabulate click
    CUDA_HOME="$H" PATH="$H/bin:$PATH" FLASHINFER_WORKSPACE_BASE="$TMP/ws" PYTHONPATH="$TMP/site:$TMP/deps" MAX_JOBS=${MAX_JOBS:-2} \
        "$VENV_PY" benchmarks/flashinfer_warmup.py --aot "$D/aot" --arch 9.0a --dtypes bfloat16,float16 --head-dims 64,128
fi
find "$TMP/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$TMP/site" -cJf "$W/flashinfer-0.7.0.post1-pruned.tar.xz" flashinfer flashinfer_python-0.7.0.post1.dist-info
ls -la "$W"
echo "tracked tree with llada-tiny alone + wheels/: $(( ($(git ls-files -z | grep -zv -e checkpoints/ar-tiny \
    -e checkpoints/drafter-tiny -e checkpoints/dream-tiny | du -cb --files0-from=- | tail -1 | cut -f1) \
    + $(du -cb "$W" | tail -1 | cut -f1)) / 1048576 )) MiB (limit 64)"
