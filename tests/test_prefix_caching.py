"""Prefix caching and chunked prefill for the block-causal families (SDAR, LLaDA2), exact.

In SDAR and LLaDA2 a position sees its own attention block and the blocks before it, so the K/V of a complete
attention block depends only on the tokens up to its end. With KV pages of whole attention blocks
(``--block-size`` a multiple of the model's block) vLLM's prefix cache and chunked prefill stay on
(:class:`attention_backends.vllm_backend.PSDAttention`): a full page of committed tokens (prompt or answer) is
final K/V whatever follows it, and a prompt chunk that ends inside an attention block is recomputed from the
block's start by the next chunk (:class:`psd_plugin.vllm.scheduler.DLLMScheduler`). Each test compares against
the same engine with the cache off (or the prompt in one step): tokens, NFE, the logprobs of what was
committed, and the float32 logits of every request's first decoding step.
"""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]

PAGE = 16


def _llm(path, caching: bool, overlap: bool = False, **kw):
    from vllm import LLM

    kw = {"max_model_len": 512, **kw}
    return LLM(model=str(path), dtype="float32", enforce_eager=True, seed=0, block_size=PAGE,
               enable_prefix_caching=caching, disable_log_stats=False,
               speculative_config={"method": "psd", "decoding": "psd", **({"async_scheduling": True} if overlap else {})},
               **kw)


def _hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))


@pytest.fixture
def first_logits(monkeypatch):
    """Per request (its external id), the logits of its first decoding step's block rows (float32, taken as the
    decoders get them): a cache hit must give the same first step as a cold prefill."""
    from model_executor.decoding.base import logits_map
    from psd_plugin.vllm import compat
    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin

    seen: dict[str, object] = {}
    decode = DLLMRunnerMixin._decode

    def spy(self, logits, decoding, steps, canvas_rows, req_ids):
        at = logits_map(self.inflight.kept)
        for i in decoding:
            rid = compat.external_request_id(req_ids[i])
            if self.inflight.stepping[i].req.nfe == 0 and rid not in seen:
                first = canvas_rows[i][0]
                rows = at[first: first + steps[i].b1 - steps[i].b0]
                seen[rid] = logits[rows[rows >= 0].to(logits.device)].detach().clone()
        return decode(self, logits, decoding, steps, canvas_rows, req_ids)

    monkeypatch.setattr(DLLMRunnerMixin, "_decode", spy)
    return seen


def _same_logits(cold: dict, warm: dict) -> None:
    import torch

    assert cold.keys() == warm.keys() and cold
    for rid in cold:
        assert cold[rid].dtype == torch.float32 and cold[rid].shape == warm[rid].shape and cold[rid].numel()
        torch.testing.assert_close(warm[rid], cold[rid], rtol=1e-5, atol=1e-5, msg=f"request {rid}")


def _run(llm, requests, overlap=False):
    """Each request in turn (a later one finds what the earlier ones cached): per request its outputs'
    (tokens, logprobs, NFE). ``overlap``: async scheduling, whose guesses that missed are model calls too."""
    from psd_plugin.vllm import compat

    got = []
    for prompt, params in requests:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        stats = compat.request_stats(llm)
        mine = [stats[k] for k in stats if k == out.request_id or k.endswith("_" + out.request_id)]
        # a hit's prefill of the rest of its prompt carries its first canvas: every forward of it decodes
        calls, nfe = [s["model_calls"] for s in mine], [s["nfe"] for s in mine]
        assert all(c >= n for c, n in zip(calls, nfe)) if overlap else calls == nfe, mine
        got.append(([list(c.token_ids) for c in out.outputs],
                    [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in out.outputs],
                    sorted(s["nfe"] for s in mine)))
    return got


def _same(cold, warm):
    for (tok_c, lp_c, nfe_c), (tok_w, lp_w, nfe_w) in zip(cold, warm):
        assert tok_w == tok_c and nfe_w == nfe_c
        for a, b in zip(lp_c, lp_w):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("family, overlap", (("sdar", False), ("llada2", False), ("sdar", True)))
