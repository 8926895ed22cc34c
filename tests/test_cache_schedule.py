"""The cache schedules of bidirectional models in the reference engine (:mod:`model_executor.block_schedule`):
DualCache (``cache="dual"``, Fast-dLLM) and the narrower steps (``suffix``, ``refresh``). A plain dense
implementation of each rule gives the same tokens and forwards, the lossless methods stay token-identical to
their base policy, every step fits the rows the front end reserves for it, and bad combinations are refused.

DualCache: a block's first step forwards the whole sequence and keeps every position's K/V; its later steps
forward the block alone (from ``b0 - 1`` for Dream's shifted logits) and attend to the kept K/V before and
after it. The dense version below computes the rules with whole-tensor attention per layer, one prompt at a
time; the engine does it batched over requests, on the paged cache, through the attention backend.
"""

import pytest
import torch
import torch.nn.functional as F

from model_executor.engine import ReferenceEngine
from psd_plugin import DEFAULT_DLLM

from oracles.decoders import make_oracle


def _dense_forward(model, ids, positions, kept=None, keys_at=None):
    """Outputs of ``ids`` at ``positions``; each layer's rows attend to themselves and, when given, to the
    ``kept`` per-layer K/V ``[Hkv, N, D]`` at the positions ``keys_at`` of it. Returns (outputs, per-layer K/V)."""
    x = model.embed(ids)[None]
    cos, sin = model._rope(positions[None], x.dtype)
    kvs = []
    for i, layer in enumerate(model.layers):
        q, k, v = (t.transpose(1, 2) for t in layer._qkv(x, cos, sin))  # [1, H, L, D]
        kvs.append((k[0], v[0]))
        if kept is not None:
            kk, vv = kept[i]
            k = torch.cat([kk[:, keys_at][None], k], 2)
            v = torch.cat([vv[:, keys_at][None], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])
        x = layer._rest(x, a.transpose(1, 2).flatten(2))
    return model._head(x)[0], kvs


@torch.no_grad()
def _dense_schedule(model, prompt, max_tokens, block_size, method, cache="dual", suffix=None, refresh="full", **knobs):
    """One prompt decoded with the prefix or dual cache rule, dense; returns (answer up to the first EOS, NFE).

    A dense K/V cache holds, per position, the K/V the state canvas's rows last wrote there. A block's first step
    forwards ``[w0, end)``: ``w0`` is 0 (``refresh`` ``full``, and the first block), the prompt's last position
    fed to the block (``answer``: ``P - shift``) or the previous block's (``last``); ``end`` is the end of the
    answer region, or ``suffix`` positions after the block. A later step forwards the block (from ``b0 - shift``)
    and, under ``prefix``, the masks up to ``end``; under ``dual`` it reads those masks' K/V from the cache."""
    spec = model.spec
    shift, mask, eos = int(spec.shift_logits), spec.mask_token_id, spec.eos_token_id
    P = len(prompt)
    tokens = torch.tensor(prompt + [mask] * max_tokens)
    total, nfe, prev = tokens.numel(), 0, None
    kv = None  # per layer (K, V) [Hkv, total, D]
    for b0 in range(P, total, block_size):
        b1 = min(b0 + block_size, total)
        end = total if suffix is None else min(total, b1 + suffix)
        dec = make_oracle(method, tokens[b0:b1], mask, **knobs)  # the method on one block, as its paper states it
        fresh = True
        while not dec.done:
            canvases = dec.canvases()
            if fresh:
                w0 = 0 if prev is None or refresh == "full" else (P if refresh == "answer" else prev) - shift
                w1, keys_at = end, torch.arange(w0)
            else:
                w0 = b0 - shift
                w1 = end if cache == "prefix" else b1
                keys_at = torch.cat([torch.arange(w0), torch.arange(w1, end)])
            outs = []
            for j, c in enumerate(canvases):
                seq = tokens.clone()
                seq[b0:b1] = c
                out, new = _dense_forward(model, seq[w0:w1], torch.arange(w0, w1), kv, keys_at)
                outs.append(out[b0 - shift - w0: b1 - shift - w0])
                if j == 0:  # the state canvas's rows write their K/V (vLLM's scheduled rows)
                    if kv is None:
                        kv = [tuple(torch.zeros(k.shape[0], total, k.shape[2], dtype=k.dtype) for _ in "kv")
                              for k, _ in new]
                    for (K, V), (k, v) in zip(kv, new):
                        K[:, w0:w1], V[:, w0:w1] = k, v
            dec.update(outs)
            nfe += 1
            fresh = False
        tokens[b0:b1] = dec.state
        prev = b0
        if eos in dec.state.tolist():
            break
    gen = tokens[P:].tolist()
    return (gen[: gen.index(eos) + 1] if eos in gen else [t for t in gen if t != mask]), nfe


