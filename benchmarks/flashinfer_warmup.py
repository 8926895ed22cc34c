"""Compile (JIT) and load the FlashInfer kernels the attention backend uses, for some dtypes and head sizes.

    python benchmarks/flashinfer_warmup.py --dtypes bfloat16,float16 --head-dims 64,128 [--jobs 4]   # on the GPU
    python benchmarks/flashinfer_warmup.py --aot DIR --arch 9.0a ...      # ahead of time, on a machine without one

FlashInfer 0.7 builds its kernels with nvcc on first use (a prefill module per dtype and head size, FA2, about a
minute of one core per source file) and caches them under ``~/.cache/flashinfer``. On the GPU this plans and runs
the backend once per combination (a masked and an unmasked plan, a prefix and none: every module a forward can
ask for), one process per combination in parallel. ``--aot DIR`` builds the same modules without a GPU (nvcc
and CUDA's headers from pip: ``benchmarks/gpu_bundle.sh`` sets them up) into ``DIR/<module>/<module>.so``,
FlashInfer's AOT layout (``flashinfer/data/aot``): modules found there are loaded without compiling.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def warm(dtype: torch.dtype, head_dim: int) -> None:
    from attention_backends.prefix_attention import AttentionPlan, make_backend

    fi = make_backend("flashinfer", "cuda", dtype)
    H, Hkv, page = 4, 2, 16
    for kind, masks in (("bidirectional", None), ("custom", [torch.ones(3, 3, dtype=torch.bool).tril()] * 2)):
        plan = AttentionPlan(torch.tensor([0, 3, 6]), torch.tensor([0, 20]), torch.tensor([[0, 1], [2, 3]]), page,
                             kind=kind, seg_indptr=torch.tensor([0, 3, 6]), custom_masks=masks)
        fi.plan(plan, H, Hkv, head_dim, dtype)
        q, k, v = (torch.randn(6, h, head_dim, dtype=dtype, device="cuda") for h in (H, Hkv, Hkv))
        kc, vc = (torch.randn(4, page, Hkv, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        fi.run(q, k, v, kc, vc)
    torch.cuda.synchronize()


def aot_specs(dtypes: list[str], head_dims: list[int]) -> list:
    """FlashInfer's JIT specs of what :func:`warm` loads: the FA2 batch-prefill modules (the equal-stride primary and
    the independent-stride paged one) per dtype and head size, the cascade module (``merge_state``) and the
    quantization module (``segment_packbits``, a test)."""
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_independent_paged_module,
                                                  _gen_batch_prefill_primary_module)
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.quantization import gen_quantization_module

    specs = [gen_cascade_module(), gen_quantization_module()]
    for name in dtypes:
        dt = getattr(torch, name)
        for hd in head_dims:  # what BatchPrefillWith{Ragged,Paged}KVCacheWrapper.plan asks for (int32 indptrs)
            args = (dt, dt, dt, torch.int32, hd, hd, 0, False, False, False)
            specs += [_gen_batch_prefill_primary_module("fa2", *args),
                      _gen_batch_prefill_independent_paged_module("fa2", *args)]
    return specs


def build_aot(out: Path, dtypes: list[str], head_dims: list[int], arch: str) -> None:
    """Build :func:`aot_specs` with nvcc (no GPU needed) and copy each ``.so`` to ``out/<name>/<name>.so``."""
    import shutil

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)
    for spec in aot_specs(dtypes, head_dims):
        t0 = time.perf_counter()
        spec.build(verbose=False)
        (out / spec.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(spec.jit_library_path, out / spec.name / f"{spec.name}.so")
        print(f"{spec.name}: {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--jobs", type=int, default=4, help="nvcc jobs per combination (MAX_JOBS)")
    ap.add_argument("--one", help="dtype:head_dim (a worker process)")
    ap.add_argument("--aot", type=Path, help="build without a GPU into this folder (FlashInfer's AOT layout)")
    ap.add_argument("--arch", default="9.0a", help="with --aot: FLASHINFER_CUDA_ARCH_LIST (9.0a: H100, H200)")
    args = ap.parse_args()
    if args.aot:
        build_aot(args.aot, args.dtypes.split(","), [int(h) for h in args.head_dims.split(",")], args.arch)
        return
    if args.one:
        dtype, hd = args.one.split(":")
        t0 = time.perf_counter()
        warm(getattr(torch, dtype), int(hd))
        print(f"{args.one}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        return
    env = dict(os.environ, MAX_JOBS=str(args.jobs))
    procs = [subprocess.Popen([sys.executable, __file__, "--one", f"{d}:{h}"], env=env)
             for d in args.dtypes.split(",") for h in args.head_dims.split(",")]
    failed = sum(p.wait() != 0 for p in procs)
    if failed:
        raise SystemExit(f"{failed} of {len(procs)} FlashInfer builds failed")


if __name__ == "__main__":
    main()
