"""Timings through vLLM's ``LLM.generate``: the dLLM's decoding methods against plain AR decoding of the same
shape, eager and with torch.compile + PIECEWISE CUDA graphs, at 1 and 16 requests. Stages 9 and 10 of
``benchmarks/vllm_gpu_try.py --timing`` (each in its own process there); the figures are served-path figures
(the plugin's runner, vLLM's scheduler and sampler, every host cost of a step included), on the device named.

- ``tiny`` (stage 9): the ``--model`` dLLM checkpoint (real weights, EOS honoured: what a user gets; held-out
  prompts of a long family it was trained on, 128 tokens at most, else of the short tasks, 32) with static,
  confidence (also with narrow steps and threshold 0.98), PSD (chain) and PSD (skip DAG), prefix cache,
  bfloat16; AR: a Llama-format model of the dLLM's exact shape with dummy weights (``load_format="dummy"``,
  ``ignore_eos``, as many tokens: AR's cost per token does not depend on its weights), on vLLM's Triton
  attention (the GPU bundle has no compiled FlashAttention). Eager, then compiled + PIECEWISE graphs (AR,
  confidence and PSD chain; compiled dLLM outputs are compared with eager's).
- ``8b`` (stage 10): LLaDA-8B's shape (32 layers, hidden 4096, vocabulary 126464) and Llama-3-8B's, dummy weights,
  a 512-token random prompt, 64 tokens (``ignore_eos``), blocks of 32, dual cache (a step forwards the block
  alone, 32 rows a canvas): static (one canvas), PSD chain and skip at depth 3 (4 and 7 canvases), AR;
  torch.compile + PIECEWISE graphs (captured up to 512 rows: a step of 16 requests with canvases runs eagerly).
  With random weights a dLLM's tokens per forward mean nothing, so what counts there is the time of a forward
  with that many canvases against AR's per-token step (``ms/forward``).

Both run vLLM's V1 model runner (the plugin's runners are V1 runners; the try sets ``VLLM_USE_V2_MODEL_RUNNER=0``
for every LLM: on the GPU bundle Model Runner V2 stops at a compiled op it leaves out). ``PSD_TIMING_ONLY`` (name
prefixes, comma-separated) times only those configurations (a rerun).

Per configuration and request count: wall seconds of ``LLM.generate`` (median of ``REPS`` after a warm-up),
output tokens, forwards per request (the plugin's NFE; AR: one per token), tokens per forward (TPF), output
tokens/s, and ms per forward (wall / the most forwards any request of the batch took: the engine's steps).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

REPS = 3
COUNTS = (1, 16)
BIG_PROMPT, BIG_TOKENS, BIG_BLOCK = 512, 64, 32
BIG_GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 224, 256, 512]
# name, speculative config (None: plain AR of the same shape, dummy weights), compiled too
TINY = [("AR (same shape)", None, True),
        ("static", {"decoding": "static"}, False),
        ("confidence", {"decoding": "confidence"}, True),
        # the served headline of benchmarks.md on long answers (dream-tiny-v3): narrow steps, threshold 0.98
        ("confidence suffix32-last t0.98", {"decoding": "confidence", "suffix": 32, "refresh": "last",
                                            "threshold": 0.98}, True),
        ("PSD chain d3", {"decoding": "psd"}, True),
        ("PSD skip d3", {"decoding": "psd", "dag_shape": "skip"}, False),
        # async scheduling (vLLM's batch queue: the next step scheduled and the last one's output processed while
        # a step runs; vLLM's AR above runs with it by default on a GPU); ms/forward counts its cut steps too
        # a step of any method laid out ahead of the last one's host decode (decide_ahead, on by
        # default on a GPU); "ahead off": async scheduling alone, what it adds to
        ("confidence async", {"decoding": "confidence", "async_scheduling": True}, True),
        ("confidence async (ahead off)", {"decoding": "confidence", "async_scheduling": True,
                                         "decide_ahead": "off"}, True),
        ("PSD chain d3 async", {"decoding": "psd", "async_scheduling": True}, True),
        ("PSD chain d3 async (ahead off)", {"decoding": "psd", "async_scheduling": True, "decide_ahead": "off"},
         True),
        # Spiffy (the model's shipped confidence-base graph: the decode config's default policy), laid out ahead
        # since 2026-12-07: its graph's drafts made where the logits are
        ("Spiffy async", {"decoding": "spiffy", "async_scheduling": True}, False),
        ("Spiffy async (ahead off)", {"decoding": "spiffy", "async_scheduling": True, "decide_ahead": "off"}, False),
        # FreeDave lays out min(masks - 1, steps) drafts ahead and often forwards fewer (idle canvases: real rows)
        ("FreeDave async", {"decoding": "freedave", "async_scheduling": True}, False),
        ("FreeDave async (ahead off)", {"decoding": "freedave", "async_scheduling": True, "decide_ahead": "off"},
         False)]
# vLLM captures graphs up to 512 rows by default (min(max_num_seqs x (1 + num_speculative_tokens) x 2, 512));
# a dLLM step of one request with prefix cache and long answers has up to ~200 rows a canvas, so PSD's canvases
# and most steps of 16 requests run eagerly there. These also run with graphs captured up to WIDE_GRAPH_ROWS.
WIDE, WIDE_GRAPH_ROWS = ("confidence", "PSD chain d3"), 2048
BIG = [("AR Llama-3-8B", None),
       ("static (1 canvas)", {"decoding": "static"}),
       ("PSD chain d3 (4 canvases)", {"decoding": "psd"}),
       ("static (1 canvas) async", {"decoding": "static", "async_scheduling": True}),
       ("static (1 canvas) async (ahead off)", {"decoding": "static", "async_scheduling": True,
                                               "decide_ahead": "off"}),
       ("PSD chain d3 (4 canvases) async", {"decoding": "psd", "async_scheduling": True}),
       ("PSD chain d3 (4 canvases) async (ahead off)", {"decoding": "psd", "async_scheduling": True,
                                                        "decide_ahead": "off"}),
       ("PSD skip d3 (7 canvases)", {"decoding": "psd", "dag_shape": "skip"})]
LLADA_8B = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu", "block_type": "llama",
            "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_hidden_size": 12288,
            "vocab_size": 126464, "embedding_size": 126464, "mask_token_id": 126336, "eos_token_id": 126081,
            "pad_token_id": 126081, "bos_token_id": 126080, "max_sequence_length": 4096, "rope": True,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "layer_norm_type": "rms", "include_bias": False,
            "include_qkv_bias": False, "weight_tying": False, "tie_word_embeddings": False}
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "eos_token_id": 128001, "bos_token_id": 128000, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "head_dim": 128}
SMALL = {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 512,  # CPU dry runs
         "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 512, "head_dim": 64}


def same_shape_ar(spec) -> dict:
    """A Llama config of the dLLM's shape (layers, widths, heads, vocabulary): AR's cost at that shape."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden_size,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "intermediate_size": spec.intermediate_size, "vocab_size": spec.vocab_size,
            "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
            "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position,
            "eos_token_id": spec.eos_token_id, "bos_token_id": 1, "hidden_act": "silu",
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


