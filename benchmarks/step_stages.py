"""Where a step's host time goes, stage by stage, for vLLM's AR step and the plugin's dLLM step in the same run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_stages.py [--repeat 2] [--concurrency 1,16,64] \
        [--methods confidence,psd,lopa,spiffy,freedave] [--caches prefix,dual] [--out benchmarks/results]

AR is ``ar-tiny`` through plain vLLM (greedy); the dLLM is ``dream-tiny`` through ``--speculative-config
'{"method": "psd", ...}'`` (block 8), each method with the prefix and the dual cache; every engine in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core, scheduler and runner run in the caller's
thread, so every stage is timed where it runs), one engine at a time. The same held-out prompts, float32,
``--max-tokens`` new tokens (``--ignore-eos``: every request decodes all of them, for steady steps; else each
stops at its EOS, as served), decoded in waves of ``c`` concurrent requests (a wave finishes before the next
starts), for each ``c``.

Each stage is a function of vLLM or the plugin wrapped with a timer (:data:`STAGES`); a stage's time is
exclusive (what a timed function inside it takes is that function's stage), so the stages of a step add up to
the step's wall time (``LLMEngine.step``: schedule, execute, sample, propose, the engine core's and the front
end's output processing). *device* stages are the model's forward and its logits, the only work a GPU would do;
everything else is *host* time, which on a GPU the device waits on unless it overlaps. Per-request costs (the
front end's input processing at ``add_request``) are kept apart: they are paid once per request, not per step.
*Engine-core host* time leaves out the front end's output processing too (detokenizing and building each
request's output: per emitted token, so a dLLM step that emits a block pays it for every token of it): served
(``vllm serve``, or ``LLM`` with vLLM's default multiprocessing) it runs in the front end's process, beside the
engine core's next step, not before it.

Figures are wall-clock on this CPU: the forward is synchronous here, so host and device times add; a GPU would
need the forward timed with events (``benchmarks/vllm_gpu_timing.py``). Host ms per step is compared with AR's
in the same repeat at the same concurrency (``host / AR``); ``--repeat`` gives the spread. Writes
``step_stages.json`` / ``.md`` / ``.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this thread: every stage timed in place
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import method_knobs  # noqa: E402  (sets vLLM's environment)

# (module, class or None for a module function, attribute, stage, kind): kind "device" is the model's work, the
# rest host work; "front" stages are per request and left out of the step's time.
STAGES = [
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step", "engine loop", "host"),
    ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request", "front end: input processing (per request)", "front"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs", "front end: output processing", "host"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "vLLM: scheduler", "host"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "get_grammar_bitmask", "vLLM: scheduler", "host"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "vLLM: engine-core output processing", "host"),
    ("psd_plugin.vllm.scheduler", "DLLMScheduler", "schedule", "plugin: scheduling hook", "host"),
    ("psd_plugin.vllm.scheduler", "DLLMScheduler", "update_draft_token_ids", "plugin: scheduling hook", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "vLLM: runner (rest)", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states", "vLLM: batch state", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "vLLM: input preparation", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_preprocess", "vLLM: input preparation", "host"),
    ("psd_plugin.vllm.dllm_runner", "DLLMRunnerMixin", "_prepare_inputs", "plugin: input preparation", "host"),
    ("psd_plugin.vllm.runner", "PSDRunnerMixin", "_preprocess", "plugin: input preparation", "host"),
    ("psd_plugin.vllm.dllm_runner", None, "build_step_batch", "plugin: step building", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata", "attention planning", "host"),
    ("attention_backends.vllm_backend", "PSDMetadataBuilder", "build", "attention planning", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "forward", "device"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor", "forward", "logits", "device"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "vLLM: sampling (rest)", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample", "vLLM: sampler", "host"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync", "vLLM: bookkeeping", "host"),
    ("psd_plugin.vllm.dllm_runner", "DLLMRunnerMixin", "_sample", "plugin: decode (rest)", "host"),
    ("model_executor.dllm_request", None, "decode_step", "plugin: decode (rest)", "host"),
    ("model_executor.dllm_request", None, "step_predictions", "plugin: predictions + read-back", "host"),
    ("model_executor.dllm_request", None, "update_all", "plugin: decoder update", "host"),
    ("model_executor.dllm_request", None, "record_logprobs", "plugin: logprobs", "host"),
    ("psd_plugin.vllm.dllm_runner", "DLLMRunnerMixin", "_stepped", "plugin: commit", "host"),
    ("psd_plugin.vllm.dllm_runner", "DLLMRunnerMixin", "propose_draft_token_ids", "plugin: proposal", "host"),
    ("psd_plugin.vllm.dllm_runner", None, "propose_all", "plugin: proposal", "host"),
]
KIND = {stage: kind for *_, stage, kind in STAGES}
FRONT_OUTPUT = "front end: output processing"  # per emitted token, in the front end's process when served
# whose host work a stage is: the plugin's stages are named "plugin: ..." and attention planning (the project's
# metadata builder, with vLLM's call into it, AR's attention metadata too); every other host stage is vLLM's
PLUGIN_STAGES = {stage for *_, stage, kind in STAGES if kind == "host"
                 and (stage.startswith("plugin:") or stage == "attention planning")}


def owner_split(rows: list[dict]) -> None:
    """Each row's host ms per step split into vLLM's stages and the plugin's, each as a share of AR's whole host
    ms per step in the same run (tree, repeat) and concurrency: ``vllm_vs_ar`` and ``plugin_vs_ar``."""
    for r in rows:
        ar = next((a for a in rows if a["method"] == "ar" and a.get("tree") == r.get("tree")
                   and a["repeat"] == r["repeat"] and a["concurrency"] == r["concurrency"]), None)
        if ar is None:
            continue
        host = {st: v for st, v in r["stages_ms"].items() if KIND.get(st) == "host"}
        plugin = sum(v for st, v in host.items() if st in PLUGIN_STAGES)
        r["vllm_vs_ar"] = (sum(host.values()) - plugin) / ar["host_ms"]
        r["plugin_vs_ar"] = plugin / ar["host_ms"]


class StageClock:
    """Exclusive wall time per stage: a wrapped call's time less that of the wrapped calls it makes."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.steps = 0  # engine-core steps that ran the model
        self._local = threading.local()

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def wrap(self, fn, stage: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = stack.pop()
                self.seconds[stage] += dt - inner
                if stack:
                    stack[-1] += dt

        timed.__wrapped_stage__ = stage
        return timed

    def _counted(self, step):
        def counted(core, *args, **kwargs):
            out = step(core, *args, **kwargs)
            self.steps += bool(out[1])
            return out

        counted.__counted__ = True
        return counted

    def install(self) -> list[str]:
        """Wrap every stage of :data:`STAGES` (each once: on the class that defines it); returns what is missing."""
        missing = []
        for module, cls, attr, stage, _ in STAGES:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            fn = owner.__dict__.get(attr) if cls else getattr(owner, attr, None)
            if fn is None:
                missing.append(f"{module}.{cls + '.' if cls else ''}{attr}")
                continue
            if not hasattr(fn, "__wrapped_stage__"):
                setattr(owner, attr, self.wrap(fn, stage))
        from vllm.v1.engine.core import EngineCore

        # the engine core's step (``step_with_batch_queue`` under async scheduling): the steps that ran the model
        for name in ("step", "step_with_batch_queue"):
            step = getattr(EngineCore, name)
            if not hasattr(step, "__counted__"):
                setattr(EngineCore, name, self._counted(step))
        return missing


def trace_step(generate, prompts: list[list[int]]) -> dict:
    """The calls one request's decoding makes into the project's code, counted with ``sys.setprofile`` (the
    measured hop counts of docs/architecture.md): per engine step, the entries from vLLM into the project
    (a call whose caller is outside the project), the calls inside the project, and the project files and
    functions they touch."""
    own = tuple(str(ROOT / d) for d in ("psd_plugin", "model_executor", "attention_backends"))
    entries, internal, files, funcs = collections.Counter(), 0, set(), set()
    steps0 = CLOCK.steps

    def profile(frame, event, arg):
        nonlocal internal
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(own):
            return
        back = frame.f_back
        while back is not None and back.f_code.co_filename == __file__:  # this module's timers are transparent
            back = back.f_back
        caller = back.f_code.co_filename if back is not None else ""
        rel = os.path.relpath(f, ROOT)
        files.add(rel)
        funcs.add(f"{rel}:{frame.f_code.co_name}")
        if caller.startswith(own):
            internal += 1
        else:
            entries[f"{rel}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        generate(prompts[:1])
    finally:
        sys.setprofile(None)
    steps = max(1, CLOCK.steps - steps0)
    return {"steps": steps, "entries_per_step": sum(entries.values()) / steps,
            "internal_calls_per_step": internal / steps, "files": len(files), "functions": len(funcs),
            "entry_points": sorted(entries)}


CLOCK = StageClock()


def held_out_prompts(limit: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    return [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[:limit]]


def measure(clock: StageClock, generate, prompts: list[list[int]], c: int, waves: int) -> dict:
    """Decode ``waves`` waves of ``c`` requests (after one untimed wave); per-step stage times and counts."""
    generate(prompts[:c])
    clock.reset()
    tokens, t0 = 0, time.perf_counter()
    for w in range(waves):
        batch = [prompts[(w * c + i) % len(prompts)] for i in range(c)]
        tokens += generate(batch)
    wall = time.perf_counter() - t0
    sec, steps, requests = dict(clock.seconds), clock.steps, waves * c
    per_step = {s: 1e3 * v / steps for s, v in sec.items() if KIND.get(s) != "front"}
    device = sum(v for s, v in per_step.items() if KIND[s] == "device")
    step_ms = sum(per_step.values())
    # the engine core's host time: served (``vllm serve``, or ``LLM`` with vLLM's default multiprocessing) the
    # front end's output processing runs in another process, beside the engine core's next step
    core = step_ms - device - per_step.get(FRONT_OUTPUT, 0.0)
    return {"concurrency": c, "requests": requests, "steps": steps, "tokens": tokens, "wall_s": wall,
            "step_ms": step_ms, "device_ms": device, "host_ms": step_ms - device, "core_host_ms": core,
            "front_ms_per_request": 1e3 * sum(v for s, v in sec.items() if KIND.get(s) == "front") / requests,
            "stages_ms": per_step, "tokens_per_step": tokens / steps}


def ar_engine(max_num_seqs: int, ignore_eos: bool, max_tokens: int):
    from vllm import LLM, SamplingParams

    from psd_plugin import DEFAULT_AR

    llm = LLM(model=str(DEFAULT_AR), dtype="float32", max_model_len=512, max_num_seqs=max_num_seqs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return llm, generate


def dllm_engine(method: str, cache: str, max_num_seqs: int, ignore_eos: bool, max_tokens: int):
    """The dLLM engine of ``method`` (``METHOD+async``: with ``async_scheduling``; ``METHOD+ahead``: and
    ``decide_ahead`` on, a step laid out before the last one's host decode)."""
    from psd_plugin.vllm.engine import VLLMEngine

    model = ROOT / "psd_plugin" / "checkpoints" / "dream-tiny"
    engine = VLLMEngine(model, max_num_seqs=max_num_seqs, max_model_len=512)
    method, _, mode = method.partition("+")
    knobs = {**method_knobs(method, model, "vLLM"), **({"async_scheduling": True} if mode == "async" else {}),
             **({"async_scheduling": True, "decide_ahead": "on"} if mode == "ahead" else {})}

    def generate(batch):
        res = engine.generate(batch, max_tokens=max_tokens, block_size=8, method=method, cache=cache,
                              ignore_eos=ignore_eos, **knobs)
        return sum(len(r.token_ids) for r in res)

    return engine, generate


def merge(paths: list[str], out: Path, name: str) -> None:
    """One report of several runs (``--merge TREE=FILE,...``: each run's JSON with the tree it measured, e.g. the
    commit before a change and after it, run alternately): host ms per step and its ratio to AR's in the same
    run, per tree, with the spread over its runs; the stage tables of the last tree."""
    rows, traces = [], {}
    for item in paths:
        tree, path = item.split("=", 1)
        data = json.loads(Path(path).read_text())
        run = len({r["tree"] + str(r["repeat"]) for r in rows if r["tree"] == tree})
        for r in data["rows"]:
            rows.append({**r, "tree": tree, "repeat": run})
        traces.update({f"{tree}: {k}": t for k, t in data.get("traces", {}).items()})
    owner_split(rows)
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    keys = sorted({(r["method"], r["cache"] or "", r["concurrency"]) for r in rows},
                  key=lambda k: (k[0] != "ar", k[0], k[1], k[2]))
    head = "| method | cache | c | " + " | ".join(f"{t}: host ms | {t}: host / AR | {t}: engine-core host / AR"
                                                 for t in trees) + " |"
    lines = [head, "|---|---|---|" + "---|---|---|" * len(trees)]
    for m, cache, c in keys:
        cells = []
        for t in trees:
            rs = [r for r in rows if r["tree"] == t and (r["method"], r["cache"] or "", r["concurrency"]) == (m, cache, c)]
            cells.append(f"{_spread([r['host_ms'] for r in rs])} | {_spread([r['host_vs_ar'] for r in rs])} | "
                         f"{_spread([r['core_vs_ar'] for r in rs if 'core_vs_ar' in r] or [float('nan')])}")
        lines.append(f"| {m} | {cache or '-'} | {c} | " + " | ".join(cells) + " |")
    last = [r for r in rows if r["tree"] == trees[-1]]
    text = "\n".join(lines) + "\n\n" + f"Tree {trees[-1]}:\n\n" + report(last, {k: v for k, v in traces.items()
                                                                                if k.startswith(trees[-1])})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"rows": rows, "traces": traces}, indent=1))
    (out / f"{name}.md").write_text(text)
    plot(last, out / f"{name}.png")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency (at least one wave)")
    ap.add_argument("--methods", default="confidence,psd,lopa,spiffy,freedave")
    ap.add_argument("--caches", default="prefix,dual")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="step_stages")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="each dLLM config again with speculative_config async_scheduling (METHOD+async)")
    ap.add_argument("--decide-ahead", action="store_true",
                    help="each dLLM config again with async_scheduling and decide_ahead on (METHOD+ahead)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request decodes --max-tokens (steady steps); default: each stops at its EOS, as served")
    ap.add_argument("--merge", help="TREE=FILE,...: merge runs' JSON files into one report (nothing is run)")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge.split(","), args.out, args.name)

    clock = CLOCK
    missing = clock.install()
    if missing:
        print("not timed (not in this vLLM / plugin):", ", ".join(missing))
    prompts = held_out_prompts(16)
    concurrency = [int(x) for x in args.concurrency.split(",")]
    modes = [""] + (["+async"] if args.async_scheduling else []) + (["+ahead"] if args.decide_ahead else [])
    configs = [("ar", None)] + [(m + a, c) for m in args.methods.split(",") for c in args.caches.split(",")
                                for a in modes]
    rows, traces = [], {}
    for rep in range(args.repeat):
        for method, cache in configs:
            engine, generate = (ar_engine(max(concurrency), args.ignore_eos, args.max_tokens) if method == "ar"
                                else dllm_engine(method, cache, max(concurrency), args.ignore_eos, args.max_tokens))
            try:
                for c in concurrency:
                    before = engine.step_time() if method != "ar" else {}
                    r = measure(clock, generate, prompts, c, max(1, args.requests // c))
                    r.update(engine="AR" if method == "ar" else "dLLM", method=method, cache=cache, repeat=rep)
                    if method != "ar":  # the runner's own counts (the warm-up wave included): forwards run, steps
                        after = engine.step_time()  # decoded at the next step's start, steps laid out ahead
                        r["runner"] = {k: after.get(k, 0) - before.get(k, 0)
                                       for k in ("forwards", "skipped_forwards", "cut_steps", "deferred", "ahead",
                                                 "ahead_planned", "ahead_rebatched", "ahead_left",
                                                 "ahead_idle_canvases", "ahead_mismatch")}
                    rows.append(r)
                    print(f"rep {rep} {method:<10} {cache or '':<6} c={c:<3} {r['steps']:4d} steps  step "
                          f"{r['step_ms']:6.2f} ms  device {r['device_ms']:6.2f}  host {r['host_ms']:6.2f}  "
                          f"front {r['front_ms_per_request']:.2f} ms/request  {r['tokens_per_step']:.2f} tok/step"
                          + (f"  runner {r['runner']}" if "runner" in r else ""), flush=True)
                if rep == 0:  # warm: no compilation in the trace
                    traces[(method, cache)] = trace_step(generate, prompts)
            finally:
                (engine.close() if method != "ar" else _shutdown(engine))
    for r in rows:
        ar = next(a for a in rows if a["method"] == "ar" and a["repeat"] == r["repeat"]
                  and a["concurrency"] == r["concurrency"])
        r["host_vs_ar"] = r["host_ms"] / ar["host_ms"]
        r["core_vs_ar"] = r["core_host_ms"] / ar["core_host_ms"]
    owner_split(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    traces = {f"{m}/{c}" if c else m: t for (m, c), t in traces.items()}
    (args.out / f"{args.name}.json").write_text(json.dumps({"rows": rows, "not_timed": missing, "traces": traces,
                                                            "ignore_eos": args.ignore_eos,
                                                            "max_tokens": args.max_tokens}, indent=1))
    (args.out / f"{args.name}.md").write_text(report(rows, traces))
    plot(rows, args.out / f"{args.name}.png")
    print(report(rows, traces))


def _shutdown(llm) -> None:
    from psd_plugin.vllm import compat

    compat.shutdown(llm)


def _spread(vals: list[float], fmt: str = "{:.2f}") -> str:
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if len(vals) == 1 or fmt.format(lo) == fmt.format(hi) else \
        f"{fmt.format(lo)}–{fmt.format(hi)}"


def report(rows: list[dict], traces: dict) -> str:
    """Two tables: host ms per step against AR's (ranges over the repeats), and the stages of each config's
    step (ms per step, the first repeat... the mean over repeats)."""
    keys = sorted({(r["method"], r["cache"] or "", r["concurrency"]) for r in rows},
                  key=lambda k: (k[0] != "ar", k[0], k[1], k[2]))
    out = ["| method | cache | concurrency | steps | tokens / step | step ms | device ms | host ms | host / AR | "
           "engine-core host ms | engine-core host / AR | front end ms / request |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, cache, c in keys:
        rs = [r for r in rows if (r["method"], r["cache"] or "", r["concurrency"]) == (m, cache, c)]
        out.append(f"| {m} | {cache or '-'} | {c} | {rs[0]['steps']} | {rs[0]['tokens_per_step']:.2f} | "
                   f"{_spread([r['step_ms'] for r in rs])} | {_spread([r['device_ms'] for r in rs])} | "
                   f"{_spread([r['host_ms'] for r in rs])} | {_spread([r['host_vs_ar'] for r in rs])} | "
                   f"{_spread([r.get('core_host_ms', float('nan')) for r in rs])} | "
                   f"{_spread([r.get('core_vs_ar', float('nan')) for r in rs])} | "
                   f"{_spread([r['front_ms_per_request'] for r in rs])} |")
    stages = [s for s in dict.fromkeys(st for *_, st, k in STAGES if k != "front")
              if any(r["stages_ms"].get(s) for r in rows)]
    out += ["", "Host stages, ms per step (mean over repeats):", "",
            "| method | cache | c | " + " | ".join(stages) + " |", "|---|---|---|" + "---|" * len(stages)]
    for m, cache, c in keys:
        rs = [r for r in rows if (r["method"], r["cache"] or "", r["concurrency"]) == (m, cache, c)]
        out.append(f"| {m} | {cache or '-'} | {c} | " + " | ".join(
            f"{sum(r['stages_ms'].get(s, 0.0) for r in rs) / len(rs):.2f}" for s in stages) + " |")
    if any("vllm_vs_ar" in r for r in rows):
        out += ["", "Whose host time: vLLM's stages and the plugin's (attention planning counted as the plugin's), "
                "each ÷ AR's whole host ms per step in the same run:", "",
                "| method | cache | c | vLLM's stages / AR's host step | the plugin's stages / AR's host step |",
                "|---|---|---|---|---|"]
        for m, cache, c in keys:
            rs = [r for r in rows if (r["method"], r["cache"] or "", r["concurrency"]) == (m, cache, c)
                  and "vllm_vs_ar" in r]
            if rs:
                out.append(f"| {m} | {cache or '-'} | {c} | {_spread([r['vllm_vs_ar'] for r in rs])} | "
                           f"{_spread([r['plugin_vs_ar'] for r in rs])} |")
    out += ["", "Calls into the project's code per engine step, one request (``sys.setprofile``):", "",
            "| config | steps | entries from vLLM / step | calls inside the project / step | files | functions |",
            "|---|---|---|---|---|---|"]
    out += [f"| {k} | {t['steps']} | {t['entries_per_step']:.1f} | {t['internal_calls_per_step']:.0f} | {t['files']} | "
            f"{t['functions']} |" for k, t in traces.items()]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Stacked bars: host ms per step by stage (device stages apart), per config, one panel per concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    conc = sorted({r["concurrency"] for r in rows})
    stages = [s for s in dict.fromkeys(st for *_, st, k in STAGES if k == "host")
              if any(r["stages_ms"].get(s) for r in rows)]
    fig, axes = plt.subplots(1, len(conc), figsize=(6 * len(conc), 5), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, c in zip(axes[0], conc):
        keys = list(dict.fromkeys((r["method"], r["cache"] or "") for r in rows if r["concurrency"] == c))
        bottom = [0.0] * len(keys)
        for j, s in enumerate(stages):
            vals = []
            for k in keys:
                rs = [r for r in rows if r["concurrency"] == c and (r["method"], r["cache"] or "") == k]
                vals.append(sum(r["stages_ms"].get(s, 0.0) for r in rs) / len(rs))
            ax.bar(range(len(keys)), vals, bottom=bottom, color=cmap(j % 20), label=s)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(keys)), [f"{m}\n{cache}" if cache else m for m, cache in keys], fontsize=7)
        ax.set_title(f"host ms per step, {c} concurrent request(s)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
