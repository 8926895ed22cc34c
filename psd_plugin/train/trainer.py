"""Train the embedded models: a LLaDA-format masked-diffusion model, a Llama-format AR baseline and an
SDAR-format block-diffusion drafter (PRESTO's drafter for the AR model).

``python -m psd_plugin.train --kind dllm --out DIR`` (or ``psd train``). CPU by default, CUDA when present;
seeds fixed; a tqdm progress bar; resumable (``DIR/train_state.pt`` every ``--save-every`` steps, read back with
torch's safe unpickler; the batch of step ``s`` is generated from ``seed + s``, so a resumed run sees exactly
the same data).

Objectives:
- dLLM (LLaDA SFT, Nie et al. 2025 Eq. 5): the prompt stays clean; each answer token (answer plus EOS
  padding to ``--gen-len``, or to the task's budget for a long task: 256) is masked with probability ``t ~ U(eps, 1]``; loss = cross-entropy on masked
  positions weighted by ``1/t``, normalised by the answer length, averaged over the batch.
- AR: next-token cross-entropy on the answer and its EOS.
- drafter (SDAR format, block-causal attention of ``--block`` tokens aligned to absolute positions): as the
  dLLM objective, but every attention block of the answer draws its own mask rate ``t_j ~ U(eps, 1]``, so
  the model learns to fill a block from clean or partially masked earlier blocks. That is how PRESTO drafts:
  the rest of the current block and the next block, masked, behind the accepted context (a choice: SDAR's
  own recipe trains against clean context only; drafting one block ahead needs the noisy case too).
  ``--init DIR`` starts from a dLLM checkpoint of the same shape (q/k norms start at one).
- ``--init`` also continues a model of the same kind (a second stage on another task mix, ``--tasks``).
- ``--suffix-windows F`` (dLLM): in a fraction F of the steps each group of rows sees its answer region cut to
  a random multiple of 8 tokens (at least 8), as decoding with the ``suffix`` knob shows the model a canvas
  that stops a few positions after the current block; so the visible end of the canvas stops meaning the end
  of the answer.

Rows of one batch with different answer regions (short and long tasks) go through the model as separate
forwards, each padded to its own length: a short row never attends to a long row's padding, as at inference.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .tasks import ALL_TASKS, answer_budget, load_heldout, parse_tasks, training_stream
from ..tokenizer import EOS, render_prompt, train_tokenizer

SIZES = {  # name: (hidden, layers, heads, mlp)
    "tiny": (128, 2, 2, 256),  # tests only
    "small": (256, 6, 4, 768),  # 5.4M parameters with the 512-token vocabulary
}


def _batch(step: int, seed: int, batch: int, tok, exclude: set[str], tasks=ALL_TASKS):
    stream = training_stream(seed * 100003 + step, exclude, tasks)
    exs = [next(stream) for _ in range(batch)]
    prompts = [tok(render_prompt(e.prompt), add_special_tokens=False).input_ids for e in exs]
    answers = [tok(e.answer, add_special_tokens=False).input_ids for e in exs]
    return prompts, answers, [e.task for e in exs]


def by_region(row_tasks: list[str], gen_len: int) -> list[tuple[int, list[int]]]:
    """The rows of a batch grouped by answer region (``gen_len``, or a long task's budget): ``(region, rows)``
    in increasing region order; each group is one forward, padded to its own length."""
    regions = [max(gen_len, answer_budget(t)) for t in row_tasks]
    return [(r, [i for i, x in enumerate(regions) if x == r]) for r in sorted(set(regions))]


def cut_regions(prompt_lens: list[int], region: int, rng: random.Random) -> list[int]:
    """``--suffix-windows``: each row's answer region cut so that the rows end at one position, a random multiple of
    8 tokens (at least 8) after the longest prompt, or at their whole ``region`` if that comes first: no EOS
    padding follows a cut answer (the visible end of the canvas is not the answer's end)."""
    end = max(prompt_lens) + 8 * rng.randint(1, max(1, region // 8))
    return [min(region, end - n) for n in prompt_lens]


def _dllm_tensors(prompts, answers, gen_len, eos, pad_to_multiple=8):
    """[prompt | answer EOS...] right-padded with EOS; EOS padding counts as answer (LLaDA SFT). ``gen_len``: the
    answer region, or one per row."""
    lens = gen_len if isinstance(gen_len, list) else [gen_len] * len(prompts)
    rows = [p + (a + [eos] * n)[:n] for p, a, n in zip(prompts, answers, lens)]
    L = max(len(r) for r in rows)
    L = -(-L // pad_to_multiple) * pad_to_multiple
    ids = torch.full((len(rows), L), eos, dtype=torch.long)
    is_answer = torch.zeros((len(rows), L), dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        ids[i, : len(r)] = torch.tensor(r)
        is_answer[i, len(p):] = True
    return ids, is_answer


def predictions(model, x):
    """The model's prediction for every position of ``x``: its output there, or, for a format with shifted
    logits (Dream: an AR model's next-token head kept), its output at the position before (the first position
    repeats its own, as Dream's code does)."""
    out = model(x)
    if model.spec.shift_logits:
        out = torch.cat([out[:, :1], out[:, :-1]], 1)
    return out


def dllm_loss(model, ids, is_answer, mask_id, generator=None, eps=1e-3):
    B = ids.shape[0]
    t = eps + (1 - eps) * torch.rand(B, 1, generator=generator, device=ids.device)
    masked = (torch.rand(ids.shape, generator=generator, device=ids.device) < t) & is_answer
    x = torch.where(masked, torch.full_like(ids, mask_id), ids)
    logits = predictions(model, x)
    ce = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    ans_len = is_answer.sum(1, keepdim=True).expand_as(ids)[masked].float()
    return (ce / t.expand_as(ids)[masked] / ans_len).sum() / B


def drafter_loss(model, ids, is_answer, mask_id, block: int, generator=None, eps=1e-3):
    """The block-diffusion objective of the module docstring: a mask rate per attention block."""
    B, L = ids.shape
    nb = -(-L // block)
    t = (eps + (1 - eps) * torch.rand(B, nb, generator=generator, device=ids.device)).repeat_interleave(block, 1)[:, :L]
    masked = (torch.rand(ids.shape, generator=generator, device=ids.device) < t) & is_answer
    x = torch.where(masked, torch.full_like(ids, mask_id), ids)
    logits = model(x)
    ce = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none")
    ans_len = is_answer.sum(1, keepdim=True).expand_as(ids)[masked].float()
    return (ce / t[masked] / ans_len).sum() / B


def ar_loss(model, prompts, answers, eos, device):
    rows = [p + a + [eos] for p, a in zip(prompts, answers)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), eos, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, len(p): len(r)] = torch.tensor(r[len(p):])
    ids, labels = ids.to(device), labels.to(device)
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def build_model(kind: str, size: str, tok, max_len: int, block: int = 16, fmt: str = "llada"):
    """A freshly initialised model: the dLLM (LLaDA or Dream format), the SDAR-format drafter (reference models
    with scaled normal weights, zero biases) or the Llama-format AR model; with its config."""
    hidden, layers, heads, mlp = SIZES[size]
    ids = dict(mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)
    qwen = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=max_len, tie_word_embeddings=False, **ids)
    cfg = None
    if kind == "drafter":
        from model_executor.models.configs import SDARConfig

        cfg = SDARConfig(block_size=block, head_dim=hidden // heads, architectures=["SDARForCausalLM"], **qwen)
    elif kind == "dllm" and fmt == "dream":
        from model_executor.models.configs import DreamConfig

        cfg = DreamConfig(architectures=["DreamModel"], **qwen)
    elif kind == "dllm":
        from model_executor.models.configs import LLaDAConfig

        cfg = LLaDAConfig(d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=mlp,
                          vocab_size=len(tok), embedding_size=len(tok), rope_theta=10000.0, rms_norm_eps=1e-5,
                          max_sequence_length=max_len, architectures=["LLaDAModelLM"], **ids)
    if cfg is not None:
        from model_executor.models.configs import ArchSpec
        from model_executor.models.reference import ReferenceDLLM

        model = ReferenceDLLM(ArchSpec.from_hf_config(cfg))
        for n, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if n.endswith(("o.weight", "down.weight")) else 1))
            elif n.endswith("bias"):
                torch.nn.init.zeros_(p)
        return model, cfg
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_len,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg), cfg


def save_model(kind, model, cfg, tok, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    if kind in ("dllm", "drafter"):
        from model_executor.models.weights import save_checkpoint

        save_checkpoint(model.spec, model.canonical_state(), out)
        cfg.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def load_train_state(path: Path, device) -> dict:
    """The resume state ``main`` saves (the model's and optimizer's state dicts, the step, the loss log, the wall
    time, the schedule restarts: tensors, dicts, lists, tuples, numbers and strings), read with torch's safe
    unpickler (``weights_only=True``). A full unpickler would run whatever a pickled object asks for as the
    file loads, so a state file from elsewhere could run code; a file holding anything else is refused, naming
    the file, before any of it is used."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's refusal; its own text says to load unsafely: keep only why
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        why = next((x for x in lines if not x.startswith(("Weights only load failed", "Check the documentation"))),
                   lines[0] if lines else type(e).__name__)
        raise SystemExit(f"{path}: refused by the safe loader ({why}); a training state holds only tensors, dicts, "
                         "lists and numbers. Move the file away to train from the start.") from None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="psd train", description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["dllm", "ar", "drafter"], required=True)
    ap.add_argument("--block", type=int, default=16, help="drafter: attention block (SDAR block_size)")
    ap.add_argument("--format", choices=["llada", "dream"], default="llada",
                    help="dllm: the checkpoint format (dream: shifted logits, Qwen2 names; start it from the AR "
                         "model with --init, as Dream was made from Qwen2.5)")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this checkpoint of the same shape: a dLLM (drafter), or the AR model (dllm "
                         "--format dream; its q/k/v biases start at zero)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--gen-len", type=int, default=32, help="answer region (answer + EOS padding), dLLM only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer (default: train one)")
    ap.add_argument("--suffix-windows", type=float, default=0.0,
                    help="dllm: fraction of steps whose answer regions are cut to a random multiple of 8 tokens "
                         "(trains for decoding with the suffix knob; default 0)")
    ap.add_argument("--tasks", default=",".join(ALL_TASKS),
                    help=f"comma-separated tasks to train on (default: all, {','.join(ALL_TASKS)})")
    args = ap.parse_args(argv)
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        ap.error(f"--tasks: {e}")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    exclude = {r["prompt"] for r in load_heldout()}

    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    else:
        stream = training_stream(10**9 + args.seed, exclude, tasks)
        texts = []
        for _ in range(20000):
            e = next(stream)
            texts.append(render_prompt(e.prompt) + e.answer + EOS)
        tok = train_tokenizer(texts, args.out)

    model, cfg = build_model(args.kind, args.size, tok, max_len=512, block=args.block, fmt=args.format)
    if args.init is not None and args.kind == "ar":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(str(args.init), dtype=torch.float32)
        cfg = model.config
    elif args.init is not None:
        from model_executor.models.reference import ReferenceDLLM

        init = ReferenceDLLM.from_pretrained(args.init).state_dict()
        try:
            missing, unexpected = model.load_state_dict(init, strict=False)
        except RuntimeError as e:  # a tensor of another shape
            raise SystemExit(f"--init {args.init}: shapes differ ({str(e).splitlines()[-1].strip()})") from None
        if unexpected or any("norm" not in m and not m.endswith("bias") for m in missing):
            raise SystemExit(f"--init {args.init}: shapes differ (missing {missing}, unexpected {unexpected})")
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)

    def lr_at(s):
        if s < warmup:
            return args.lr * (s + 1) / warmup
        prog = (s - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))

    state_file = args.out / "train_state.pt"
    step, log, wall, resumes = 0, [], 0.0, []
    if state_file.exists():
        st = load_train_state(state_file, device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, log, wall, resumes = st["step"], st["log"], st["wall"], st.get("resumes", [])
        if not resumes or resumes[-1]["steps"] != args.steps:
            # a longer run restarts the cosine schedule over the new total (a warm restart)
            resumes.append({"at_step": step, "steps": args.steps})
        print(f"resumed at step {step}")

    from tqdm import tqdm

    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device=device)
    t0 = time.time() - wall
    tokens = sum(x.get("tokens", 0) for x in log[-1:]) if log else 0
    bar = tqdm(total=args.steps, initial=step, desc=f"train {args.kind}", dynamic_ncols=True)
    model.train()
    ema = None
    while step < args.steps:
        prompts, answers, row_tasks = _batch(step, args.seed, args.batch, tok, exclude, tasks)
        gen.manual_seed(args.seed * 7919 + step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        if args.kind in ("dllm", "drafter"):
            loss = 0.0
            cut = random.Random(args.seed * 104729 + step)  # the step's own draws: a resumed run sees the same
            windows = args.kind == "dllm" and cut.random() < args.suffix_windows
            for region, rows in by_region(row_tasks, args.gen_len):  # one forward each (module docstring)
                if windows:
                    region = cut_regions([len(prompts[i]) for i in rows], region, cut)
                ids, is_answer = _dllm_tensors([prompts[i] for i in rows], [answers[i] for i in rows], region,
                                               tok.eos_token_id, pad_to_multiple=1 if windows else 8)
                ids, is_answer = ids.to(device), is_answer.to(device)
                if args.kind == "dllm":
                    part = dllm_loss(model, ids, is_answer, tok.mask_token_id, gen)
                else:
                    part = drafter_loss(model, ids, is_answer, tok.mask_token_id, args.block, gen)
                loss = loss + part * (len(rows) / len(row_tasks))
                tokens += ids.numel()
        else:
            loss = 0.0
            for _, rows in by_region(row_tasks, 0):  # short rows are not padded to a long row's length
                part = ar_loss(model, [prompts[i] for i in rows], [answers[i] for i in rows], tok.eos_token_id, device)
                loss = loss + part * (len(rows) / len(row_tasks))
            tokens += sum(len(p) + len(a) + 1 for p, a in zip(prompts, answers))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % 50 == 0 or step == args.steps:
            log.append({"step": step, "loss": round(ema, 4), "wall_s": round(time.time() - t0, 1), "tokens": tokens})
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "wall": time.time() - t0, "resumes": resumes}, state_file)
            save_model(args.kind, model, cfg, tok, args.out)
    bar.close()
    stages = []  # what the --init checkpoint went through, from its training record
    if args.init is not None and (args.init / "training.json").exists():
        it = json.loads((args.init / "training.json").read_text())
        stages = it.get("stages", []) + [
            f"earlier stage: {it['steps']} steps of `psd train --kind {it['kind']}`"
            + (f" --format {it['format']}" if it.get("format") else "")
            + (f" --suffix-windows {it['suffix_windows']}" if it.get("suffix_windows") else "")
            + f" on {', '.join(it.get('tasks', []))} (batch {it['batch']}, lr {it['lr']}, "
            f"{it['wall_time_s'] / 60:.0f} min" + (f", from {it['init']}" if it.get("init") else "") + ")"]
    info = {"kind": args.kind, "size": args.size, "parameters": n_params, "steps": step, "batch": args.batch,
            "lr": args.lr, "gen_len": args.gen_len, "format": args.format if args.kind == "dllm" else None,
            "init": str(args.init.name) if args.init else None, "stages": stages, "seed": args.seed, "device": device,
            "wall_time_s": round(time.time() - t0, 1), "tokens_seen": tokens,
            "final_loss": log[-1]["loss"] if log else None, "schedule_restarts": resumes, "tasks": list(tasks),
            **({"suffix_windows": args.suffix_windows} if args.suffix_windows else {}),
            "loss_log": log}
    (args.out / "training.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "loss_log"}))


if __name__ == "__main__":
    main()
