"""PRESTO end to end on the embedded models: the drafter speculates, the AR target verifies token trees.

Greedy outputs must equal the target's own greedy decoding (transformers' ``generate``) token for token, for
every tree search, at batch sizes 1 and 64 over mixed-length prompts; sampled first tokens must follow the
target's distribution.
"""

import json

import pytest
import torch

from model_executor.ar_engine import AREngine
from model_executor.decoding.ngram import NGramModel
from model_executor.models.reference import ReferenceDLLM
from model_executor.presto_engine import PrestoEngine
from psd_plugin import DEFAULT_AR, DEFAULT_DLLM, DEFAULT_DRAFTER, default_ngram
from psd_plugin.cli import main
from psd_plugin.evaluate import encode
from psd_plugin.train.tasks import TASKS, load_heldout


@pytest.fixture(scope="module")
def presto():
    ng = default_ngram(DEFAULT_DRAFTER)
    return PrestoEngine(ReferenceDLLM.from_pretrained(DEFAULT_AR), ReferenceDLLM.from_pretrained(DEFAULT_DRAFTER),
                        NGramModel.load(ng) if ng else None)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    return [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[:2]]


@pytest.fixture(scope="module")
def ar_greedy(prompts):
    return [r.token_ids for r in AREngine.from_pretrained(DEFAULT_AR).generate(prompts, max_tokens=32)]


@pytest.mark.parametrize("search,budget", [("beam", 32)] + [  # one in the default suite, the rest in -m slow
    pytest.param(s, b, marks=pytest.mark.slow) for s, b in (("ar", 1), ("linear", 16), ("beam", 128), ("best_first", 64))])
def test_greedy_equals_the_target_greedy(presto, prompts, ar_greedy, search, budget):
    res = presto.generate(prompts, search=search, tree_budget=budget, max_tokens=32)
    assert [r.token_ids for r in res] == ar_greedy
    for r in res:
        assert r.nfe >= 1 and r.stats["accept_len"] == pytest.approx(len(r.token_ids) / r.nfe)
    if search == "ar":
        assert all(r.nfe == len(r.token_ids) for r in res)
    else:  # drafting must pay off on the embedded pair
        tau = sum(len(r.token_ids) for r in res) / sum(r.nfe for r in res)
        assert tau > 1.5, tau


@pytest.mark.slow
def test_batch_size_one_and_adaptive_lambda(presto, prompts, ar_greedy):
    res = presto.generate(prompts[:5], search="beam", tree_budget=64, max_tokens=32, batch_size=1,
                          adaptive=(0.4, 1.0))
    assert [r.token_ids for r in res] == ar_greedy[:5]


@pytest.mark.slow
def test_drafter_row_budget_splits_a_step_and_keeps_the_trees(presto, prompts, monkeypatch):
    """``TreeDrafter.max_rows``: a step whose requests need more drafter rows drafts them in several forwards of
    at most that many rows (one request's longest context alone), with the same trees as one forward."""
    drafting, calls = presto.drafting, []
    forward = drafting.drafter.forward_paged

    def spy(ids, *a, **k):
        calls.append(ids.numel())
        return forward(ids, *a, **k)

    kw = dict(search="beam", tree_budget=32, max_tokens=24)
    monkeypatch.setattr(drafting.drafter, "forward_paged", spy)
    calls.clear()
    whole = presto.generate(prompts, **kw)
    one = len(calls)
    monkeypatch.setattr(drafting, "max_rows", 48)
    calls.clear()
    split = presto.generate(prompts, **kw)
    assert [r.token_ids for r in split] == [r.token_ids for r in whole]
    assert [r.stats for r in split] == [r.stats for r in whole]
    longest = max(len(p) for p in prompts) + 24 + 2 * drafting.drafter.spec.attention_block
    assert len(calls) > one and max(calls) <= max(48, longest)
    assert sum(c <= 48 for c in calls) > len(calls) // 2  # most forwards keep to the budget


@pytest.mark.slow
def test_sampled_first_token_follows_the_target(presto, prompts):
    """Temperature 1: over 1500 draws the first token's histogram matches the target's softmax, at a position
    where a sampler that always returned the argmax would be far from it."""
    target = presto.target
    with torch.no_grad():  # the most uncertain first position among the prompts
        dists = [torch.softmax(target(torch.tensor([p]))[0, -1].double(), -1) for p in prompts]
    ent = [float(-(d * d.clamp_min(1e-30).log()).sum()) for d in dists]
    i = max(range(len(prompts)), key=ent.__getitem__)
    tol = 0.06
    # the distance an argmax sampler's histogram (all mass on the argmax) has from the softmax: 1 - p(argmax).
    # Well past the tolerance, so greedy decoding cannot pass (an entropy bound alone does not rule it out:
    # p(argmax) = 0.95 with the rest spread over ten tokens has entropy 0.31, and an argmax distance of 0.05)
    argmax_tv = 1.0 - float(dists[i].max())
    assert argmax_tv > 2 * tol, (ent[i], argmax_tv)
    n = 1500
    res = presto.generate([prompts[i]] * n, search="beam", tree_budget=32, max_tokens=1, temperature=1.0,
                          seed=7, batch_size=500)
    hist = torch.bincount(torch.tensor([r.token_ids[0] for r in res]), minlength=dists[i].numel()).double() / n
    tv = 0.5 * float((hist - dists[i]).abs().sum())
    assert tv < tol, (ent[i], argmax_tv, tv)


def test_bad_models_and_options_are_rejected(presto):
    llada = ReferenceDLLM.from_pretrained(DEFAULT_DLLM)
    with pytest.raises(ValueError, match="target must be an autoregressive"):
        PrestoEngine(llada, presto.drafter)
    with pytest.raises(ValueError, match="drafter must be a block-diffusion"):
        PrestoEngine(presto.target, llada)
    with pytest.raises(ValueError, match="search 'dfs'; allowed: ar, linear, beam, best_first"):
        presto.generate([[5, 6]], search="dfs")
    with pytest.raises(ValueError, match="exceeds the models' context"):
        presto.generate([[5] * 500], search="beam")


@pytest.mark.slow
def test_cli_presto_and_linear(capsys):
    assert main(["generate", "--method", "presto", "--json", "--prompt", "Reverse the list: 1 2 3",
                 "--config", '{"tree_budget": 32}']) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["accept_len"] == pytest.approx(len(row["token_ids"]) / row["nfe"]) and row["nfe"] >= 1
    assert main(["eval", "--method", "linear", "--limit", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["method"] == "linear" and res["accept_len"] >= 1
    assert main(["generate", "--method", "presto", "--config", '{"search": "dfs"}']) == 2
    assert "allowed: linear, beam, best_first" in capsys.readouterr().err
    assert main(["generate", "--method", "presto", "--model", str(DEFAULT_DLLM)]) == 2
    assert "allowed:" in capsys.readouterr().err
