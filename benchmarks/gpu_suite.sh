#!/usr/bin/env bash
# Issue 26's GPU steps in one call, results under OUT (default $OUT, else benchmarks/results/gpu):
#
#   bash benchmarks/gpu_suite.sh [OUT]                 # on the GPU machine (device tool: runs in the repo root;
#                                                      # PYTHONPATH=.site where flashinfer was installed there)
#   DEVICE=cpu bash benchmarks/gpu_suite.sh /tmp/dry   # dry run on the CPU: tiny shapes, torch backend
#
# The GPU image has PyTorch (CUDA), Triton, nvcc and transformers but no vLLM and no FlashInfer: carry the
# FlashInfer wheel vLLM 0.32 pins (`pip download --no-deps flashinfer-python==0.7.0.post1 -d wheels/`, ~62 MB)
# in wheels/ and it is installed first. Steps, in the issue's order (each logs to OUT/<step>.log and goes on
# if the one before failed):
#   1. FlashInfer parity: the `gpu`-marked tests (FlashInfer against the dense oracle, every mask kind, page
#      sizes, GQA, strided K|V pages, kept suffix) -> OUT/1_gpu_tests.log
#   2. the reference engine on the device: every method's tokens and NFE, float32 (TF32 off) and bfloat16,
#      against the committed CPU run benchmarks/results/reference_cpu_float32.json -> OUT/reference_*.json
#   3. cost at LLaDA-8B shapes (random weights, bfloat16, FlashInfer): one forward with the state canvas plus
#      K = 0, 1, 3, 7, 15 drafts, window 32, prefixes 512 and 2048, batches 1, 8, 32; Llama-8B AR per-token
#      time at the same batches and prefixes, and predicted tokens/s per method (a cost model) -> OUT/verify_cost.*
#      Not yet in it: the dual cache's shape (window = block), where the curve bends (read it off the table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-benchmarks/results/gpu}}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ "$DEVICE" = cpu ] && PY=.venv/bin/python
{ nvidia-smi || true; $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"; } \
    > "$OUT/0_machine.log" 2>&1
if ls wheels/flashinfer_python-*.whl > /dev/null 2>&1 && [ "$DEVICE" != cpu ]; then
    $PY -m pip install --no-deps wheels/flashinfer_python-*.whl >> "$OUT/0_machine.log" 2>&1
    $PY -m pip install msgspec safetensors >> "$OUT/0_machine.log" 2>&1  # what the image may lack
fi

if [ "$DEVICE" = cpu ]; then  # dry run: the same commands at tiny sizes
    TESTS=(-m "gpu or not gpu" tests/test_attention_ref.py -x -q)
    REF=(--limit 5 --methods confidence,psd,presto)
    COST=(--shape checkpoint --device cpu --dtype float32 --backend torch --batches 1 --prefixes 64 --reps 2 --ar)
    DTYPES="float32"
else
    TESTS=(-m gpu tests/ -q -p no:cacheprovider)
    REF=(--limit 5)
    COST=(--shape llada-8b --device cuda --dtype bfloat16 --backend flashinfer --batches 1,8,32
          --prefixes 512,2048 --window 32 --reps 20 --ar)
    DTYPES="float32 bfloat16"
fi

echo "== 1. FlashInfer parity (gpu tests)"
$PY -m pytest "${TESTS[@]}" > "$OUT/1_gpu_tests.log" 2>&1; echo "rc=$?" >> "$OUT/1_gpu_tests.log"
tail -3 "$OUT/1_gpu_tests.log"

echo "== 2. reference engine on $DEVICE"
for dt in $DTYPES; do
    $PY benchmarks/reference_devices.py --device "$DEVICE" "${REF[@]}" --dtype "$dt" \
        --compare benchmarks/results/reference_cpu_float32.json --out "$OUT" > "$OUT/2_reference_$dt.log" 2>&1
    echo "rc=$?" >> "$OUT/2_reference_$dt.log"
    grep -E "identical|rc=" "$OUT/2_reference_$dt.log"
done

echo "== 3. cost at LLaDA-8B shapes"
$PY benchmarks/verify_cost.py "${COST[@]}" --out "$OUT" > "$OUT/3_verify_cost.log" 2>&1
echo "rc=$?" >> "$OUT/3_verify_cost.log"
tail -12 "$OUT/3_verify_cost.log"