def _prompts(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (2, 7, 13, 20)]


def _knobs(method):
    return {"threshold": 0.02} if method == "confidence" else {"branches": 2, "policy": "static"} \
        if method == "lopa" else {}


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("method", ["static", "confidence", "lopa"])
def test_engine_equals_a_dense_implementation(tiny_checkpoints, family, method):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    prompts, knobs = _prompts(), _knobs(method)
    got = eng.generate(prompts, max_tokens=19, block_size=6, method=method, cache="dual", **knobs)
    prefix = eng.generate(prompts, max_tokens=19, block_size=6, method=method, cache="prefix", **knobs)
    for p, r in zip(prompts, got):
        want, nfe = _dense_schedule(eng.model, p, 19, 6, method, **knobs)
        assert r.token_ids == want and r.nfe == nfe, (family, method, p)
    if family == "llada":  # the kept suffix is stale K/V: here the rule decodes differently from the prefix cache
        assert [r.token_ids for r in got] != [r.token_ids for r in prefix]


@pytest.mark.parametrize("schedule", [{"cache": "dual"}, {"cache": "prefix", "suffix": 4, "refresh": "last"},
                                      {"cache": "dual", "suffix": 6, "refresh": "answer"}])
@pytest.mark.parametrize("policy", ["static", "confidence"])
def test_freedave_and_spiffy_stay_lossless(engine64, mixed_prompts, policy, schedule):
    """Every canvas of a step sees the same kept K/V, so a draft equal to a state the base policy reaches gets
    that state's prediction (Spiffy's appendix A.2): FreeDave and Spiffy reproduce their base policy, under the
    dual cache and the narrower steps alike."""
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    base = engine64.generate(mixed_prompts, method=policy, **schedule)
    spiffy = engine64.generate(mixed_prompts, method="spiffy", policy=policy, budget=3,
                               graph=load_graph(default_graph(DEFAULT_DLLM, policy)), **schedule)
    assert [r.token_ids for r in spiffy] == [r.token_ids for r in base]
    assert sum(r.nfe for r in spiffy) < sum(r.nfe for r in base)
    if policy == "static":
        freedave = engine64.generate(mixed_prompts, method="freedave", steps=4, **schedule)
        assert [r.token_ids for r in freedave] == [r.token_ids for r in base]
        assert sum(r.nfe for r in freedave) < sum(r.nfe for r in base)


def test_dual_is_refused_for_sdar(tiny_checkpoints):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["sdar"])
    with pytest.raises(ValueError, match="cache 'dual' is for bidirectional models; a block-causal sdar model allows: none, block"):
        eng.generate([[1, 2, 3]], block_size=4, cache="dual")


NARROW = [("prefix", 3, "full"), ("prefix", None, "answer"), ("prefix", 4, "last"), ("dual", 2, "last"),
          ("dual", None, "answer"), ("prefix", 0, "last")]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("method", ["static", "confidence", "lopa"])
