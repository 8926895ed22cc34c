#!/usr/bin/env bash
# vLLM 0.32's Python sources for the GPU image (torch 2.11, no vllm), packed into wheels/vllm/ (git-ignored):
#
#   bash benchmarks/vllm_gpu_bundle.sh            # here, with the package registry; ~2 min, 330 MB of downloads
#
# then on the GPU machine (repo root; gpu_suite.sh step 5 does this), see docs/vllm-on-gpu-image.md:
#
#   mkdir -p /tmp/vsite && for t in wheels/vllm/*.tar.xz; do tar -xJf $t -C /tmp/vsite; done
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite wheels/vllm/*.whl
#   PYTHONPATH=/tmp/vsite:/tmp/site:$PYTHONPATH python3 benchmarks/vllm_gpu_try.py OUT [BUDGET_S]
#
# What it holds (issue 26's route):
# - vllm-0.32.0-py.tar.xz: the CUDA wheel's vllm/ package without any compiled extension (*.so: built against
#   torch 2.13, they cannot load on 2.11), without vllm-rs (a Rust binary) and third_party's kernel packages
#   (deep_gemm, flashmla, fmha_sm100, tml_fa4, triton_kernels; pynvml.py and flash_linear_attention stay);
#   every model file stays (the registry imports by name, and xz makes them cheap). Added: a dist-info saying
#   Name vllm / Version 0.32.0 (vLLM reads its version, and "cpu" in it, from the distribution `vllm`), and
#   vllm/_C_stable_libtorch.py, a stub standing for the absent extension (platforms/cuda.py imports it
#   unguarded): it defines the schemas of the `_C` ops that vLLM's fusion passes reference at import time
#   (no kernel: calling one fails naming it) and weak_ref_tensor in Python (CUDA-graph capture).
#   Also psd_plugin-0.1.0.dist-info with only the `vllm.general_plugins` entry point, so that vLLM's
#   plugin loader finds psd-plugin (the repo root must be on PYTHONPATH).
# - vllm-deps-cp312.tar.xz: the packages vLLM's offline LLM path imports that the image lacks, unpacked
#   (cp312 manylinux x86_64 builds, the project venv's versions); msgspec stays a wheel.
# The image already has torch, triton, transformers, numpy, tokenizers, ...; FlashInfer and apache-tvm-ffi
# (xgrammar's FFI) come from benchmarks/gpu_bundle.sh (wheels/, /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTD=wheels/vllm
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUTD"
rm -f "$OUTD"/*.tar.xz "$OUTD"/*.whl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
ver() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)

# 1. vLLM's Python sources, from the CUDA wheel (the same Python as the CPU build in .venv, except
#    _version.py, platforms/__init__.py's version fallback and utils/cpu_triton_utils.py)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" vllm==0.32.0
mkdir "$TMP/v"
(cd "$TMP/v" && "$PY" -m zipfile -e "$TMP"/dl/vllm-0.32.0-*.whl .)
rm -rf "$TMP/dl"
V="$TMP/v/vllm"
cat > "$V/_C_stable_libtorch.py" <<'EOF'
"""Stand-in for vLLM's compiled `_C_stable_libtorch` (psd-plugin's GPU bundle, benchmarks/vllm_gpu_bundle.sh).

The real extension is built against torch 2.13 and cannot load on the GPU image's torch 2.11. vLLM's CUDA
platform imports it unguarded, and its compilation passes read `torch.ops._C.<op>.default` at import time, so
this stub defines those ops' schemas (copied from the 0.32.0 extension) without kernels: calling one raises
"Could not run '_C::<op>' ..." at the call. Run with compilation_config custom_ops ["none"] so that vLLM's
layers take their PyTorch paths. weak_ref_tensor (CUDA-graph capture) gets a Python kernel that returns a
detached alias (keeps the storage alive, which a weak reference would not: more memory, same values).
Set PSD_VLLM_STUB_OPS=0 to define nothing.
"""
import os

import torch

SCHEMAS = __SCHEMAS__

_lib = None
if os.environ.get("PSD_VLLM_STUB_OPS", "1") != "0":
    _lib = torch.library.Library("_C", "FRAGMENT")
    for _s in SCHEMAS:
        try:
            _lib.define(_s)
        except RuntimeError:  # already defined (e.g. a real extension loaded first)
            pass
    try:
        _lib.impl("weak_ref_tensor", lambda t: t.detach(), "CompositeExplicitAutograd")
    except RuntimeError:
        pass
    for _s in SCHEMAS:  # capability queries (some called at import): no compiled kernel supports anything
        _name = _s.split("(")[0]
        if _s.endswith("-> bool") and "support" in _name:
            try:
                _lib.impl(_name, lambda *a, **k: False, "CompositeExplicitAutograd")
            except RuntimeError:
                pass
EOF
# the schemas of the _C ops that vllm/compilation reads as torch.ops._C.<op>.default at import, and of
# weak_ref_tensor, from the CUDA extension's string table (before the .so files go)
"$PY" - "$V" <<'EOF'
import re, sys, pathlib
V = pathlib.Path(sys.argv[1])
needed = {"weak_ref_tensor"}
for p in (V / "compilation").rglob("*.py"):
    needed |= set(re.findall(r"torch\.ops\._C\.(\w+)\.default", p.read_text()))
found = {}
for chunk in (V / "_C_stable_libtorch.abi3.so").read_bytes().split(b"\0"):
    try:
        s = chunk.decode("ascii")
    except UnicodeDecodeError:
        continue
    m = re.fullmatch(r"\s*(\w+)\((.*)\)\s*->\s*(.+?)\s*", s, re.S)
    if m:
        found.setdefault(m.group(1), re.sub(r"\s+", " ", f"{m.group(1)}({m.group(2)}) -> {m.group(3)}"))
needed |= {n for n, sch in found.items() if "support" in n and sch.endswith("-> bool")}
missing = sorted(needed - set(found))
if missing:
    sys.exit(f"no schema found for {missing}")
stub = V / "_C_stable_libtorch.py"
body = "[\n" + "".join(f"    {found[n]!r},\n" for n in sorted(needed)) + "]"
stub.write_text(stub.read_text().replace("__SCHEMAS__", body))
print(f"stub: {len(needed)} _C schemas:", " ".join(sorted(needed)))
EOF
find "$V" -name '*.so' -delete
# vllm_flash_attn raises ImportError at import without its extensions, and the CUDA attention utilities
# import it unguarded: let it import (its functions then fail when called; psd's backend never calls them)
"$PY" - "$V/vllm_flash_attn/__init__.py" <<'EOF'
import sys, pathlib
p = pathlib.Path(sys.argv[1])
old = "if not (FA2_AVAILABLE or FA3_AVAILABLE):"
new = 'if not (FA2_AVAILABLE or FA3_AVAILABLE) and os.environ.get("PSD_VLLM_STUB_OPS", "1") == "0":  # psd bundle'
t = p.read_text()
if t.count(old) != 1:
    sys.exit(f"{p}: expected text not found, vLLM differs from 0.32.0")
p.write_text(t.replace(old, new))
EOF
rm -rf "$V/vllm-rs" "$V"/third_party/{deep_gemm,flashmla,fmha_sm100,tml_fa4,triton_kernels}
find "$V" -name __pycache__ -prune -exec rm -rf {} +
DI="$TMP/v/vllm-0.32.0.dist-info"
# keep the wheel's metadata (Name vllm, Version 0.32.0, entry points) less Requires-Dist and RECORD
grep -v '^Requires-Dist:' "$DI/METADATA" > "$TMP/METADATA" && mv "$TMP/METADATA" "$DI/METADATA"
rm -f "$DI/RECORD"
echo "psd-plugin bundle: vllm 0.32.0 Python sources, compiled extensions removed" > "$DI/INSTALLER"
# psd-plugin's entry point, for vLLM's plugin loader (engine-core / worker processes)
P="$TMP/v/psd_plugin-0.1.0.dist-info"
mkdir "$P"
printf 'Metadata-Version: 2.1\nName: psd-plugin\nVersion: 0.1.0\n' > "$P/METADATA"
printf '[vllm.general_plugins]\npsd = psd_plugin:register\n' > "$P/entry_points.txt"
echo "psd-plugin bundle (entry point only; the package is the repo root on PYTHONPATH)" > "$P/INSTALLER"
tar -C "$TMP/v" -cf - vllm vllm-0.32.0.dist-info psd_plugin-0.1.0.dist-info | xz -9e -T0 > "$OUTD/vllm-0.32.0-py.tar.xz"
rm -rf "$TMP/v"

# 2. what the image lacks on the LLM.generate path (found by importing vLLM's engine, workers, config and
#    entrypoints.llm with the image's package set: benchmarks/vllm_gpu_bundle.sh's notes in the doc)
DEPS=(pydantic pydantic_core annotated-types typing-inspection pyzmq cbor2 pybase64 oss-harmony openai httpx2
      sniffio cachetools xgrammar llguidance fastapi starlette partial-json-parser
      compressed-tensors loguru depyf astor dill)  # the last five: imported when the GPU runner loads the model
                                                   # (quantization/online imports compressed_tensors; H100 run)
SPECS=()
for d in "${DEPS[@]}"; do
    v=$(ver "$d"); [ -n "$v" ] || { echo "not in $PY's environment: $d" >&2; exit 1; }
    SPECS+=("$d==$v")
done
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/w" "${SPECS[@]}" "msgspec==$(ver msgspec)"
mv "$TMP"/w/msgspec-*.whl "$OUTD/"
mkdir "$TMP/deps"  # a wheel unpacked is an install (no scripts needed; their .data folders dropped)
for w in "$TMP"/w/*.whl; do (cd "$TMP/deps" && "$PY" -m zipfile -e "$w" .); done
rm -rf "$TMP"/deps/*.data
find "$TMP/deps" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$TMP/deps" -cf - . | xz -9e -T0 > "$OUTD/vllm-deps-cp312.tar.xz"

ls -la "$OUTD"
echo "wheels/vllm: $(du -cb "$OUTD"/* | tail -1 | cut -f1) bytes (limit 22 MiB = 23068672)"
[ "$(du -cb "$OUTD"/* | tail -1 | cut -f1)" -le 23068672 ] || { echo "over 22 MiB" >&2; exit 1; }