def test_shared_prompts_turns_and_samples_hit_the_cache_and_decode_as_cold(tiny_checkpoints, first_logits, family,
                                                                           overlap):
    """Requests sharing a system prompt of a whole number of pages (32) and of a page and a half plus one
    attention block's remainder (37 / 45), a prompt holding the mask token itself, a multi-turn follow-up
    (the first turn's prompt and answer, then more), n = 4 seeded samples of one prompt, and requests sharing a
    prompt sent in one call: with vLLM's prefix cache they decode exactly what they decode without it, and they
    did hit it (``overlap``: the cached run with async scheduling, hits taken while other steps are in flight)."""
    from vllm import SamplingParams

    path = tiny_checkpoints[family]
    mask = json.loads((path / "config.json").read_text())["mask_token_id"]
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=3, n=4, logprobs=1)
    requests = []
    for S in (32, 37 if family == "sdar" else 45):
        system = [(11 * j) % 400 + 20 for j in range(S)]
        requests += [(system + [100 + i, 200 + i, 300 + i][: 1 + i % 3], greedy) for i in range(3)]
    requests.append((requests[0][0][:20] + [mask] + requests[0][0][20:], greedy))
    requests.append((requests[1][0], sampled))
    results, logits = {}, {}
    for caching in (False, True):
        first_logits.clear()
        llm = _llm(path, caching, overlap and caching)
        try:
            got = _run(llm, requests, overlap and caching)
            # the follow-up turn: the first request's prompt and its answer, then a new message
            first_prompt, first_answer = requests[0][0], got[0][0][0]
            got += _run(llm, [(first_prompt + first_answer + [7, 8, 9], greedy)], overlap and caching)
            # requests sharing a new system prompt in one call: the later ones hit pages the first one writes in
            # the same forward (vLLM caches a page when it is scheduled)
            system = [(17 * j) % 400 + 20 for j in range(48)]
            outs = llm.generate([{"prompt_token_ids": system + [60 + i]} for i in range(4)], greedy, use_tqdm=False)
            got += [([list(o.outputs[0].token_ids)], [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                     o.outputs[0].token_ids)]], [])
                    for o in outs]
            results[caching] = (got, _hits(llm))
            logits[caching] = dict(first_logits)
        finally:
            del llm
    (cold, no_hits), (warm, hits) = results[False], results[True]
    assert no_hits == 0 and hits > 0
    _same(cold, warm)
    _same_logits(logits[False], logits[True])
    assert len({tuple(t) for t in warm[-6][0]}) > 1  # the n = 4 samples differ


@pytest.mark.parametrize("family", ("sdar", "llada2"))
def test_evicted_pages_and_preempted_sharers_decode_as_cold(monkeypatch, tiny_checkpoints, first_logits, family):
    """A KV cache of 13 pages of 16 tokens: six requests sharing a 40-token system prompt (two and a half pages)
    run together, so vLLM preempts some while the others still hold the shared pages, and a resumed request finds
    its prompt's pages (and the pages of the blocks it had committed) in the cache; then requests with other
    prompts take every page, evicting the cached ones, and the first prompts come again (recomputed where their
    pages were evicted, hit where one survived). Everything decodes as the reference engine does (tokens, NFE)
    and as with the cache off (logprobs, the first step's logits)."""
    from vllm import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from model_executor.engine import ReferenceEngine
    from psd_plugin.vllm import compat
    from psd_plugin.vllm.scheduler import DLLMScheduler

    preempted, hits, evicted = [], [], []
    preempt, lookup, evict = (DLLMScheduler._preempt_request, KVCacheManager.get_computed_blocks,
                              BlockPool._maybe_evict_cached_block)

    def spy_preempt(self, request, *a, **k):
        preempted.append(request.request_id)
        return preempt(self, request, *a, **k)

    def spy_lookup(self, request):
        out = lookup(self, request)
        hits.append((request.request_id, out[1]))
        return out

    def spy_evict(self, block):
        gone = evict(self, block)
        evicted.append(gone)
        return gone

    monkeypatch.setattr(DLLMScheduler, "_preempt_request", spy_preempt)
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", spy_lookup)
    monkeypatch.setattr(BlockPool, "_maybe_evict_cached_block", spy_evict)
    system = [(13 * j) % 400 + 20 for j in range(40)]
    shared = [system + [100 + i, 200 + i][: 1 + i % 2] for i in range(6)]
    others = [[(7 * j + 31 * i) % 400 + 20 for j in range(60)] for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=1)
    engine = ReferenceEngine.from_pretrained(tiny_checkpoints[family])
    ref = engine.generate(shared + others + shared[:3], max_tokens=32, method="psd",
                          block_size=engine.spec.attention_block)
    runs, logits = {}, {}
    for caching in (False, True):
        preempted.clear(), hits.clear(), evicted.clear(), first_logits.clear()
        llm = _llm(tiny_checkpoints[family], caching, max_model_len=128, num_gpu_blocks_override=14)
        try:
            outs = []
            for batch in (shared, others, shared[:3]):
                outs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            stats = compat.request_stats(llm)
            runs[caching] = ([list(o.outputs[0].token_ids) for o in outs],
                             [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                              for o in outs],
                             [stats[o.request_id]["nfe"] for o in outs], list(preempted))
            logits[caching] = dict(first_logits)
            if caching:
                resumed_hits = [n for rid, n in hits if rid in preempted and n > 0]
                assert preempted, "the test did not force a preemption"
                assert resumed_hits, f"no preempted request found cached pages when it resumed: {hits}"
                assert any(evicted), "no cached page was evicted"
                assert _hits(llm) > 0
        finally:
            del llm
    (tok, lp, nfe, _), (tok_w, lp_w, nfe_w, _) = runs[False], runs[True]
    assert tok == [r.token_ids for r in ref] and nfe == [r.nfe for r in ref]
    assert tok_w == tok and nfe_w == nfe
    for a, b in zip(lp, lp_w):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    _same_logits(logits[False], logits[True])


