"""The reference engine: batching invariance, exact SDAR block cache, policies, EOS handling, bad input."""

import pytest
import torch

from model_executor.decoding.policies import confidence_policy, static_policy
from model_executor.engine import ReferenceEngine
from psd_plugin import DEFAULT_DLLM
from psd_plugin.evaluate import encode

PROMPTS = ["Sort the list: 3 1 2", "Reverse the list: a b c d e", "Add 2 to each: 1",
           "Table: a=3, b=7, c=1. Look up: b c"]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [encode(tok, p) for p in PROMPTS]


def test_policies():
    inf = float("-inf")
    conf = torch.tensor([0.2, inf, 0.95, 0.5, 0.91], dtype=torch.float64)
    assert static_policy(conf).tolist() == [False, False, True, False, False]
    assert confidence_policy(conf, 0.9).tolist() == [False, False, True, False, True]
    assert confidence_policy(torch.tensor([0.1, 0.3]), 0.9).tolist() == [False, True]  # top-1 always
    assert not static_policy(torch.tensor([inf, inf])).any()


@pytest.mark.parametrize("family,caches", [("llada", ["none", "prefix"]), ("dream", ["none", "prefix"]),
                                           ("sdar", ["none", "block"]), ("llada2", ["none", "block"])])
@pytest.mark.parametrize("method", ["static", "confidence"])
def test_batch_equals_single_float64(tiny_checkpoints, prompt_ids, family, caches, method):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    bs = eng.spec.attention_block or 8
    for cache in caches:
        kw = dict(max_tokens=12, block_size=bs, method=method, cache=cache, threshold=0.02)
        batch = eng.generate(prompt_ids, **kw)
        for p, b in zip(prompt_ids, batch):
            single = eng.generate([p], **kw)[0]
            assert single.token_ids == b.token_ids and single.nfe == b.nfe
            assert b.prompt_token_ids == p
        if method == "static":  # one token per forward
            assert all(r.nfe == 12 and len(r.token_ids) == 12 for r in batch)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_causal_block_cache_is_exact(tiny_checkpoints, prompt_ids, family):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    bs = eng.spec.attention_block
    a = eng.generate(prompt_ids, max_tokens=14, block_size=bs, method="static", cache="none")
    b = eng.generate(prompt_ids, max_tokens=14, block_size=bs, method="static", cache="block")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_prefix_cache_first_step_equals_no_cache(tiny_checkpoints, prompt_ids):
    """Within the first block the prefix cache's first forward is a full forward: one-token answers agree."""
    for fam in ("llada", "dream"):
        eng = ReferenceEngine.from_pretrained(tiny_checkpoints[fam], dtype=torch.float64)
        a = eng.generate(prompt_ids, max_tokens=1, block_size=8, method="static", cache="none")
        b = eng.generate(prompt_ids, max_tokens=1, block_size=8, method="static", cache="prefix")
        assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_embedded_model_stops_at_eos_block(prompt_ids):
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    eos = eng.spec.eos_token_id
    res = eng.generate(prompt_ids, max_tokens=32, block_size=8, method="static")
    for r in res:
        assert r.finish_reason == "stop" and r.token_ids[-1] == eos and eos not in r.token_ids[:-1]
        # static: one forward per decoded position, up to the end of the block holding the EOS
        assert r.nfe == -(-len(r.token_ids) // 8) * 8
        assert r.tpf == len(r.token_ids) / r.nfe
    fast = eng.generate(prompt_ids, max_tokens=32, block_size=8, method="confidence", threshold=0.9)
    assert sum(r.nfe for r in fast) < sum(r.nfe for r in res)


def test_sampling_is_seeded(prompt_ids):
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    kw = dict(max_tokens=16, block_size=8, method="static", temperature=1.0)
    a = eng.generate(prompt_ids, seed=1, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in eng.generate(prompt_ids, seed=1, **kw)]
    assert [r.token_ids for r in a] != [r.token_ids for r in eng.generate(prompt_ids, seed=2, **kw)]
    greedy = eng.generate(prompt_ids, **{**kw, "temperature": 0.0})
    assert [r.token_ids for r in a] != [r.token_ids for r in greedy]  # the temperature is applied


def test_bad_arguments(tiny_checkpoints, prompt_ids):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["llada"])
    with pytest.raises(ValueError, match="method 'nope'; allowed: static, confidence"):
        eng.generate(prompt_ids, method="nope")
    with pytest.raises(ValueError, match="cache 'block' is exact only for block-causal"):
        eng.generate(prompt_ids, cache="block")
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        eng.generate(prompt_ids, max_tokens=0)
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        eng.generate([[5] * 500], max_tokens=32)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]])
    sdar = ReferenceEngine.from_pretrained(tiny_checkpoints["sdar"])
    with pytest.raises(ValueError, match="decodes in its attention block; allowed: 4"):
        sdar.generate(prompt_ids, block_size=8)