def config_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def measure(llm, prompts, params, dllm: bool) -> dict:
    """``LLM.generate`` of ``prompts``: a warm-up, then the median of ``REPS`` timed calls."""
    from psd_plugin.vllm import compat

    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    walls, outs = [], None
    for _ in range(REPS):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    steps = {}
    if dllm:
        stats = compat.request_stats(llm)
        nfe = [stats[o.request_id]["nfe"] for o in outs]
        # the engine's steps since it started (warm-up and every rep): under async scheduling the forwards run,
        # the steps that skipped theirs (guesses that missed alone) and the cut ones
        st = compat.psd_stats(llm)["step_time"]
        steps = {k: st.get(k, 0) for k in ("steps", "forwards", "skipped_forwards", "cut_steps", "deferred", "ahead",
                                         "ahead_planned", "ahead_rebatched", "ahead_left", "ahead_idle_canvases",
                                         "ahead_mismatch")}
    else:
        nfe = [len(t) for t in tokens]  # one forward a token (the prefill's included)
    wall = statistics.median(walls)
    n_tok = sum(map(len, tokens))
    return {"n": len(prompts), "wall_s": round(wall, 4), "walls": [round(w, 4) for w in walls], "tokens": n_tok,
            "engine_steps": steps,
            "nfe_mean": round(sum(nfe) / len(nfe), 2), "tpf": round(n_tok / max(1, sum(nfe)), 3),
            "tok_s": round(n_tok / wall, 1), "ms_per_forward": round(1e3 * wall / max(1, max(nfe)), 3),
            "token_ids": tokens}


