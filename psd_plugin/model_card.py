"""Write an embedded model's card (``README.md`` + ``card.json``): training facts and held-out figures.

``python -m psd_plugin.model_card --model DIR`` evaluates the checkpoint on the whole held-out split with
the reference engine (dLLM: static and confidence tau=0.9; AR: greedy) and writes the figures next to
the training record (``training.json``) that ``psd train`` left there. ``psd eval`` reproduces them. A long
family (256-token answers) is evaluated on its first ``--long-limit`` held-out items (static decoding of 300 of them
takes an hour on this CPU); the card says how many.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .evaluate import evaluate, is_dllm, load
from .train.tasks import ALL_TASKS, HELDOUT_SIZE, LONG_TASKS, SHORT_BUDGET, TASKS, answer_budget, load_heldout

DLLM_RUNS = {"static": {"method": "static"}, "confidence": {"method": "confidence", "threshold": 0.9}}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m psd_plugin.model_card")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--cache", choices=["prefix", "dual"], default="prefix", help="dLLM cache mode")
    ap.add_argument("--long-limit", type=int, default=50, help="held-out items per long family")
    args = ap.parse_args(argv)
    if not 1 <= args.long_limit <= HELDOUT_SIZE:
        ap.error(f"--long-limit must be in 1..{HELDOUT_SIZE}, got {args.long_limit}")
    engine, tok = load(args.model)
    training = json.loads((args.model / "training.json").read_text())
    trained = set(training.get("tasks", TASKS))
    rows = [r for t in ALL_TASKS if t in trained
            for r in load_heldout(t)[: args.long_limit if t in LONG_TASKS else HELDOUT_SIZE]]
    training.pop("loss_log", None)
    dllm = is_dllm(args.model)
    evals = {}
    if dllm:
        for name, kw in DLLM_RUNS.items():
            evals[name] = evaluate(engine, tok, rows, max_tokens=args.max_tokens, block_size=args.block_size,
                                   cache=args.cache, **kw)
            print(name, json.dumps(evals[name]))
    else:
        evals["greedy"] = evaluate(engine, tok, rows, max_tokens=args.max_tokens)
        print("greedy", json.dumps(evals["greedy"]))
    for r in evals.values():
        short = [r["accuracy"][t] for t in TASKS if t in r["accuracy"]]
        r["short_mean_accuracy"] = round(sum(short) / max(1, len(short)), 4)
    card = {"training": training, "eval": {"max_tokens": args.max_tokens, "long_items": args.long_limit,
                                           "block_size": args.block_size if dllm else None,
                                           "cache": args.cache if dllm else None, "dtype": "float32",
                                           "engine": "reference", "results": evals}}
    (args.model / "card.json").write_text(json.dumps(card, indent=1))
    (args.model / "README.md").write_text(render(args.model.name, dllm, training, card["eval"]))


FORMATS = {"llada": "LLaDA (`model_type: llada`, `LLaDAModelLM`)",
           "dream": "Dream (`model_type: Dream`, `DreamModel`: Qwen2 tensor names, shifted predictions)",
           None: "Llama (`LlamaForCausalLM`)"}


def _mix(drawn: list[str]) -> str:
    """How the training stream mixed the tasks: ``--tasks`` may name a task several times (its weight)."""
    heavy = {x: drawn.count(x) for x in dict.fromkeys(drawn) if drawn.count(x) > 1}
    if not heavy:
        return "uniformly mixed"
    return "mixed by weight (" + ", ".join(f"{x} {k} of {len(drawn)} draws" for x, k in heavy.items()) + ")"


def render(name: str, dllm: bool, t: dict, ev: dict) -> str:
    fmt = FORMATS[(t.get("format") or "llada") if dllm else None]
    tasks = [x for x in ALL_TASKS if x in t.get("tasks", TASKS)]
    budgets = ", ".join(f"{'the long ones' if b > SHORT_BUDGET else 'the short tasks'} to {b}"
                        for b in sorted({answer_budget(x) for x in tasks}))
    obj = (f"LLaDA SFT objective: answer tokens (answer + EOS padding: {budgets}) masked with probability "
           "t ~ U(0,1], cross-entropy on masked positions weighted by 1/t"
           + ("; each position predicted from the output before it (Dream's shift)" if t.get("format") == "dream"
              else "")
           + (f"; in {t['suffix_windows']:.0%} of the steps the answer regions cut to a random multiple of 8 tokens "
              "(`--suffix-windows`: trained for decoding with the `suffix` knob)" if t.get("suffix_windows") else "")
           if dllm else "next-token cross-entropy on answer + EOS")
    long = [x for x in tasks if x in LONG_TASKS]
    stages = t.get("stages", [])
    lines = [f"# {name}", "",
             f"A {t['parameters'] / 1e6:.2f}M-parameter {'masked-diffusion' if dllm else 'autoregressive'} model in the "
             f"{fmt} checkpoint format, trained by psd-plugin (`psd train --kind {t['kind']}`) on its generated task "
             "corpus. It exists so that decoding methods can be measured on a model whose confidences mean something; "
             "it is not a general language model.", "",
             "## Training", "",
             f"- data: {len(tasks)} generated tasks ({', '.join(tasks)}"
             + (f"; long answers: {', '.join(long)}" if long else "")
             + f"), {_mix(t.get('tasks', TASKS))}, chat template applied; the {HELDOUT_SIZE}-item-per-task held-out split never seen",
             *(f"- {s}" for s in stages),
             *([f"- initialised from `{t['init']}`"] if t.get("init") else []),
             f"- objective: {obj}",
             f"- steps {t['steps']}, batch {t['batch']}, peak lr {t['lr']}, seed {t['seed']}, "
             f"{t['tokens_seen'] / 1e6:.1f}M tokens, device {t['device']}",
             f"- wall time {t['wall_time_s'] / 60:.1f} min, final loss (EMA) {t['final_loss']}"
             + ("".join(f"; schedule restarted at step {r['at_step']} (cosine over {r['steps']} steps)"
                        for r in t.get("schedule_restarts", []))), "",
             f"## Held-out accuracy (reference engine, float32, max_tokens {ev['max_tokens']}"
             + (f", long tasks {max(answer_budget(x) for x in long)} on their first {ev.get('long_items', HELDOUT_SIZE)}"
                " items" if long else "")
             + (f", block {ev['block_size']}, {ev.get('cache') or 'prefix'} cache)" if dllm else ")"), "",
             "| method | " + " | ".join(tasks) + " | mean" + (" (short)" if long else "") + " | "
             + ("mean (all) | " if long else "") + "TPF | NFE/sample |",
             "|---" * (len(tasks) + 4 + bool(long)) + "|"]
    for m, r in ev["results"].items():
        label = {"confidence": "confidence τ=0.9"}.get(m, m)
        lines.append(f"| {label} | " + " | ".join(f"{100 * r['accuracy'][k]:.1f}" for k in tasks)
                     + f" | {100 * r.get('short_mean_accuracy', r['mean_accuracy']):.1f} | "
                     + (f"{100 * r['mean_accuracy']:.1f} | " if long else "")
                     + f"{r['tpf']:.2f} | {r['nfe_per_sample']:.1f} |")
    if long:
        lines += ["", "TPF per long family: " + "; ".join(
            f"`{x}` " + ", ".join(f"{r['tpf_by_task'][x]:.2f} ({m})" for m, r in ev["results"].items()
                                  if x in r.get("tpf_by_task", {}))
            for x in long) + "."]
    cmd = ("`psd eval --model PATH --method static` (and `--method confidence`)" if dllm
           else "`psd eval --model PATH --method ar`")
    lines += ["", f"Reproduce: {cmd}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