@pytest.mark.parametrize("method", ["static", "confidence", "localleap", "lopa", "freedave", "psd"])
def test_a_model_that_ranks_the_mask_token_first_still_finishes(tiny_checkpoints, prompt_ids, method):
    """A random checkpoint can rank the mask token first at a masked position; committing it would leave the
    position masked and the request stepping forever (found calibrating a random LLaDA2). The mask token is
    never a prediction: every request ends, with no mask in its answer, in at most one forward per token."""
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["llada"])
    mask, head = eng.spec.mask_token_id, eng.model._head

    def mask_first(x):
        out = head(x)
        out[..., mask] += 1e4
        return out

    eng.model._head = mask_first
    out = eng.generate(prompt_ids, max_tokens=12, block_size=4, method=method)
    for r in out:
        assert mask not in r.token_ids and 0 < len(r.token_ids) <= 12 and r.nfe <= 12


@pytest.mark.parametrize("method", ["static", "confidence", "lopa", "freedave", "psd"])
def test_request_rules_change_the_output_as_asked(engine64, mixed_prompts, method):
    """logit_bias forces a token; banned tokens never appear (and the answer changes where they did); allowed
    tokens are the only ones; min_tokens keeps EOS out of the first positions; all methods, the lossless ones
    still equal to their base policy under the same rules."""
    from model_executor.decoding import LogitsRules

    prompts = mixed_prompts[:6]
    eos = engine64.spec.eos_token_id
    kw = dict(max_tokens=16, block_size=8, method=method)
    plain = engine64.generate(prompts, **kw)
    forced = engine64.generate(prompts, rules=LogitsRules(logit_bias={77: 100.0}), **kw)
    assert all(set(r.token_ids) == {77} for r in forced)
    common = max({t for r in plain for t in r.token_ids if t != eos},
                 key=lambda t: sum(r.token_ids.count(t) for r in plain))
    banned = engine64.generate(prompts, rules=LogitsRules(banned_token_ids=(common,)), **kw)
    assert all(common not in r.token_ids for r in banned)
    assert any(common in r.token_ids for r in plain)
    allowed = (eos, 70, 71, 72)
    only = engine64.generate(prompts, rules=LogitsRules(allowed_token_ids=allowed), **kw)
    assert all(set(r.token_ids) <= set(allowed) for r in only)
    assert any(len(r.token_ids) < 16 for r in plain)  # EOS early somewhere ...
    longer = engine64.generate(prompts, rules=LogitsRules(min_tokens=12, stop_token_ids=(eos,)), **kw)
    assert all(eos not in r.token_ids[:12] and len(r.token_ids) >= 12 for r in longer)  # ... never before 12
    if method == "freedave":  # lossless: static decoding under the same rules
        base = engine64.generate(prompts, rules=LogitsRules(banned_token_ids=(common,)), max_tokens=16,
                                 block_size=8, method="static")
        assert [r.token_ids for r in base] == [r.token_ids for r in banned]