def test_narrow_steps_equal_a_dense_implementation(tiny_checkpoints, family, method):
    """``suffix`` and ``refresh`` (approximations: fewer rows a forward) decode as their rule says, and change the
    output (so the rule is what ran)."""
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    prompts, knobs = _prompts(), _knobs(method)
    exact = [r.token_ids for r in eng.generate(prompts, max_tokens=19, block_size=6, method=method, **knobs)]
    changed = 0
    for cache, suffix, refresh in NARROW:
        got = eng.generate(prompts, max_tokens=19, block_size=6, method=method, cache=cache, suffix=suffix,
                           refresh=refresh, **knobs)
        for p, r in zip(prompts, got):
            want, nfe = _dense_schedule(eng.model, p, 19, 6, method, cache, suffix, refresh, **knobs)
            assert r.token_ids == want and r.nfe == nfe, (family, method, cache, suffix, refresh, p)
        changed += [r.token_ids for r in got] != exact
    assert changed >= len(NARROW) // 2, f"only {changed} of the narrow schedules changed an output"


@pytest.mark.parametrize("cache, suffix, refresh", [("none", None, "full"), ("none", 5, "full"),
                                                    ("prefix", None, "full"), *NARROW, ("dual", 0, "full")])
@pytest.mark.parametrize("method", ["confidence", "psd", "lopa", "psd-skip"])
def test_every_step_fits_the_rows_reserved_for_it(monkeypatch, tiny_checkpoints, method, cache, suffix, refresh):
    """:meth:`DecodeConfig.step_rows` (what vLLM's front end checks against a step's token budget) bounds the rows
    of every step the request takes, over all its canvases."""
    from model_executor.decode_config import DecodeKnobs, resolve
    from model_executor.dllm_request import DLLMRequest

    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["dream"])
    shape = "skip" if method == "psd-skip" else "chain"  # skip: 6 drafts at depth 3, each a full window
    knobs = DecodeKnobs(cache=cache, suffix=suffix, refresh=refresh, threshold=0.02, policy="static", dag_shape=shape)
    cfg = resolve(method.removesuffix("-skip"), knobs, eng.spec, block_size=4)
    seen: dict = {}
    plan = DLLMRequest.plan
    monkeypatch.setattr(DLLMRequest, "plan", lambda self, p: seen.setdefault(id(self), [self]).append(
        plan(self, p).tokens.numel()) or self.step)
    prompts = _prompts(5)
    eng.generate(prompts, max_tokens=23, config=cfg)
    assert len(seen) == len(prompts)
    for req, *rows in seen.values():
        assert max(rows) <= cfg.step_rows(req.prompt_len, req.max_tokens), (rows, req.prompt_len)


@pytest.mark.parametrize("family", ["dream", "sdar"])
def test_a_preempted_request_fits_a_step_again(tiny_checkpoints, family):
    """vLLM prefills a prompt, and re-prefills a preempted request's prompt and committed tokens, in one step
    (chunked prefill is off for non-causal layers), and the request's replays run to the same point; a request
    whose ``step_rows`` left that out would wait forever after a preemption, holding up the queue. Narrow
    steps (and SDAR's block cache) forward far fewer rows than that; where vLLM chunks SDAR's prefills (pages of
    whole attention blocks) a step is bounded by its window alone."""
    from model_executor.block_schedule import plan_blocks
    from model_executor.decode_config import DecodeKnobs, resolve

    spec = ReferenceEngine.from_pretrained(tiny_checkpoints[family]).spec
    configs = [("block", None, "full")] if family == "sdar" else NARROW + [("dual", 0, "full")]
    for cache, suffix, refresh in configs:
        block = spec.attention_block or 32
        cfg = resolve("confidence", DecodeKnobs(cache=cache, suffix=suffix, refresh=refresh), spec, block_size=block)
        for P, M in ((200, 256), (7, 300), (45, 33)):
            last = plan_blocks(P, M, block, cfg.aligned)[-1][0]
            assert cfg.step_rows(P, M) >= last >= P, (cache, suffix, refresh, P, M)
            if family == "sdar":  # pages of whole attention blocks: vLLM chunks a (re-)prefill; a step is the block's
                assert cfg.step_rows(P, M, chunked=True) == 2 * block + P % block, (P, M)


