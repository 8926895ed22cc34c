#!/usr/bin/env bash
# Issue 26's GPU steps in one call; results under OUT (default $OUT, else benchmarks/results/gpu):
#
#   bash benchmarks/gpu_bundle.sh                      # here first: FlashInfer, tvm-ffi, msgspec into wheels/
#   bash benchmarks/gpu_suite.sh [OUT]                 # on the GPU machine (device tool, repo root, carry wheels)
#   DEVICE=cpu bash benchmarks/gpu_suite.sh /tmp/dry   # dry run on the CPU: tiny shapes, FlashInfer's stand-in
#
# The device tool returns at most 8 files: every step logs into OUT/work/, and OUT/results.tar.gz is re-packed
# after each step (a run stopped at its limit still returns what finished); OUT/suite.log has the summary.
# Steps, each with its own time limit, each going on if the one before failed:
#   0. install the carried packages into /tmp/site; FlashInfer's kernels compiled (JIT) in the background for
#      bfloat16/float16 x head sizes 64/128 (benchmarks/flashinfer_warmup.py) while step 2a runs
#   2a. the reference engine on the device, every method except PRESTO (its checkpoints stay behind: size),
#      float32 with TF32 off and bfloat16 on the PyTorch backend (SDPA), against the committed CPU float32 run
#   1. the `gpu` tests: FlashInfer against the dense oracle (every mask kind, bf16/fp16, pages 1/16/32, GQA,
#      strided K|V pages, kept suffix, row maps, CUDA-graph mode), PyTorch's SDPA path, FlashInfer's packbits
#   4. one dLLM step captured in a CUDA graph and replayed (benchmarks/cuda_graph_step.py), embedded model and
#      LLaDA-8B shape, batches 1 and 8
#   3. cost at LLaDA-8B shapes (benchmarks/verify_cost.py): windows 32 (block 32 alone: dual cache) and 128
#      (block plus masks: prefix cache), K = 0, 1, 3, 7, 15 drafts, prefixes 512/2048, batches 1/8/32; Llama-8B AR
#   2b. the reference engine in bfloat16 on FlashInfer
#   2c. PRESTO on the device (needs ar-tiny and drafter-tiny: carried in a call of their own, llada-tiny left
#      behind), float32 on the PyTorch backend and bfloat16 on FlashInfer (causal prefix + token-tree masks)
#   3g. the cost of step 3 timed as CUDA-graph replays (FlashInfer in CUDA-graph mode): the GPU's time without
#      the reference model's host overhead (batch 1 eager is launch-bound)
#   5. vLLM's Python sources on this torch (benchmarks/vllm_gpu_try.py), where its bundle was carried
#   5s. the vLLM attention builder's no-sync test on CUDA (tests/test_attention_sync.py, gpu-marked; needs step 5's
#      unpacked bundle)
# STEPS picks steps (default "2a 1 4 3 2b 5 5s"), e.g. STEPS="3g 2c" for a second call; VLLM_BUDGET (default 180)
# gives step 5 its seconds, VLLM_MODEL its dLLM (a checkpoint name; default llada-tiny), VLLM_TIMING=1 adds the
# timings through vLLM (vllm_gpu_try.py --timing: stages 9-10), VLLM_STAGES its stages instead (--stages: e.g.
# "compiled_float32,methods_float32" for a second call on a warm machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-benchmarks/results/gpu}}
DEVICE=${DEVICE:-cuda}
W="$OUT/work"
mkdir -p "$W"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ "$DEVICE" = cpu ] && PY=.venv/bin/python
START=$(date +%s)
STEPS=" ${STEPS:-2a 1 4 3 2b 5 5s} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/suite.log"; }
pack() { tar -C "$OUT" -czf "$OUT/results.tar.gz.tmp" work && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"; }
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log its tail, re-pack
    local name=$1 limit=$2; shift 2
    log "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    echo "rc=$rc" >> "$W/$name.log"
    tail -4 "$W/$name.log" | sed 's/^/    /' | tee -a "$OUT/suite.log"
    log "   $name rc=$rc"
    pack
}

{ nvidia-smi || true; $PY -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  nproc; free -g; } > "$W/0_machine.log" 2>&1
if [ "$DEVICE" = cpu ]; then  # dry run: the same commands at tiny sizes, FlashInfer's CPU stand-in for step 4
    mkdir -p "$OUT/block"  # the GPU image has no vllm and no xgrammar: the dry run hides them
    printf '%s\n' 'import sys' 'class _Hide:' '    def find_spec(self, name, path=None, target=None):' \
        '        if name.split(".")[0] in ("vllm", "xgrammar"):' '            raise ModuleNotFoundError(name)' \
        'sys.meta_path.insert(0, _Hide())' > "$OUT/block/sitecustomize.py"
    export PYTHONPATH=$OUT/block${PYTHONPATH:+:$PYTHONPATH}
    TESTS=(-m "gpu or not gpu" tests/test_attention_ref.py -q -p no:cacheprovider)
    REF=(--limit 5 --methods confidence,psd,spiffy)
    GRAPH=(--dry-run)
    GRAPH8B=(--dry-run --batches 1)
    COST=(--shape checkpoint --device cpu --dtype float32 --backend torch --batches 1 --prefixes 64 --window 8,16
          --reps 2 --ar)
    COSTG=("${COST[@]}")
    FI_BACKEND=torch