def test_top_k_1_sampling_equals_greedy_and_top_p_restricts(engine64, mixed_prompts):
    prompts = mixed_prompts[:6]
    kw = dict(max_tokens=16, block_size=8, method="confidence")
    greedy = engine64.generate(prompts, **kw)
    k1 = engine64.generate(prompts, temperature=1.5, top_k=1, seed=3, **kw)
    assert [r.token_ids for r in k1] == [r.token_ids for r in greedy]
    wild = engine64.generate(prompts, temperature=5.0, seed=3, **kw)
    assert [r.token_ids for r in wild] != [r.token_ids for r in greedy]  # temperature 5 samples far off
    nucleus = engine64.generate(prompts, temperature=5.0, top_p=1e-9, seed=3, **kw)  # keeps the best token
    assert [r.token_ids for r in nucleus] == [r.token_ids for r in greedy]
    tiny_min_p = engine64.generate(prompts, temperature=5.0, min_p=1.0, seed=3, **kw)
    assert [r.token_ids for r in tiny_min_p] == [r.token_ids for r in greedy]


def test_penalties_follow_vllms_rules_on_the_tokens_committed_so_far(engine64, mixed_prompts):
    """Repetition / presence / frequency penalties over the tokens committed before each forward (the prompt too
    for repetition): a strong one changes the answers and repeats fewer tokens; the drafting methods refuse them."""
    from model_executor.decoding import LogitsRules

    prompts = mixed_prompts[:6]
    kw = dict(max_tokens=16, block_size=8, method="confidence")
    plain = engine64.generate(prompts, **kw)

    def repeats(rs):
        return sum(len(r.token_ids) - len(set(r.token_ids)) for r in rs)

    for rules in (LogitsRules(repetition_penalty=3.0), LogitsRules(frequency_penalty=2.0),
                  LogitsRules(presence_penalty=3.0)):
        got = engine64.generate(prompts, rules=rules, **kw)
        assert [r.token_ids for r in got] != [r.token_ids for r in plain]
        assert repeats(got) < repeats(plain), rules
    with pytest.raises(ValueError, match=r"penalties with decoding .psd..*static \| confidence \| localleap"):
        engine64.generate(prompts, rules=LogitsRules(presence_penalty=1.0), max_tokens=16, block_size=8,
                          method="psd")


def test_rules_apply_vllms_formulas_and_keep_their_uploads():
    """``LogitsRules.apply`` against vLLM's formulas written out (repetition on the prompt and the answer so far,
    frequency and presence on the answer, bias, allowed, banned, min_tokens), with one rules object shared by two
    requests of different prompts, applied alternately (the prompt's token set is kept per prompt, not per rules
    object); the constant tensors are built once per device, not every step."""
    from model_executor.decoding import LogitsRules

    V, g = 40, torch.Generator().manual_seed(0)
    rules = LogitsRules(repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.5, logit_bias={3: 2.5},
                        allowed_token_ids=tuple(range(0, 40, 2)), banned_token_ids=(6,), min_tokens=2,
                        stop_token_ids=(4,))
    histories = [(torch.tensor([1, 5, 7]), torch.tensor([2, 2, 9])), (torch.tensor([11, 12]), torch.tensor([5]))]
    offsets = torch.tensor([0, 1, 2])
    for h in (0, 1, 0, 1):
        prompt, out = histories[h]
        x = torch.randn(3, V, generator=g, dtype=torch.float64)
        want = x.clone()
        counts = torch.bincount(out, minlength=V).double()
        seen = counts > 0
        seen[prompt] = True
        want = torch.where(seen, torch.where(want > 0, want / 1.7, want * 1.7), want)
        want -= 0.3 * counts + 0.5 * (counts > 0).double()
        keep = torch.zeros(V, dtype=torch.bool)
        keep[0::2] = True
        want[:, ~keep] = float("-inf")
        want[:, 6] = float("-inf")
        want[:, 3] += 2.5
        want[:2, 4] = float("-inf")  # answer offsets 0 and 1 < min_tokens
        rules.apply(x, offsets, (prompt, out))
        assert torch.equal(x, want), h
    assert rules.on(torch.device("cpu"), V) is rules.on(torch.device("cpu"), V)


