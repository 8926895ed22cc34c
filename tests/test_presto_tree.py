"""PRESTO building blocks: the n-gram prefix scorer, tree construction (Alg. 1, Alg. 2), and verification rules."""

import itertools
import json

import pytest
import torch

from model_executor.decoding.ngram import NGramModel
from model_executor.decoding.tree import (TokenTree, accept_greedy, accept_sampling, adaptive_lambda, build_tree)


# ------------------------------------------------------------------------------------------ n-gram scorer
def test_ngram_is_a_distribution_and_learns_online(tmp_path):
    m = NGramModel.fit([[1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 4]], n=3, vocab_size=8)
    r = m.request()
    for ctx in [(), (2,), (2, 3), (7, 7)]:
        lp = r.logprobs(ctx)
        assert lp.shape == (8,) and torch.isfinite(lp).all()
        assert abs(float(lp.exp().sum()) - 1) < 1e-12
    assert r.logprobs((2, 3)).argmax() == 4  # seen twice after (2, 3)
    before = float(r.logprobs((6, 6))[1])
    r.extend([6, 6, 1, 6, 6, 1])  # the request's own phrase
    assert float(r.logprobs((6, 6))[1]) > before + 1.0
    assert r.context((5,)) == (1, 5)
    assert float(m.request().logprobs((6, 6))[1]) == pytest.approx(before)  # other requests do not see it


def test_ngram_file_round_trip_and_errors(tmp_path):
    m = NGramModel.fit([[1, 2, 3, 1, 2, 4]], n=3, vocab_size=6)
    f = tmp_path / "ng.json"
    m.save(f)
    m2 = NGramModel.load(f)
    for ctx in [(), (1,), (1, 2), (3, 1)]:
        assert torch.equal(m.request().logprobs(ctx), m2.request().logprobs(ctx))
    with pytest.raises(FileNotFoundError, match="no such file"):
        NGramModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid n-gram file"):
        NGramModel.load(tmp_path / "bad.json")
    d = json.loads(f.read_text())
    d["version"] = 99
    (tmp_path / "v.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="version 99"):
        NGramModel.load(tmp_path / "v.json")
    d["version"] = 1
    d["tokens"][0][0] = 77
    (tmp_path / "t.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="bad entry"):
        NGramModel.load(tmp_path / "t.json")


# ------------------------------------------------------------------------------------------ tree building
def _logq(k, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(k, V, generator=g, dtype=torch.float64) * 2, -1)


def _rho(V, seed=1):
    g = torch.Generator().manual_seed(seed)
    table = {}

    def log_rho(path):
        if path not in table:
            table[path] = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
        return table[path]
    return log_rho


def _closed(tree: TokenTree) -> bool:
    return all(p < i for i, p in enumerate(tree.parent))


def test_best_first_scores_follow_eq8_and_expands_the_best_prefixes_first():
    """Node scores are Eq. 8's path scores; scores never increase along a path, so Alg. 2's pops are the best
    prefixes in order and the ``B // V`` best prefixes overall are always in the tree."""
    k, V, B, lam = 3, 5, 30, 0.3
    logq, rho = _logq(k, V), _rho(V)
    tree = build_tree(logq, rho, budget=B, search="best_first", lam=lam, top_b=V, candidates=V)
    scores = {}
    for d in range(1, k + 1):
        for path in itertools.product(range(V), repeat=d):
            scores[path] = sum(float(logq[i, t]) + lam * float(rho(path[:i])[t]) for i, t in enumerate(path))
    paths = [tree.path(i) for i in range(len(tree))]
    assert all(abs(tree.score[i] - scores[p]) < 1e-9 for i, p in enumerate(paths))
    assert set(sorted(scores, key=lambda p: -scores[p])[: B // V]) <= set(paths)
    assert len(tree) == B and _closed(tree)


@pytest.mark.parametrize("search", ["beam", "best_first"])
def test_trees_respect_the_budget_and_stay_connected(search):
    for seed in range(5):
        logq = _logq(16, 40, seed)
        for B in (1, 5, 16, 64):
            t = build_tree(logq, _rho(40, seed), budget=B, search=search, width=10, top_b=10)
            assert len(t) == B and _closed(t)
            assert len(set(t.path(i) for i in range(len(t)))) == B
            assert max(t.depth) <= 16


def test_linear_is_the_top1_chain_and_lambda_changes_the_ranking():
    logq = _logq(6, 30)
    t = build_tree(logq, None, budget=4, search="linear")
    assert t.tokens == logq.argmax(-1)[:4].tolist() and t.parent == [-1, 0, 1, 2]
    rho = _rho(30)
    plain = build_tree(logq, None, budget=32, search="beam")
    corrected = build_tree(logq, rho, budget=32, search="beam", lam=1.0)
    assert {plain.path(i) for i in range(32)} != {corrected.path(i) for i in range(32)}
    lam = adaptive_lambda(logq, beta=0.4, c=1.0)
    assert lam.shape == (6,) and bool(((lam > 0) & (lam < 0.4)).all())
    with pytest.raises(ValueError, match="search 'dfs'; allowed: linear, beam, best_first"):
        build_tree(logq, None, budget=4, search="dfs")


# ------------------------------------------------------------------------------------------ verification
def _toy_target(V, seed=3):
    """A deterministic 'model': distribution of the next token as a function of the whole context."""
    def probs(ctx):
        g = torch.Generator().manual_seed(hash((seed,) + tuple(ctx)) % (2**31))
        return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    return probs


def _target_rows(tree, ctx, probs):
    return torch.stack([probs(ctx)] + [probs(ctx + list(tree.path(i))) for i in range(len(tree))])


def test_greedy_acceptance_reproduces_greedy_decoding():
    V = 6
    probs = _toy_target(V)
    for seed in range(20):
        ctx = [seed % V]
        greedy = []
        for _ in range(8):
            greedy.append(int(probs(ctx + greedy).argmax()))
        tree = build_tree(_logq(8, V, seed), None, budget=24, search="beam", width=4, top_b=3)
        out, nodes = accept_greedy(tree, _target_rows(tree, ctx, probs).argmax(-1))
        assert out == greedy[: len(out)] and len(out) == len(nodes) + 1
        assert [tree.tokens[i] for i in nodes] == out[:-1]


def test_tree_sampling_is_lossless():
    """Over many draws, the first two emitted tokens follow the target's own distribution (deterministic
    candidates whose drafter disagrees with the target)."""
    V, n = 4, 30000
    probs = _toy_target(V, seed=11)
    ctx = [0]
    tree = build_tree(_logq(2, V, 5), None, budget=6, search="beam", width=3, top_b=2)
    rows = _target_rows(tree, ctx, probs)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(n):
        out, _ = accept_sampling(tree, rows, g)
        if len(out) < 2:  # the second token comes from the target directly
            out = out + [int(torch.multinomial(probs(ctx + out), 1, generator=g))]
        counts[out[0], out[1]] += 1
    want = torch.stack([probs(ctx)[a] * probs(ctx + [a]) for a in range(V)])
    tv = 0.5 * float((counts / n - want).abs().sum())
    assert tv < 0.02, tv