def stage_timing(device: str, res: dict, scale: str, model_dir: Path, kwargs_fn, prompts_fn, out: Path) -> dict:
    """Stage 9 (``scale="tiny"``) or 10 (``"8b"``); ``res["rows"]`` is filled run by run. ``kwargs_fn(eager)``:
    the LLM keyword arguments the try uses (custom ops off, native IR ops, memory share); ``prompts_fn(n)``:
    ``(prompts, max_tokens, what)``, ``n`` held-out prompts as token ids."""
    import gc
    import random

    import torch
    from vllm import LLM, SamplingParams

    from model_executor.models.configs import ArchSpec, register_configs
    from psd_plugin.vllm import compat

    register_configs()
    res["rows"], res["errors"] = [], {}
    tmp = Path("/tmp/psd_vllm_timing")
    small = {} if device != "cpu" else SMALL
    if scale == "tiny":
        spec = ArchSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        ar_dir = config_dir(tmp / "ar-same-shape", same_shape_ar(spec))
        dllm_dir = model_dir
        prompts, max_tokens, res["prompts"] = prompts_fn(max(COUNTS))
        runs = [(name, cfg, "eager") for name, cfg, _ in TINY] + \
            [(name, cfg, "graphs") for name, cfg, compiled in TINY if compiled] + \
            [(name, cfg, "wide") for name, cfg, compiled in TINY if compiled and name in WIDE]
        block, cache = None, "prefix"
    else:
        ar_dir = config_dir(tmp / "llama-8b-shape", {**LLAMA_8B, **{k: v for k, v in small.items()
                                                                   if k in LLAMA_8B}})
        dllm_dir = config_dir(tmp / "llada-8b-shape", {**LLADA_8B, **{k: v for k, v in small.items()
                                                                     if k in LLADA_8B}})
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 30000) for _ in range(BIG_PROMPT)] for _ in range(max(COUNTS))]
        # compiled + PIECEWISE graphs: eager with the bundle's PyTorch-form ops is launch-bound at 32 layers
        # (about 2 ms a layer on the H200, 2026-11-27), which says nothing about the GPU's cost of canvases
        runs = [(name, cfg, "graphs") for name, cfg in BIG]
        max_tokens, block, cache = BIG_TOKENS, BIG_BLOCK, "dual"
        res["prompts"] = f"{BIG_PROMPT} random token ids"
    res.update(scale=scale, model=str(dllm_dir), max_tokens=max_tokens, counts=list(COUNTS), reps=REPS,
               dtype="bfloat16" if device != "cpu" else "float32")
    eager_tokens = {}
    only = [x for x in os.environ.get("PSD_TIMING_ONLY", "").split(",") if x]  # name prefixes (a rerun)
    runs = [r for r in runs if not only or any(r[0].startswith(o) for o in only)]
    for name, cfg, how in runs:  # how: "eager", "graphs" (vLLM's capture range) or "wide" (to WIDE_GRAPH_ROWS)
        eager, wide = how == "eager", how == "wide"
        mode = "eager" if eager else ("PIECEWISE" if device != "cpu" else "compiled") + \
            (f" to {WIDE_GRAPH_ROWS} rows" if wide else "")
        key = f"{name} [{mode}]"
        ar = cfg is None
        try:
            kw = kwargs_fn(eager)
            if scale == "8b" and not eager and device != "cpu":  # the steps' row counts (AR 1-16; dLLM at one
                # request 32 a canvas, 576 a block's first step), graphs beyond 512 rows are not captured
                kw["compilation_config"] = {**kw["compilation_config"], "cudagraph_capture_sizes": BIG_GRAPH_SIZES}
            if wide:
                kw["compilation_config"] = {**kw["compilation_config"], "max_cudagraph_capture_size": WIDE_GRAPH_ROWS}
                kw["max_num_batched_tokens"] = max(8192, WIDE_GRAPH_ROWS)
            kw["dtype"] = "bfloat16" if device != "cpu" else "float32"
            kw["max_num_seqs"] = max(COUNTS)
            kw["max_model_len"] = 1024 if scale == "8b" else 512
            if ar:
                kw.update(model=str(ar_dir), load_format="dummy", skip_tokenizer_init=True)
                if device != "cpu":
                    kw["attention_backend"] = "TRITON_ATTN"
            else:
                spec_cfg = {"method": "psd", "cache": cache, **cfg, **({"block_size": block} if block else {})}
                kw.update(model=str(dllm_dir), speculative_config=spec_cfg)
                if scale == "8b":
                    kw.update(load_format="dummy", skip_tokenizer_init=True)
            if scale == "8b" and device != "cpu":  # 16 GB of weights, 16 x 576 tokens of K/V (5 GB), activations
                kw["gpu_memory_utilization"] = 0.35
            if device != "cpu":  # what an earlier LLM of this process may have left behind
                res.setdefault("free_gib_before", {})[key] = round(torch.cuda.mem_get_info()[0] / 2**30, 1)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ar or scale == "8b",
                                    detokenize=not (ar or scale == "8b"))
            t0 = time.perf_counter()
            llm = LLM(**kw)
            build = time.perf_counter() - t0
            for n in COUNTS:
                row = {"config": name, "mode": mode, "build_s": round(build, 1),
                       **measure(llm, prompts[:n], params, dllm=not ar)}
                toks = row.pop("token_ids")
                if not ar and scale == "tiny":
                    if eager:
                        eager_tokens[(name, n)] = toks
                    elif (name, n) in eager_tokens:  # compiled (graphs of either range)
                        row["same_as_eager"] = sum(a == b for a, b in zip(toks, eager_tokens[(name, n)]))
                res["rows"].append(row)
                print(f"TIME {scale} {key} n={n}: {row['tok_s']} tok/s, {row['ms_per_forward']} ms/forward, "
                      f"TPF {row['tpf']}, NFE {row['nfe_mean']}", flush=True)
            compat.shutdown(llm)
            del llm
        except BaseException as e:  # noqa: BLE001
            import traceback

            res["errors"][key] = f"{type(e).__name__}: {str(e)[:500]}"
            res.setdefault("tracebacks", {})[key] = traceback.format_exc()[-3000:]
            print(f"FAIL {scale} {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
        (out / f"vllm_timing_{scale}.md").write_text(render(res, device))
    return res


def render(res: dict, device: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else "CPU (dry run)"
    what = (f"the dLLM checkpoint's real weights, {res['prompts']}, EOS honoured; AR: the same shape, dummy "
            f"weights, {res['max_tokens']} tokens" if res["scale"] == "tiny" else
            f"dummy weights, {BIG_PROMPT}-token prompt, {BIG_TOKENS} tokens, blocks of {BIG_BLOCK}, dual cache")
    lines = [f"`LLM.generate` through vLLM on {gpu}, {res['dtype']}; {Path(res['model']).name}: {what}. Median of {res['reps']} "
             "timed calls after a warm-up; ms/forward = wall / the most forwards any request took (the engine's "
             "steps).", "",
             "| config | mode | requests | tok/s | ms/forward | TPF | forwards/request | wall s | build s | "
             "same as eager |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['config']} | {r['mode']} | {r['n']} | {r['tok_s']} | {r['ms_per_forward']} | {r['tpf']} | "
                     f"{r['nfe_mean']} | {r['wall_s']} | {r['build_s']} | "
                     f"{r.get('same_as_eager', '')}{'/' + str(r['n']) if 'same_as_eager' in r else ''} |")
    for k, v in res.get("errors", {}).items():
        lines.append(f"\nFAILED {k}: {v}")
    return "\n".join(lines) + "\n"