@pytest.mark.parametrize("method", ["static", "confidence", "localleap", "psd", "spiffy", "lopa", "freedave"])
def test_each_emitted_token_has_its_logprob_entry(mixed_prompts, method):
    """``logprobs=2``: every emitted token's entry holds it (its log-probability under the canvas row of the
    forward it was taken from, and the 2 most likely), all <= 0; a spatial policy's greedy token is its forward's
    most likely, and so is PSD's, chain and skip DAG (a commit on its best draft's output is that row's top-1, an
    accepted draft's token its accepting parent's: before, the state canvas's row was reported for both, where
    the token may rank second), and Spiffy's (each of Alg. 1's passes commits from its own canvas's row). LoPA and FreeDave are refused, naming the field and the methods that give logprobs: each of their
    canvases holds positions committed from the last forward's predictions, which their step computes no logits
    for (the request used to fail in its first verifying step)."""
    from model_executor.decode_config import ConfigError
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    knobs = {"policy": "static", "graph": load_graph(default_graph(DEFAULT_DLLM, "static"))} \
        if method == "spiffy" else {}
    kw = dict(max_tokens=24, block_size=8, method=method, logprobs=2, **knobs)
    if method in ("lopa", "freedave"):
        with pytest.raises(ConfigError, match=rf"logprobs with decoding '{method}'.*use decoding static"):
            eng.generate(mixed_prompts[:1], **kw)
        return
    shapes = ({}, {"dag_shape": "skip"}) if method == "psd" else ({},)
    for sampled, shape in [(s, d) for s in ({}, {"temperature": 0.8, "seed": 3}) for d in shapes]:
        out = eng.generate(mixed_prompts, **kw, **sampled, **shape)
        for r in out:
            assert r.token_ids and len(r.logprobs) == len(r.token_ids)
            for tok, entry in zip(r.token_ids, r.logprobs):
                assert tok in entry and all(v <= 0 for v in entry.values()), (tok, entry)
                if method in ("static", "confidence", "localleap", "psd", "spiffy") and not sampled:
                    assert entry[tok] == max(entry.values()), (shape, tok, entry)


def test_logprobs_are_the_models_before_the_requests_rules(mixed_prompts):
    """Logprobs are vLLM's default ``raw_logprobs``: the model's distribution (the mask token excluded), before the
    request's logits rules. A bias on, or a ban of, a token no answer uses leaves every decision as it was, and so
    every logprob entry bit for bit; reported after the rules, each entry moves (the mass renormalised)."""
    from model_executor.decoding import LogitsRules

    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    V, mask = eng.spec.vocab_size, eng.spec.mask_token_id
    kw = dict(max_tokens=24, block_size=8, method="confidence", logprobs=2)
    plain = eng.generate(mixed_prompts, **kw)
    unused = [t for t in range(V - 1, 0, -1) if t != mask and all(t not in r.token_ids for r in plain)][:2]
    for rules in (LogitsRules(logit_bias={unused[0]: 1.0}), LogitsRules(banned_token_ids=(unused[1],))):
        ruled = eng.generate(mixed_prompts, rules=rules, **kw)
        assert [r.token_ids for r in ruled] == [r.token_ids for r in plain]  # the same decisions
        assert [r.logprobs for r in ruled] == [r.logprobs for r in plain], rules