@pytest.mark.parametrize("overlap", (False, True))
def test_chunked_prefill_equals_a_prompt_in_one_step(tiny_checkpoints, overlap):
    """A prompt of about three token budgets, prefilled in chunks that end inside LLaDA2's 8-token attention
    blocks (95 rows a step), decodes exactly as when its prompt fits one step, greedy and seeded sampled; it did
    take several chunks (with async scheduling too: ``overlap``, the chunked run)."""
    from vllm import SamplingParams

    from psd_plugin.vllm import compat

    prompts = [[(7 * i + 3 * j) % 400 + 20 for j in range(300 + i)] for i in range(3)]
    # greedy and seeded sampled (vLLM's bookkeeping rewound a seeded request's generator for each chunk short of
    # the prompt's end, which ended the engine on a CPU: compat.drop_sampler_generators)
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=1)] + \
        [SamplingParams(max_tokens=24, temperature=0.8, seed=3 + i, logprobs=1) for i in range(2)]
    runs = {}
    for budget in (512, 99):
        llm = _llm(tiny_checkpoints["llada2"], False, overlap and budget == 99, max_num_batched_tokens=budget,
                   max_num_seqs=4)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            stats = compat.request_stats(llm)
            runs[budget] = ([list(o.outputs[0].token_ids) for o in outs],
                            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                             for o in outs],
                            [stats[o.request_id]["nfe"] for o in outs],
                            [stats[o.request_id]["model_calls"] for o in outs])
        finally:
            del llm
    (tok, lp, nfe, _), (tok_c, lp_c, nfe_c, calls_c) = runs[512], runs[99]
    assert tok_c == tok and nfe_c == nfe
    for a, b in zip(lp, lp_c):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    assert all(c >= n + 2 for c, n in zip(calls_c, nfe_c)), (calls_c, nfe_c)  # the prompt took >= 3 chunks


def test_pages_that_cut_attention_blocks_keep_both_off(tmp_path, tokenizer_dir):
    """An SDAR model whose 256-token attention blocks vLLM's default CPU page (128 tokens) cuts: a full page is
    not final K/V, so prefix caching (and chunked prefill) are off, with a warning naming ``--block-size``, and
    nothing is looked up; a page asked for explicitly that cuts the blocks is refused, naming the field, unless
    prefix caching is off."""
    from vllm import LLM, SamplingParams

    from model_executor.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("sdar", tmp_path / "sdar256", tokenizer_dir, seed=3, block_size=256)
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              disable_log_stats=False, speculative_config={"method": "psd", "decoding": "psd"})
    try:
        system = [(5 * j) % 300 + 20 for j in range(140)]
        for i in range(2):
            out = llm.generate([{"prompt_token_ids": system + [50 + i]}], SamplingParams(max_tokens=16, temperature=0),
                               use_tqdm=False)
            assert out[0].outputs[0].token_ids
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        assert _hits(llm) == 0
    finally:
        del llm
    with pytest.raises(ValueError, match=r"block_size 16: a KV page of this sdar model must hold whole 32-token "
                                         r"attention blocks .*allowed: a multiple of 32, or prefix caching off"):
        _llm(make_tiny_checkpoint("sdar", tmp_path / "sdar32", tokenizer_dir, seed=3, block_size=32), True)