else
    mkdir -p /tmp/site
    for t in wheels/*.tar.xz; do tar -xJf "$t" -C /tmp/site; done
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl >> "$W/0_machine.log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
    $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$W/0_machine.log" 2>&1
    TESTS=(-m gpu tests/ -q -p no:cacheprovider -rfE)
    REF=(--limit 5 --methods static,confidence,localleap,lopa,freedave,spiffy,psd,joint_threshold)
    GRAPH=(--device cuda --dtype bfloat16 --batches 1,8 --prefix 64 --reps 50)
    GRAPH8B=(--device cuda --dtype bfloat16 --shape llada-8b --batches 1,8 --prefix 512 --reps 20)
    COST=(--shape llada-8b --device cuda --dtype bfloat16 --backend flashinfer --batches 1,8,32 --prefixes 512,2048
          --window 32,128 --max-rows 16384 --reps 6 --ar)
    COSTG=(--shape llada-8b --device cuda --dtype bfloat16 --backend flashinfer --batches 1,8 --prefixes 512,2048
           --window 32,128 --max-rows 16384 --reps 10 --ar --graph)
    FI_BACKEND=flashinfer
    log "FlashInfer kernels compiling in the background"
    timeout -k 5 420 $PY benchmarks/flashinfer_warmup.py --dtypes bfloat16,float16 --head-dims 64,128 --jobs 6 \
        > "$W/0_flashinfer_build.log" 2>&1 &
    WARM=$!
fi
tail -3 "$W/0_machine.log" | tee -a "$OUT/suite.log"
CMP=(--compare benchmarks/results/reference_cpu_float32.json --out "$W")

if want 2a; then
    step 2a_reference_float32 150 $PY benchmarks/reference_devices.py --device "$DEVICE" "${REF[@]}" --dtype float32 \
        --backend torch "${CMP[@]}"
    [ "$DEVICE" = cpu ] || step 2a_reference_bfloat16_torch 150 $PY benchmarks/reference_devices.py --device "$DEVICE" \
        "${REF[@]}" --dtype bfloat16 --backend torch "${CMP[@]}"
fi
if want 2c; then
    step 2c_presto_float32 120 $PY benchmarks/reference_devices.py --device "$DEVICE" --limit 5 --methods presto \
        --dtype float32 --backend torch "${CMP[@]}"
    step 2c_presto_bfloat16 120 $PY benchmarks/reference_devices.py --device "$DEVICE" --limit 5 --methods presto \
        --dtype bfloat16 --backend "$FI_BACKEND" "${CMP[@]}"
fi
if [ -n "${WARM:-}" ]; then
    log "waiting for the FlashInfer build"; wait "$WARM"; log "   build rc=$?"; tail -6 "$W/0_flashinfer_build.log"
fi
want 1 && step 1_gpu_tests 240 $PY -m pytest "${TESTS[@]}"
if want 4; then
    step 4_cuda_graph_step 120 $PY benchmarks/cuda_graph_step.py "${GRAPH[@]}" --out "$W"
    step 4_cuda_graph_step_8b 150 $PY benchmarks/cuda_graph_step.py "${GRAPH8B[@]}" --out "$W"
fi
want 3 && step 3_verify_cost 300 $PY benchmarks/verify_cost.py "${COST[@]}" --out "$W"
want 3g && step 3g_verify_cost_graph 300 $PY benchmarks/verify_cost.py "${COSTG[@]}" --out "$W"
want 2b && step 2b_reference_bfloat16_flashinfer 150 $PY benchmarks/reference_devices.py --device "$DEVICE" \
    "${REF[@]}" --dtype bfloat16 --backend "$FI_BACKEND" "${CMP[@]}"
if want 5 && [ "$DEVICE" != cpu ] && [ -f benchmarks/vllm_gpu_try.py ] && ls wheels/vllm/* > /dev/null 2>&1; then
    VB=${VLLM_BUDGET:-180}  # seconds for vllm_gpu_try.py's stages (import, eager, bfloat16, methods, compiled)
    step 5_vllm $((VB + 20)) bash -c "mkdir -p /tmp/vsite && for t in wheels/vllm/*.tar.xz; do tar -xJf \$t -C /tmp/vsite; done;
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite wheels/vllm/*.whl;
        PYTHONPATH=/tmp/vsite:\$PYTHONPATH $PY benchmarks/vllm_gpu_try.py $W/vllm $VB ${VLLM_MODEL:+--model $VLLM_MODEL} \
        ${VLLM_TIMING:+--timing} ${VLLM_STAGES:+--stages $VLLM_STAGES}"
    want 5s && step 5_sync_tests 90 env PYTHONPATH=/tmp/vsite:$PYTHONPATH $PY -m pytest -m gpu tests/test_attention_sync.py -q \
        -p no:cacheprovider -rfE  # the vLLM builder plans without a device sync (needs vLLM: not in step 1)
fi
log "done"
pack