def test_a_rewritten_position_reports_the_logprob_of_the_token_it_emits(mixed_prompts):
    """joint_threshold with full editing (``edit_threshold=0``), greedy, ``logprobs=1``: a position rewritten after
    it was filled reports the distribution its final token was taken from, not the first token's (17 of 51
    emitted tokens lacked their own entry when a position was recorded once): every emitted token is in its
    entry, the forward's most likely (rank 1), and a token decoded without edits keeps the entry it had."""
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    kw = dict(max_tokens=32, block_size=8, method="joint_threshold", logprobs=1)
    out = eng.generate(mixed_prompts, edit_threshold=0.0, **kw)
    assert sum(r.stats["edits"] for r in out) > 0  # positions were rewritten
    for r in out:
        assert len(r.logprobs) == len(r.token_ids)
        for tok, entry in zip(r.token_ids, r.logprobs):
            assert tok in entry and entry[tok] == max(entry.values()), (tok, entry)
    plain = eng.generate(mixed_prompts, edit_threshold=1.0, **kw)  # no edits: each position recorded once
    assert sum(r.stats["edits"] for r in plain) == 0
    assert all(t in e for r in plain for t, e in zip(r.token_ids, r.logprobs))


@pytest.mark.parametrize("method, top_k", [("static", 0), ("static", 3), ("psd", 0), ("freedave", 3), ("lopa", 0),
                                           ("joint_threshold", 0)])
def test_first_sampled_token_follows_the_models_softmax(tiny_checkpoints, method, top_k):
    """Temperature 0.15 (and top_k 3): over 3000 seeded requests the one-token answer's histogram matches a
    random model's softmax at that position, restricted and renormalised, whichever method commits it; the mask
    token is never drawn (a sampler returning the argmax, or ignoring top_k, fails the bound)."""
    engine64 = ReferenceEngine.from_pretrained(tiny_checkpoints["llada"], dtype=torch.float64)
    prompt = [1, 3, 17, 45, 99]
    n, T = 3000, 0.15
    out = engine64.generate([prompt] * n, max_tokens=1, block_size=1, method=method, temperature=T, top_k=top_k,
                            seed=11, cache="none", batch_size=1000, max_post_edit_steps=0)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in out]), minlength=engine64.spec.vocab_size)
    with torch.no_grad():
        logits = engine64.model(torch.tensor([prompt + [engine64.spec.mask_token_id]]))[0, -1].double()
    logits[engine64.spec.mask_token_id] = float("-inf")
    p = torch.softmax(logits / T, -1)
    if top_k:
        p = torch.where(p >= p.topk(top_k).values[-1], p, 0.0)
        p /= p.sum()
    freq = counts.double() / n
    assert counts[engine64.spec.mask_token_id] == 0 and (freq[p == 0] == 0).all()
    assert (freq - p).abs().max() < 0.025, (freq.topk(4), p.topk(4))
    assert (p > 0.05).sum() >= 3  # a distribution worth testing: several likely tokens


@pytest.mark.parametrize("method, base, dtype, cache", [
    ("spiffy", "static", torch.float64, "prefix"), ("spiffy", "confidence", torch.float32, "dual"),
    ("spiffy", "confidence", torch.bfloat16, "prefix"), ("freedave", "static", torch.float64, "dual"),
    ("freedave", "static", torch.float32, "prefix"), ("freedave", "static", torch.bfloat16, "prefix")])
