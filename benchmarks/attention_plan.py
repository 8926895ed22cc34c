"""The layout and the PyTorch attention path's planning of real dLLM steps, each timed alone, with a digest of
every layout and plan they make.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/attention_plan.py [--root CHECKOUT] [--methods freedave,psd,...]

Each method's steps are replayed on the host without a model (``dream-tiny``'s geometry, block 8, the dual
cache, 30-72-token prompts, 32 new tokens, random logits of its 512-token vocabulary): every step's layout
(``build_step_batch``) is kept, then planned as the vLLM backend plans a step that runs on PyTorch's attention
(``StepBatch.plan`` over a block table, then ``TorchPrefixAttention.plan`` with the scheduled rows' cache slots
and the row order). Prints ms per step (best and median of five passes over the steps) and a digest of every
index and mask tensor of every plan: equal digests from two checkouts (``--root``, e.g. a ``git worktree`` of
the commit before a change) mean bit-identical plans. The same for the layouts: every step's entries laid
out again by ``build_step_batch`` (ms per step, best and median of five passes), and a digest of every field of
every batch. Host-only wall time on this machine, in a warm loop (in an engine each step runs this code once,
after a forward has passed the model's weights through the caches: slower, and gains smaller); no model runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_FIELDS = ("q_idx", "k_idx", "p_slots", "k_slots", "mask", "unseen", "o_idx")
LAYOUT_FIELDS = ("scheduled_lens", "positions", "input_ids", "extra_ids", "order", "qo_indptr", "seg_indptr",
                 "prefix_lens", "suffix_starts", "suffix_lens", "logits_rows", "rewrite_ids")


def steps_of(method: str, c: int, n: int):
    """``n`` steps of ``c`` requests decoding with ``method`` (a finished request is replaced): each step's
    entries (its requests' planned steps) and its layout."""
    import msgspec
    import torch

    from attention_backends.step_batch import build_step_batch
    from benchmarks.engines import method_knobs
    from model_executor.decode_config import DecodeKnobs, resolve
    from model_executor.decoding import propose_all
    from model_executor.dllm_request import DLLMRequest, decode_step
    from model_executor.models.configs import ArchSpec

    model = ROOT / "psd_plugin" / "checkpoints" / "dream-tiny"
    spec = ArchSpec.from_hf_config(json.loads((model / "config.json").read_text()))
    extra = method_knobs(method, model, "reference")
    graph = extra.pop("graph", None)
    cfg = resolve(method, msgspec.convert({"cache": "dual", **extra}, DecodeKnobs), spec, block_size=8,
                  where="benchmark", graph=graph)
    g = torch.Generator().manual_seed(0)

    def request(k):
        return DLLMRequest(list(range(10, 40 + 7 * k)), 32, 8, cfg.decoder_factory(spec.mask_token_id, None),
                           spec.mask_token_id, spec.eos_token_id, ignore_eos=True, schedule=cfg.schedule)

    reqs, out = [request(k) for k in range(c)], []
    while len(out) < n:
        live = [r for r in reqs if not r.done]
        steps = [r.plan(p) for p, r in zip(propose_all([r.dec for r in live]), live)]
        batch = build_step_batch(steps)
        out.append((steps, batch))
        kept = torch.cat([st.kept for st in steps])
        logits = torch.randn(int(kept.sum()), spec.vocab_size, generator=g) * 3
        decode_step(logits, kept, spec.mask_token_id, live, steps, batch.canvas_rows)
        for r, st in zip(live, steps):
            r.stepped(st)
        reqs = [request(k) if r.done else r for k, r in enumerate(reqs)]
    return out


def layout_pass(entries) -> tuple[float, str]:
    """Lay out every step's entries once: ms per step, and the digest of every field of every batch."""
    from attention_backends.step_batch import build_step_batch

    digest, seconds = hashlib.sha1(), 0.0
    for e in entries:
        t0 = time.perf_counter()
        b = build_step_batch(e)
        seconds += time.perf_counter() - t0
        for name in LAYOUT_FIELDS:
            t = getattr(b, name)
            digest.update(name.encode() + (b"-" if t is None else str(t.dtype).encode() + t.numpy().tobytes()))
        digest.update(f"{b.num_scheduled}{b.canvas_rows}{b.layout_key}{b.kind}".encode())
    return 1e3 * seconds / len(entries), digest.hexdigest()[:12]


def plan_pass(batches, attn, page: int = 128) -> tuple[float, str]:
    """Plan every batch once: ms per step, and the digest of every plan's tensors."""
    import torch

    from attention_backends.vllm_backend import vllm_slots

    digest, seconds = hashlib.sha1(), 0.0
    for b in batches:
        R = b.num_requests
        table = torch.arange(R * 4, dtype=torch.int32).view(R, 4)
        qsl = torch.zeros(R + 1, dtype=torch.long)
        qsl[1:] = torch.cumsum(b.scheduled_lens, 0)
        slots = vllm_slots(table, b.prefix_lens, qsl, page)
        cached = torch.cat([slots, torch.full((b.num_extra,), -1, dtype=torch.long)])
        t0 = time.perf_counter()
        plan = b.plan(table, page, "bidirectional", 0)
        attn.plan(plan, 4, 4, 64, torch.float32, device="cpu", cached=cached, rows=b.order)
        seconds += time.perf_counter() - t0
        for name in PLAN_FIELDS:
            t = getattr(attn, name)
            digest.update(name.encode())
            if t is not None:
                digest.update(f"{tuple(t.shape)}{t.dtype}".encode() + t.contiguous().numpy().tobytes())
        digest.update(str(attn.shape).encode())
    return 1e3 * seconds / len(batches), digest.hexdigest()[:12]


def main() -> None:
    global ROOT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose code is timed")
    ap.add_argument("--methods", default="confidence,psd,lopa,spiffy,freedave")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    ROOT = args.root.resolve()
    sys.path.insert(0, str(ROOT))
    import torch

    from attention_backends.torch_backend import TorchPrefixAttention

    torch.set_num_threads(2)
    for method in args.methods.split(","):
        for c in map(int, args.concurrency.split(",")):
            steps = steps_of(method, c, args.steps)
            entries, batches = [e for e, _ in steps], [b for _, b in steps]
            layout_pass(entries)  # warm
            runs = [layout_pass(entries) for _ in range(5)]
            ms = sorted(r[0] for r in runs)
            print(f"{method:<11} c={c:<3} layout ms per step: best {ms[0]:.3f}, median {ms[2]:.3f}  "
                  f"layouts digest {runs[0][1]}", flush=True)
            attn = TorchPrefixAttention()
            plan_pass(batches, attn)  # warm
            runs = [plan_pass(batches, attn) for _ in range(5)]
            ms = sorted(r[0] for r in runs)
            print(f"{method:<11} c={c:<3} plan ms per step: best {ms[0]:.3f}, median {ms[2]:.3f}  "
                  f"plans digest {runs[0][1]}", flush=True)


if __name__ == "__main__":
    main()
