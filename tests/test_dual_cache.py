"""DualCache (``cache="dual"``, Fast-dLLM) in the reference engine: a plain dense implementation of the same rule
gives the same tokens and forwards, and the lossless methods stay token-identical to their base policy.

The rule: a block's first step forwards the whole sequence and keeps every position's K/V; its later steps
forward the block alone (from ``b0 - 1`` for Dream's shifted logits) and attend to the kept K/V before and
after it. The dense version below computes exactly that with whole-tensor attention per layer, one prompt at a
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
def _dense_dual(model, prompt, max_tokens, block_size, method, **knobs):
    """One prompt decoded with the dual cache rule, dense; returns (answer up to the first EOS, NFE)."""
    spec = model.spec
    shift, mask, eos = int(spec.shift_logits), spec.mask_token_id, spec.eos_token_id
    P = len(prompt)
    tokens = torch.tensor(prompt + [mask] * max_tokens)
    total, nfe = tokens.numel(), 0
    for b0 in range(P, total, block_size):
        b1 = min(b0 + block_size, total)
        dec = make_oracle(method, tokens[b0:b1], mask, **knobs)  # the method on one block, as its paper states it
        kept = None
        while not dec.done:
            canvases = dec.canvases()
            outs = []
            for c in canvases:
                seq = tokens.clone()
                seq[b0:b1] = c
                if kept is None:  # the block's first step: everything, K/V kept
                    out, kept = _dense_forward(model, seq, torch.arange(total))
                    outs.append(out[b0 - shift: b1 - shift])
                else:  # the block (from b0 - shift) over the kept K/V before and after it
                    w0 = b0 - shift
                    keys_at = torch.cat([torch.arange(w0), torch.arange(b1, total)])
                    out, _ = _dense_forward(model, seq[w0:b1], torch.arange(w0, b1), kept, keys_at)
                    outs.append(out[:b1 - b0])
            dec.update(outs)
            nfe += 1
        tokens[b0:b1] = dec.state
        if eos in dec.state.tolist():
            break
    gen = tokens[P:].tolist()
    return (gen[: gen.index(eos) + 1] if eos in gen else [t for t in gen if t != mask]), nfe


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("method", ["static", "confidence", "lopa"])
def test_engine_equals_a_dense_implementation(tiny_checkpoints, family, method):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (2, 7, 13, 20)]
    knobs = {"threshold": 0.02} if method == "confidence" else {"branches": 2, "policy": "static"} \
        if method == "lopa" else {}
    got = eng.generate(prompts, max_tokens=19, block_size=6, method=method, cache="dual", **knobs)
    prefix = eng.generate(prompts, max_tokens=19, block_size=6, method=method, cache="prefix", **knobs)
    for p, r in zip(prompts, got):
        want, nfe = _dense_dual(eng.model, p, 19, 6, method, **knobs)
        assert r.token_ids == want and r.nfe == nfe, (family, method, p)
    if family == "llada":  # the kept suffix is stale K/V: here the rule decodes differently from the prefix cache
        assert [r.token_ids for r in got] != [r.token_ids for r in prefix]


@pytest.mark.parametrize("policy", ["static", "confidence"])
def test_freedave_and_spiffy_are_lossless_with_the_dual_cache(engine64, mixed_prompts, policy):
    """Every canvas of a step sees the same kept K/V, so a draft equal to a state the base policy reaches gets
    that state's prediction (Spiffy's appendix A.2): FreeDave and Spiffy reproduce their base policy."""
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    base = engine64.generate(mixed_prompts, method=policy, cache="dual")
    spiffy = engine64.generate(mixed_prompts, method="spiffy", policy=policy, cache="dual", budget=3,
                               graph=load_graph(default_graph(DEFAULT_DLLM, policy)))
    assert [r.token_ids for r in spiffy] == [r.token_ids for r in base]
    assert sum(r.nfe for r in spiffy) < sum(r.nfe for r in base)
    if policy == "static":
        freedave = engine64.generate(mixed_prompts, method="freedave", steps=4, cache="dual")
        assert [r.token_ids for r in freedave] == [r.token_ids for r in base]
        assert sum(r.nfe for r in freedave) < sum(r.nfe for r in base)


def test_dual_is_refused_for_sdar(tiny_checkpoints):
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints["sdar"])
    with pytest.raises(ValueError, match="cache 'dual' is for bidirectional models; a block-causal sdar model allows: none, block"):
        eng.generate([[1, 2, 3]], block_size=4, cache="dual")