def test_lossless_methods_sample_their_base_policys_tokens(mixed_prompts, method, base, dtype, cache):
    """Spiffy (Alg. 1, appendix A.1) and FreeDave (Theorem 1) under sampling: with the same seeds their tokens are
    the base policy's sampled tokens, token for token, on held-out prompts of every task (top_k, then top_p, two
    temperatures), in fewer forwards, in float64, float32 and bfloat16 (decisions on float32 confidences), with
    the prefix and the dual cache; another seed gives other tokens. A draft for step t + k is drawn as step t + k
    is (counter-based noise)."""
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM, dtype=dtype)
    knobs = {"policy": base, "graph": load_graph(default_graph(DEFAULT_DLLM, base))} if method == "spiffy" else {}
    kw = dict(max_tokens=24, block_size=8, temperature=0.9, top_k=20, seed=4, cache=cache)
    base_out = eng.generate(mixed_prompts, method=base, **kw)
    fast = eng.generate(mixed_prompts, method=method, **knobs, **kw)
    assert [r.token_ids for r in fast] == [r.token_ids for r in base_out]
    assert sum(r.nfe for r in fast) < sum(r.nfe for r in base_out)
    hot = dict(kw, temperature=1.3, top_k=0, top_p=0.95, seed=8)
    assert [r.token_ids for r in eng.generate(mixed_prompts, method=method, **knobs, **hot)] == \
        [r.token_ids for r in eng.generate(mixed_prompts, method=base, **hot)]
    other = eng.generate(mixed_prompts, method=base, **{**kw, "seed": 5})
    assert [r.token_ids for r in other] != [r.token_ids for r in base_out]
    greedy = eng.generate(mixed_prompts, method=base, max_tokens=24, block_size=8)
    assert [r.token_ids for r in greedy] != [r.token_ids for r in base_out]  # it did sample


@pytest.mark.parametrize("method, knobs", [("psd", {}), ("psd", {"policy": "static"}), ("lopa", {}),
                                           ("joint_threshold", {}), ("localleap", {})])
def test_every_method_samples(engine64, mixed_prompts, method, knobs):
    """The drafting and editing methods decode under sampling: seeded runs repeat, another seed and greedy decoding
    give other tokens, samples of one prompt differ, and a prompt decodes the same alone as in a batch."""
    kw = dict(max_tokens=24, block_size=8, temperature=1.0, seed=4, method=method, **knobs)
    a = engine64.generate(mixed_prompts, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in engine64.generate(mixed_prompts, **kw)]
    assert [r.token_ids for r in a] != [r.token_ids for r in engine64.generate(mixed_prompts, **{**kw, "seed": 5})]
    greedy = engine64.generate(mixed_prompts, **{**kw, "temperature": 0.0})
    assert [r.token_ids for r in a] != [r.token_ids for r in greedy]
    alone = engine64.generate(mixed_prompts, **kw, batch_size=1)
    assert [r.token_ids for r in alone] == [r.token_ids for r in a]
    same = engine64.generate([mixed_prompts[0]] * 4, **kw)  # four samples of one prompt (seeds 4e6 + i)
    assert len({tuple(r.token_ids) for r in same}) > 1


@pytest.mark.parametrize("method, temperature", [(m, 0.0) for m in ("static", "confidence", "lopa", "freedave",
                                                                     "spiffy", "psd")]
                         + [("confidence", 0.9), ("spiffy", 0.9), ("psd", 0.9)])
def test_logits_only_for_the_rows_a_decoder_reads(engine64, mixed_prompts, monkeypatch, method, temperature):
    """A step's model call computes logits for the canvas rows its decoders read, nothing else: the positions each
    canvas leaves masked, greedy or sampled (a draw is keyed by its position: the masked rows' draws are the
    block's)."""
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    forward, seen = type(engine64)._forward, []

    def spy(self, seqs, batch, kept):
        logits = forward(self, seqs, batch, kept)
        ids = batch.input_ids[batch.logits_rows]  # every canvas's block rows, in prediction-row order
        seen.append((logits.shape[0], int((ids == self.spec.mask_token_id).sum()), ids.numel()))
        return logits

    monkeypatch.setattr(type(engine64), "_forward", spy)
    knobs = {"policy": "static", "graph": load_graph(default_graph(DEFAULT_DLLM, "static"))} if method == "spiffy" \
        else {}
    engine64.generate(mixed_prompts, max_tokens=16, block_size=8, method=method, temperature=temperature, seed=1,
                      **knobs)
    computed, masked, rows = (sum(x) for x in zip(*seen))
    assert computed == masked, seen
    assert masked < rows  # decoded positions were left out