def test_narrow_steps_are_refused_where_they_do_not_apply(tiny_checkpoints):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["sdar"])
    with pytest.raises(ValueError, match=r"generate.suffix 8: a block-causal sdar model forwards no masks after the "
                                         r"block; suffix is for bidirectional models"):
        eng.generate([[1, 2, 3]], block_size=4, suffix=8)
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["llada"])
    with pytest.raises(ValueError, match=r"generate.refresh 'last' is for the prefix and dual caches \(cache is "
                                         r"'none'\); allowed with cache 'none': full"):
        eng.generate([[1, 2, 3]], cache="none", refresh="last")
    from psd_plugin.knobs import DecodeKnobs, parse_config

    with pytest.raises(ValueError, match=r"--config: Invalid enum value 'prompt' - at `\$.refresh`; allowed: full, "
                                         r"answer, last"):
        parse_config('{"refresh": "prompt"}', DecodeKnobs)
    with pytest.raises(ValueError, match=r"Expected `int` >= 0 - at `\$.suffix`"):
        eng.generate([[1, 2, 3]], suffix=-1)


@pytest.mark.parametrize("family, cache, suffix, refresh", [
    ("llada", "prefix", None, "full"), ("llada", "dual", None, "full"), ("dream", "none", None, "full"),
    ("dream", "dual", 0, "full"), ("dream", "prefix", 5, "last"), ("sdar", "block", None, "full"),
    ("llada2", "block", None, "full")])
@pytest.mark.parametrize("method", ["static", "confidence", "psd", "lopa", "freedave", "joint_threshold"])
def test_the_step_after_a_step_that_leaves_its_block_open_is_the_guessed_one(monkeypatch, tiny_checkpoints, family,
                                                                             method, cache, suffix, refresh):
    """What an async scheduler schedules before a step's outcome (:meth:`DLLMRequest.step_after`): whenever a step
    leaves its block open, the request's next step forwards the guessed rows (window start, scheduled rows), and
    its logits rows are within the guess for a one-canvas method; a step that completes a block is followed by
    the next block's first step (the one step an async engine cuts), unless it certainly completed it (one mask
    left): then there is no guess, and that step did complete its block."""
    from model_executor.decode_config import DecodeKnobs, resolve
    from model_executor.dllm_request import DLLMRequest

    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family])
    block = eng.spec.attention_block or 4
    knobs = DecodeKnobs(cache=cache, suffix=suffix, refresh=refresh, threshold=0.3)
    cfg = resolve(method, knobs, eng.spec, block_size=block)
    trace: dict = {}
    plan, stepped = DLLMRequest.plan, DLLMRequest.stepped

    def planning(self, proposal):
        st = plan(self, proposal)
        trace.setdefault(id(self), []).append([(st.w0, st.num_scheduled, st.num_logits_rows), self.step_after(st)])
        return st

    def stepping(self, step):
        blk = self.blk
        out = stepped(self, step)
        trace[id(self)][-1].append(self.done or self.blk != blk)  # the step completed its block
        return out

    monkeypatch.setattr(DLLMRequest, "plan", planning)
    monkeypatch.setattr(DLLMRequest, "stepped", stepping)
    eng.generate(_prompts(6), max_tokens=3 * block + 1, config=cfg)
    open_steps = ends = certain = 0
    for steps in trace.values():
        for geo, guess, ended in steps:
            if guess is None:  # no guess: a certain completion
                assert ended, geo
                certain += 1
        for (geo, guess, ended), (nxt, _, _) in zip(steps, steps[1:]):
            if ended:
                ends += 1
                continue
            open_steps += 1
            assert guess is not None and guess[:2] == nxt[:2], (geo, guess, nxt)
            if method not in ("psd", "lopa", "freedave"):
                assert guess[2] == 0 and nxt[2] <= guess[3], (geo, guess, nxt)
    assert open_steps > 0 and ends > 0, (open_steps, ends)
    if method == "static":  # one commit a step: every block's last step is certain
        assert certain == ends + len(trace), (certain, ends)
