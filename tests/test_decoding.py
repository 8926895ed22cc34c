"""Decoding methods on the embedded model: exactness where the papers promise it (float64), and unit rules."""

import pytest
import numpy as np
import torch

from model_executor.decoding import DraftDAG, make_decoder
from model_executor.decoding.policies import localleap_policy
from psd_plugin import DEFAULT_DLLM
from psd_plugin.evaluate import encode
from psd_plugin.train.tasks import load_heldout


@pytest.fixture(scope="module")
def static_out(engine64, mixed_prompts):
    return engine64.generate(mixed_prompts, method="static")


@pytest.mark.parametrize("steps", [3, 8])
def test_freedave_is_lossless_wrt_static(engine64, mixed_prompts, static_out, steps):
    out = engine64.generate(mixed_prompts, method="freedave", steps=steps)
    assert [r.token_ids for r in out] == [r.token_ids for r in static_out]
    assert sum(r.nfe for r in out) < sum(r.nfe for r in static_out)
    single = engine64.generate(mixed_prompts[:3], method="freedave", steps=steps, batch_size=1)
    assert [r.token_ids for r in single] == [r.token_ids for r in static_out[:3]]


def test_freedave_one_step_is_static(engine64, mixed_prompts, static_out):
    out = engine64.generate(mixed_prompts, method="freedave", steps=1)
    assert [(r.token_ids, r.nfe) for r in out] == [(r.token_ids, r.nfe) for r in static_out]


def test_lopa_branch_scores_do_not_depend_on_the_reduction_order():
    """LoPA's Eq. 2 (:func:`~model_executor.decoding.lopa.branch_scores`) gives the same scores, bit for bit,
    whatever order a reduction adds a branch's top-1 confidences in (float32, as the engines compute them from
    any model dtype; each at least 1 / V): an accelerator's reduction and the host's pick the same branch. In
    float32 the orders disagree on these same inputs."""
    from model_executor.decoding.lopa import branch_scores

    g = torch.Generator().manual_seed(0)
    for V in (512, 126_464, 1 << 21):
        # top-1 confidences spread over [1/V, 1] on a log scale, 4 branches of up to 64 positions
        conf = torch.exp(-torch.rand(2000, 4, 64, generator=g) * np.log(V))
        masked = torch.rand(2000, 4, 64, generator=g) < 0.7
        masked[..., 0] = True
        want = branch_scores(conf, masked)
        f32 = torch.where(masked, conf.float(), 0.0).sum(-1)
        moved = False
        for _ in range(3):
            perm = torch.randperm(64, generator=g)
            assert torch.equal(branch_scores(conf[..., perm], masked[..., perm]), want)
            moved |= not torch.equal(torch.where(masked[..., perm], conf[..., perm].float(), 0.0).sum(-1), f32)
        assert moved  # float32 sums do depend on the order here


@pytest.mark.parametrize("policy", ["static", "confidence", "localleap"])
def test_zero_depth_psd_and_zero_branch_lopa_are_their_policy(engine64, mixed_prompts, policy):
    base = engine64.generate(mixed_prompts, method=policy)
    psd = engine64.generate(mixed_prompts, method="psd", policy=policy, depth=0)
    lopa = engine64.generate(mixed_prompts, method="lopa", policy=policy, branches=0)
    skip = engine64.generate(mixed_prompts, method="psd", policy=policy, depth=0, dag_shape="skip")
    want = [(r.token_ids, r.nfe) for r in base]
    assert [(r.token_ids, r.nfe) for r in psd] == want
    assert [(r.token_ids, r.nfe) for r in skip] == want
    assert [(r.token_ids, r.nfe) for r in lopa] == want


def test_psd_drafts_save_forwards(engine64, mixed_prompts):
    conf = engine64.generate(mixed_prompts, method="confidence")
    psd = engine64.generate(mixed_prompts, method="psd", policy="confidence", depth=3)
    assert sum(r.nfe for r in psd) < sum(r.nfe for r in conf)
    st = psd[0].stats
    assert len(st["node_tried"]) == 4 and all(a <= t for a, t in zip(st["node_accepted"], st["node_tried"]))


def test_psd_takes_at_least_the_bound_pareto_reports(engine64, mixed_prompts):
    """benchmarks/pareto.py's PSD bound: where PSD(confidence) decodes confidence's tokens, each block that
    confidence does not finish in one forward takes PSD at least two (its first forward has no drafts)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pareto", Path(__file__).parents[1] / "benchmarks" / "pareto.py")
    pareto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pareto)
    conf = engine64.generate(mixed_prompts, method="confidence")
    psd = engine64.generate(mixed_prompts, method="psd", policy="confidence", depth=7)
    checked = 0
    for p, c, d in zip(mixed_prompts, conf, psd):
        steps, floor = pareto.draft_bound_steps(engine64, [p], 8, 32)
        assert steps == c.nfe  # the recorder counts confidence's forwards
        assert floor <= steps
        if d.token_ids == c.token_ids:
            assert d.nfe >= floor, (p, d.nfe, floor)
            checked += 1
    assert checked >= len(mixed_prompts) // 2


def test_localleap_rule():
    inf = float("-inf")
    conf = torch.tensor([0.8, 0.95, 0.7, 0.8, inf, 0.5, 0.6, 0.8, 0.76], dtype=torch.float64)
    got = localleap_policy(conf, threshold=0.9, relaxed_threshold=0.75, radius=2).tolist()
    #            0     1(anchor) 2(<.75) 3(near)  4(done) 5     6     7(far) 8(far)
    assert got == [True, True, False, True, False, False, False, False, False]
    assert localleap_policy(torch.tensor([0.1, 0.3]), 0.9, 0.75, 4).tolist() == [False, True]


def _logits_for(tokens, conf, V=8):
    """Logits whose argmax is ``tokens`` with softmax probability ``conf`` (conf > 1/V)."""
    L = len(tokens)
    out = torch.zeros(L, V, dtype=torch.float64)
    for i, (t, c) in enumerate(zip(tokens, conf)):
        other = (1 - c) / (V - 1)
        out[i] = torch.log(torch.full((V,), other, dtype=torch.float64))
        out[i, t] = torch.log(torch.tensor(c, dtype=torch.float64))
    return out


def _step(dec, logits):
    """One step of ``dec`` alone through the engines' interface, from the logits ``[L, V]`` of its canvases."""
    from model_executor.decoding import predict_rows, propose_all, update_all

    (prop,) = propose_all([dec])
    assert len(logits) == len(prop.canvases)
    L = dec.state.numel()
    preds = predict_rows(torch.cat(logits), mask_id=dec.mask_id)
    update_all([dec], [prop], preds, [[k * L for k in range(len(logits))]])


@pytest.mark.parametrize("impl", ["decoder", "oracle"])
def test_psd_hierarchical_acceptance_by_hand(impl):
    """Block of 4 masks (id 7); confidence τ=0.9; nested DAG of depth 2 (the batched decoder and its oracle)."""
    from model_executor.decoding import propose_all
    from oracles.decoders import make_oracle

    M = 7
    dec = (make_decoder if impl == "decoder" else make_oracle)("psd", torch.full((4,), M), M, policy="confidence",
                                                                depth=2, threshold=0.9)
    canvases = dec.canvases if impl == "oracle" else lambda: propose_all([dec])[0].canvases
    step = dec.update if impl == "oracle" else lambda logits: _step(dec, logits)
    assert len(canvases()) == 1
    step([_logits_for([1, 2, 3, 4], [0.95, 0.5, 0.6, 0.4])])  # stage 1 commits pos 0
    assert dec.state.tolist() == [1, M, M, M]
    drafts = canvases()  # σ = (2, 1, 3): root, {2}, {2, 1}
    assert [d.tolist() for d in drafts] == [[1, M, M, M], [1, M, 3, M], [1, 2, 3, M]]
    # root's verifier agrees with token 3 at pos 2 with confidence 0.97 -> node 1 accepted;
    # node 1's verifier predicts 5 (not 2) at pos 1 -> node 2 rejected; k* = node 1, then L26 on its output
    step([_logits_for([1, 0, 3, 4], [0.5, 0.6, 0.97, 0.3]),
          _logits_for([1, 5, 3, 4], [0.5, 0.95, 0.5, 0.3]),
          _logits_for([1, 2, 3, 4], [0.5, 0.99, 0.5, 0.99])])
    assert dec.state.tolist() == [1, 5, 3, M]  # node 1 + its own confident prediction at pos 1
    assert dec.stats()["node_accepted"] == [0, 1, 0]


@pytest.mark.parametrize("impl", ["decoder", "oracle"])
def test_psd_skip_dag_accepts_past_a_rejected_rank(impl):
    """The skip DAG of depth 2 (root, {0}, {1}, {0, 1}): σ's first rank is rejected, its second accepted from the
    root, so the decoder advances to {1} and commits from {1}'s output (the chain would stop at the root)."""
    from model_executor.decoding import propose_all
    from oracles.decoders import make_oracle

    M = 7
    if impl == "decoder":
        dec = make_decoder("psd", torch.full((4,), M), M, policy="confidence", depth=2, dag_shape="skip")
    else:
        dec = make_oracle("psd", torch.full((4,), M), M, policy="confidence", dag=DraftDAG.skip(2))
    canvases = dec.canvases if impl == "oracle" else lambda: propose_all([dec])[0].canvases
    step = dec.update if impl == "oracle" else lambda logits: _step(dec, logits)
    step([_logits_for([1, 2, 3, 4], [0.95, 0.5, 0.6, 0.4])])  # commits pos 0; σ = (2, 1, 3)
    drafts = canvases()
    assert [d.tolist() for d in drafts] == [[1, M, M, M], [1, M, 3, M], [1, 2, M, M], [1, 2, 3, M]]
    step([_logits_for([1, 2, 0, 4], [0.5, 0.95, 0.6, 0.3]),  # root: rejects rank 0 (pos 2), accepts rank 1
          _logits_for([1, 5, 3, 4], [0.5, 0.5, 0.5, 0.3]),
          _logits_for([1, 2, 3, 4], [0.5, 0.5, 0.5, 0.99]),  # {1}: pos 2 unsure -> {0, 1} rejected; pos 3 sure
          _logits_for([1, 2, 3, 4], [0.5, 0.5, 0.5, 0.5])])
    assert dec.state.tolist() == [1, 2, M, 4]
    assert dec.stats()["node_accepted"] == [0, 0, 1, 0]


def test_skip_dag_shape():
    for d in range(6):
        dag = DraftDAG.skip(d)
        assert len(dag.sets) == DraftDAG.size("skip", d) == 1 + d * (d + 1) // 2
        assert len(set(dag.sets)) == len(dag.sets)
        nested = DraftDAG.nested(d).sets
        assert set(nested) <= set(dag.sets)  # the chain is in it
        for k, (s, ps) in enumerate(zip(dag.sets, dag.parents)):  # parents: every node one rank smaller
            assert {dag.sets[p] for p in ps} == {t for t in dag.sets[:k] if t < s and len(t) == len(s) - 1}
    assert DraftDAG.skip(1) == DraftDAG.nested(1)


def test_skip_dag_takes_fewer_forwards_than_the_chain(engine64, mixed_prompts):
    chain = engine64.generate(mixed_prompts, method="psd", policy="confidence", depth=3, block_size=16)
    skip = engine64.generate(mixed_prompts, method="psd", policy="confidence", depth=3, dag_shape="skip",
                             block_size=16)
    assert sum(r.nfe for r in skip) < sum(r.nfe for r in chain)
    assert skip[0].stats["node_tried"].__len__() == 7
    with pytest.raises(ValueError, match=r"generate.depth 11 with dag_shape 'skip' would draft 66 canvases a step; "
                                         r"allowed: depth 0-10 \(or dag_shape 'chain'\)"):
        engine64.generate(mixed_prompts[:1], method="psd", depth=11, dag_shape="skip")


def test_draft_dag_validation():
    with pytest.raises(ValueError, match="root"):
        DraftDAG((frozenset({0}),), ((),))
    with pytest.raises(ValueError, match="strict superset"):
        DraftDAG((frozenset(), frozenset({0}), frozenset({1})), ((), (0,), (1,)))
    with pytest.raises(ValueError, match="method 'nope'; allowed: static, confidence, localleap, lopa"):
        make_decoder("nope", torch.zeros(2, dtype=torch.long), 0)


@pytest.fixture(scope="module")
def shipped_graph():
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    return load_graph(default_graph(DEFAULT_DLLM, "static"))


@pytest.mark.parametrize("policy", ["static", "confidence"])
def test_spiffy_is_lossless_wrt_its_base_policy(engine64, mixed_prompts, policy):
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    graph = load_graph(default_graph(DEFAULT_DLLM, policy))
    base = engine64.generate(mixed_prompts, method=policy)
    out = engine64.generate(mixed_prompts, method="spiffy", policy=policy, graph=graph, budget=3)
    assert [r.token_ids for r in out] == [r.token_ids for r in base]
    assert sum(r.nfe for r in out) < sum(r.nfe for r in base)
    st = out[0].stats
    assert len(st["node_tried"]) == len(graph.nodes)


def test_calibration_graph_shape(engine64, tokenizer_dir, shipped_graph):
    from transformers import AutoTokenizer

    from psd_plugin.calibrate import calibrate_graph, default_calibration_prompts

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    calib = [encode(tok, p) for p in default_calibration_prompts(12)]
    held = {r["prompt"] for r in load_heldout()}
    assert not set(default_calibration_prompts(12)) & held
    g = calibrate_graph(engine64, calib, model_name="llada-tiny", policy="static", lookahead=3, budget=6,
                        progress=False)
    assert len(g.nodes) == 6 and g.block_size == 8 and g.base_policy == "static"
    for k, n in enumerate(g.nodes):  # Eq. 24: levels 1-2 are roots, deeper nodes hang on a chosen parent
        assert n.level <= 2 or n.parents
        for p in n.parents:
            assert set(g.nodes[p].formula) < set(n.formula)
    assert shipped_graph.model == "llada-tiny" and len(shipped_graph.nodes) == 10


def test_graph_file_errors(tmp_path, shipped_graph):
    from model_executor.decoding import load_graph
    from model_executor.decoding import save_graph

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_graph(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid draft graph file"):
        load_graph(bad)
    import msgspec

    g = msgspec.structs.replace(shipped_graph, format_version=99)
    save_graph(g, bad)
    with pytest.raises(ValueError, match="format_version 99"):
        load_graph(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_predictions_equal_the_softmax_per_canvas(dtype):
    """The engines' one batched pass (argmax and its probability) and the top-k at a few rows equal a softmax,
    and each canvas's slice gives the prediction its bare logits would."""
    from model_executor.decoding.base import predict, predict_rows, top_token_gaps
    from model_executor.decoding.spiffy import top_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, 1000, generator=g) * 4).to(dtype)
    rows = predict_rows(logits, mask_id=7)  # the engines' call: the mask token (7) excluded in place
    assert (logits[:, 7] == float("-inf")).all()
    probs = torch.softmax(logits.double(), -1)
    assert torch.equal(rows.tokens, logits.argmax(-1))
    assert rows.conf.dtype == dtype
    assert torch.allclose(rows.conf.double(), probs.max(-1).values, rtol=1e-5 if dtype == torch.float32 else 1e-12)
    at = torch.tensor([3, 9, 4, 20])
    ids, gaps = top_token_gaps(logits, at, rows.tokens[at], 5)  # what Spiffy asks at a few rows
    assert torch.equal(torch.cat([rows.tokens[at, None], ids], 1), probs[at].topk(5, -1).indices)
    lp = top_logprobs(rows.conf[at], gaps)  # their log-probabilities: log(conf) + the logit gaps
    assert lp.dtype == torch.float64
    assert torch.allclose(lp, probs[at].topk(5, -1).values.log(), rtol=1e-5 if dtype == torch.float32 else 1e-12)
    assert np.array_equal(top_logprobs(rows.conf[at].numpy(), gaps.numpy()), lp.numpy())  # the same on the host
    state = torch.full((8,), 7)
    state[[1, 4]] = 3  # decoded positions
    for a in (0, 8, 16):
        got, want = predict(rows[a: a + 8], state, 7), predict(logits[a: a + 8], state, 7)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.conf, want.conf)
        assert got.logits.data_ptr() == logits[a].data_ptr()  # the canvas's rows, not a copy
        assert got.conf[1] == float("-inf") and got.conf[4] == float("-inf") and bool((got.conf[[0, 2]] > 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["static", "confidence", "localleap"])
def test_half_precision_commits_equal_a_float64_softmax(name, dtype):
    """From bfloat16 / float16 logits every policy commits what a float64 softmax of the same logits commits,
    near its thresholds and between near-ties: the confidences are computed in float32 (in bfloat16 they move
    in steps of about 0.004 near 0.9, and everything above about 0.996 is 1.0)."""
    from model_executor.decoding.base import predict_rows
    from model_executor.decoding.policies import make_policy

    g = torch.Generator().manual_seed(5)
    L, V, M = 16, 512, 511  # M: the mask token
    rule = make_policy(name, threshold=0.9, relaxed_threshold=0.75, radius=2)
    # one dominant logit t over zeros: confidence e^t / (e^t + V - 2) swept across 0.75, 0.9 and 0.996..1
    target = torch.tensor([0.7, 0.74, 0.749, 0.751, 0.76, 0.89, 0.898, 0.8995, 0.9005, 0.902, 0.95, 0.9965, 0.997,
                           0.998, 0.999, 0.9995], dtype=torch.float64)
    grid = torch.log(target * (V - 2) / (1 - target))
    flips = 0
    for trial in range(60):
        logits = torch.randn(L, V, generator=g, dtype=torch.float64) * 0.05
        peaks = grid[torch.randint(len(grid), (L,), generator=g)] + torch.randn(L, generator=g, dtype=torch.float64) * 0.01
        logits[torch.arange(L), torch.randint(M, (L,), generator=g)] += peaks
        logits = logits.to(dtype)
        if trial % 3 == 0:
            logits[5] = logits[9]  # an exact tie: the lower position first, in both
        decoded = torch.rand(L, generator=g) < 0.2
        rows = predict_rows(logits.clone(), mask_id=M)
        assert rows.conf.dtype == torch.float32
        ref = logits.double()
        ref[:, M] = float("-inf")
        p64 = torch.softmax(ref, -1).max(-1)
        assert torch.equal(rows.tokens, p64.indices)
        got = rule(rows.conf.masked_fill(decoded, float("-inf")))
        want = rule(p64.values.masked_fill(decoded, float("-inf")))
        assert torch.equal(got, want), (trial, got.nonzero().flatten().tolist(), want.nonzero().flatten().tolist())
        # the same rows in the logits' own dtype would have decided differently somewhere (the test bites)
        own = torch.softmax(logits.masked_fill(torch.arange(V) == M, float("-inf")), -1).max(-1).values
        flips += not torch.equal(rule(own.masked_fill(decoded, float("-inf"))), want)
    assert flips > 0


@pytest.mark.parametrize("name", ["static", "confidence", "localleap"])
def test_policies_over_a_batch_of_blocks_equal_them_block_by_block(name):
    """``[R, L]`` confidences (decoded positions and padding at -inf, ties included) give each row's own result."""
    from model_executor.decoding.policies import make_policy

    g = torch.Generator().manual_seed(4)
    conf = torch.rand(9, 12, generator=g, dtype=torch.float64).round(decimals=1)  # ties
    conf[torch.rand(9, 12, generator=g) < 0.4] = float("-inf")
    conf[3] = float("-inf")  # a block with nothing left
    rule = make_policy(name, threshold=0.7, relaxed_threshold=0.4, radius=2)
    assert torch.equal(rule(conf), torch.stack([rule(c) for c in conf]))


def _masked_blocks(lens: list[int], mask_id: int, g: torch.Generator) -> list[torch.Tensor]:
    """Blocks of ``lens`` tokens below ``mask_id``, about 60% of their positions masked."""
    blocks = []
    for n in lens:
        b = torch.randint(0, mask_id, (n,), generator=g)
        b[torch.rand(n, generator=g) < 0.6] = mask_id
        blocks.append(b)
    return blocks


POLICY_KNOBS = [("static", {}), ("confidence", {"threshold": 0.7}), ("confidence", {"threshold": 0.9}),
                ("localleap", {"threshold": 0.7, "relaxed_threshold": 0.4, "radius": 2}),
                ("localleap", {"threshold": 0.8, "relaxed_threshold": 0.5, "radius": 0}),
                ("localleap", {"threshold": 0.6, "relaxed_threshold": 0.3, "radius": 40})]


@pytest.mark.parametrize("name, knobs", POLICY_KNOBS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POLICY_KNOBS)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_device_form_of_a_policy_decides_as_its_numpy_form(name, knobs, dtype):
    """:func:`device_policy` (tensor ops, for confidences on a device) commits exactly what the numpy rules commit:
    ties (rounded confidences, first position wins), values at the threshold itself, decoded positions and
    padding (-inf), rows with nothing left, every dtype the engines produce, blocks of several lengths."""
    from model_executor.decoding.policies import device_policy, make_policy

    rule = make_policy(name, **knobs)
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        R, L = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        conf = torch.rand(R, L, generator=g, dtype=torch.float64)
        if trial % 2:
            conf = conf.round(decimals=1)  # ties, and values equal to a threshold
        conf = conf.to(dtype)
        conf[torch.rand(R, L, generator=g) < 0.4] = float("-inf")
        if R > 2:
            conf[1] = float("-inf")  # a block with nothing left
        if trial % 4 == 3:  # one block [L], or several canvases per block [R, K, L]
            conf = conf[0] if trial % 8 == 3 else conf.view(R, 1, L).expand(R, 2, L).clone()
        want = rule(conf)
        got = device_policy(conf, name, **knobs)
        assert got.dtype == torch.bool and torch.equal(got, want), (trial, name, dtype)
    assert torch.equal(device_policy(torch.zeros(3, 0), name, **knobs), torch.zeros(3, 0, dtype=torch.bool))
    if dtype == torch.float16 and name != "static":  # a threshold just past a float16 midpoint: cast as numpy does
        conf = torch.tensor([0.8994140625, 0.89990234375, 0.1], dtype=dtype)
        knobs = {**knobs, "threshold": 0.8996582040563226}
        assert torch.equal(device_policy(conf, name, **knobs), make_policy(name, **knobs)(conf))


@pytest.mark.parametrize("name", ["static", "confidence", "localleap"])
def test_a_policy_step_on_the_device_is_the_host_step_without_a_host_read(name):
    """:func:`commit_rows` with the predictions "on the device" (``tests/device_proxy.py``): the states equal
    :meth:`PolicyDecoder.update_batch`'s (the host's numpy commit) over blocks of several lengths, and nothing of
    the device is read on the host: the policy dispatches to its tensor form where the confidences are."""
    from model_executor.decoding import PolicyDecoder, predict_rows, propose_all, update_all
    from model_executor.decoding.base import canvas_row_index, pad_rows
    from model_executor.decoding.policies import commit_rows, make_policy

    from device_proxy import DeviceProxy, mark
    from sync_audit import SyncAudit

    M, V = 7, 11
    g = torch.Generator().manual_seed(6)
    kw = dict(threshold=0.45, relaxed_threshold=0.2, radius=1)
    for trial in range(12):
        lens = [int(n) for n in torch.randint(1, 10, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)]
        blocks = _masked_blocks(lens, M, g)
        logits = torch.randn(sum(lens), V, generator=g, dtype=torch.float32) * 2
        if trial % 3 == 0:
            logits = logits.round()  # ties between positions' confidences
        preds = predict_rows(logits.clone(), mask_id=M)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        decs = [PolicyDecoder(b.clone(), M, make_policy(name, **kw)) for b in blocks]
        rows = canvas_row_index(decs, [[a] for a in starts], 1)[:, 0]
        states = pad_rows([d.state for d in decs], -1)
        update_all(decs, propose_all(decs), preds, [[a] for a in starts])
        with DeviceProxy() as proxy, SyncAudit(device_only=True) as audit:
            got = commit_rows(make_policy(name, **kw), mark(preds.tokens), mark(preds.conf), mark(rows),
                              mark(states), M)
            on = got.device.type
        assert on == "cuda" and not proxy.reads and not proxy.copies, (proxy.reads, proxy.copies)
        assert not audit.sites, audit.report()
        got = got.as_subclass(torch.Tensor)
        for r, d in enumerate(decs):
            assert torch.equal(got[r, : d.state.numel()], d.state), (trial, r)
            assert (got[r, d.state.numel():] == -1).all()


def test_policy_decisions_taken_ahead_are_the_update(monkeypatch):
    """:func:`launch_all` (the decisions taken where the predictions are, nothing stepped, their copy queued) gives
    each decoder the next state :func:`update_all` then steps it to, and that update takes the queued copy instead
    of deciding again; both equal the host's step. A block whose predictions hold a NaN fails that update, and no
    decoder of its group is stepped (the engines then step each alone, deciding again)."""
    from model_executor.decoding import predict_rows, propose_all, update_all
    from model_executor.decoding import policies as pol
    from model_executor.decoding.base import decides_ahead, launch_all

    M, V = 7, 11
    g = torch.Generator().manual_seed(9)
    kw = dict(threshold=0.45, relaxed_threshold=0.2, radius=1)
    commits = []
    original = pol.commit_rows
    monkeypatch.setattr(pol, "commit_rows", lambda *a: commits.append(1) or original(*a))
    for trial in range(10):
        lens = [int(n) for n in torch.randint(1, 10, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)]
        blocks = _masked_blocks(lens, M, g)
        names = [("confidence", "static", "localleap")[int(i)] for i in torch.randint(0, 3, (len(lens),), generator=g)]
        logits = torch.randn(sum(lens), V, generator=g) * 2
        starts = [[sum(lens[:i])] for i in range(len(lens))]
        host = [make_decoder(m, b, M, **kw) for m, b in zip(names, blocks)]
        update_all(host, propose_all(host), predict_rows(logits.clone(), mask_id=M), starts)
        ahead = [make_decoder(m, b, M, **kw) for m, b in zip(names, blocks)]
        assert decides_ahead(ahead)
        preds = predict_rows(logits.clone(), mask_id=M, on_device=True)
        props = propose_all(ahead)
        commits.clear()
        nexts = launch_all(ahead, props, preds, starts)
        launched = len(commits)
        assert launched == len(preds.launched) >= 1 and all(d.t == 0 for d in ahead)  # nothing stepped yet
        update_all(ahead, props, preds, starts)
        assert len(commits) == launched and not preds.launched  # the update took the queued copies
        for h, d, n in zip(host, ahead, nexts):
            assert torch.equal(d.state, h.state) and torch.equal(n, h.state[None]), trial  # its one canvas
    # a NaN in one block's predictions: its group's update raises, none of that group stepped
    logits[0, 0] = float("nan")
    ahead = [make_decoder("confidence", b, M, **kw) for b in blocks]
    preds = predict_rows(logits.clone(), mask_id=M, on_device=True)
    launch_all(ahead, propose_all(ahead), preds, starts)
    with pytest.raises(RuntimeError, match="non-finite"):
        update_all(ahead, propose_all(ahead), preds, starts)
    assert all(d.t == 0 for d in ahead)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
@pytest.mark.parametrize("method", ("psd", "lopa", "freedave", "joint_threshold", "spiffy"))
def test_drafts_taken_ahead_are_the_update_and_the_proposal(method, device):
    """PSD's, LoPA's, FreeDave's, joint_threshold's and Spiffy's ``launch_batch``: their decisions, taken where the
    predictions are, are the update's (which takes their queued copy), and the next step's canvases made there
    (PSD's drafts, LoPA's branches, FreeDave's k-step jumps, joint_threshold's next state with its edits,
    Spiffy's draft graph instantiated, scored and pruned) are :func:`propose_all`'s after that update, bit for
    bit, at most as many as ``canvases_ahead`` lays out: on ties in the confidences (logits on a coarse grid),
    tokens banned to -inf, chain and skip DAGs and LoPA's branch counts of every depth, Spiffy's graphs with
    budgets of one to four mixed in a step, every mask count down to the block's end, blocks of mixed lengths and
    policies in one step. On CUDA (``-m gpu``) the decisions and canvases are the GPU's, the proposal the host's:
    what a step laid out ahead relies on."""
    import copy

    from model_executor.decoding import predict_rows, propose_all, update_all
    from model_executor.decoding.base import decides_ahead, launch_all

    M, V = 7, 9
    g = torch.Generator().manual_seed(5)
    compared = drafted = 0
    for trial in range(40):
        n = int(torch.randint(1, 6, (1,), generator=g))
        lens = [int(x) for x in torch.randint(1, 12, (n,), generator=g)]
        shape, depth = ("chain", "skip")[trial % 2], int(torch.randint(0, 5, (1,), generator=g))
        names = [("confidence", "static", "localleap")[int(i)] for i in torch.randint(0, 3, (n,), generator=g)]
        kw = [{}] * n
        if method == "spiffy":  # (its base steps: static and confidence)
            names = [p if p != "localleap" else "confidence" for p in names]
            graph = (_TOY_GRAPH, _TOY_GRAPH_SMALL)[trial % 3 == 2]
            kw = [dict(graph=graph, budget=int(b)) for b in torch.randint(1, 5, (n,), generator=g)]
        decs = [make_decoder(method, torch.full((L,), M), M, policy=p, threshold=0.5, relaxed_threshold=0.3,
                             radius=1, depth=depth, dag_shape=shape, branches=depth, steps=max(1, depth), **k)
                for p, L, k in zip(names, lens, kw)]
        assert decides_ahead(decs)
        launched = None
        while True:
            live = [d for d in decs if bool((d.state == M).any())]
            if not live:
                break
            props = propose_all(live)
            if launched is not None:  # the last step's canvases, assembled where its decisions were
                for d, p in zip(live, props):
                    if (c := launched.get(id(d))) is None:
                        continue
                    assert len(p.canvases) <= c.shape[0], (trial, len(p.canvases), c.shape)
                    assert torch.equal(torch.stack(p.canvases), c[: len(p.canvases)].cpu()), trial
                    compared += 1
                    drafted += len(p.canvases) > 1
            starts, at = [], 0
            for d, p in zip(live, props):
                starts.append([at + k * d.state.numel() for k in range(len(p.canvases))])
                at += len(p.canvases) * d.state.numel()
            logits = torch.randint(-2, 3, (at, V), generator=g).float()  # a coarse grid: ties everywhere
            logits[torch.rand(at, V, generator=g) < 0.2] = float("-inf")
            logits[:, 0] = 3.0  # (no row all -inf)
            host = copy.deepcopy(live)
            update_all(host, props, predict_rows(logits.clone(), mask_id=M), starts)
            preds = predict_rows(logits.clone().to(device), mask_id=M, on_device=True)
            nexts = launch_all(live, props, preds, starts)
            assert all(t.shape == (d.canvases_ahead(p), d.state.numel()) for t, p, d in zip(nexts, props, live))
            update_all(live, props, preds, starts)
            assert not preds.launched  # the update took the queued copies
            for h, d in zip(host, live):
                assert torch.equal(d.state, h.state) and d.t == h.t, trial
            launched = {id(d): t for d, t in zip(live, nexts)}
    assert compared > 60 and (drafted > 20 or method == "joint_threshold"), (compared, drafted)  # (one canvas)


def test_each_commit_is_credited_to_the_canvas_it_was_taken_from():
    """The canvas whose logits row each committed position's logprobs come from (``commit_canvases``). PSD: L26's
    commits from the best node's canvas, an accepted draft's position from the canvas of the parent that accepted
    it, walking back along the accepting parents (σ maps ranks to positions; a node not forwarded has no canvas).
    Spiffy: each of Alg. 1's passes from its own canvas, the first from the state's."""
    from model_executor.decoding import make_decoder
    from model_executor.decoding.spiffy import SpiffyDecoder

    M = 9
    psd = make_decoder("psd", torch.full((5,), M), M, depth=2)
    assert psd.commit_canvases() is None  # (no step yet: the state canvas)
    # nodes {}, {σ0}, {σ0, σ1}: node 2 accepted through node 1, node 1 through the root; all three forwarded
    psd.accepted_via = (2, np.array([0, 0, 1]), np.array([True, True, True]), np.array([3, 1, 0, 2, 4]))
    assert psd.commit_canvases().tolist() == [2, 1, 2, 0, 2]
    # node 1 the best (node 2 not accepted): σ0's position from the root's canvas, the rest from node 1's
    psd.accepted_via = (1, np.array([0, 0, -1]), np.array([True, True, True]), np.array([3, 1, 0, 2, 4]))
    assert psd.commit_canvases().tolist() == [1, 1, 1, 0, 1]

    sp = SpiffyDecoder.__new__(SpiffyDecoder)
    sp.mask_id, sp.state = M, torch.tensor([5, 6, 7, M])
    c0, c1, c2 = torch.tensor([M, M, M, M]), torch.tensor([5, M, M, M]), torch.tensor([5, 6, M, M])
    # pass 0 from the state commits position 0, equal to draft 0 (canvas 1); pass 1 from it commits position 1,
    # equal to draft 1 (canvas 2); pass 2 from canvas 2 commits position 2 and matches nothing
    sp.accepted_chain = (np.array([True, True, False]), np.array([0, 1, 0]), [c0, c1, c2])
    assert sp.commit_canvases()[:3].tolist() == [0, 1, 2]
    sp.accepted_chain = (np.array([False, False, False]), np.array([0, 0, 0]), [c0, c1, c2])
    assert sp.commit_canvases()[:3].tolist() == [0, 0, 0]


def test_a_decision_taken_ahead_that_raises_fails_its_request_alone(monkeypatch):
    """:func:`~model_executor.dllm_request.launch_step` as :func:`decode_step`'s update: where the batched launch
    raises for one request, each is launched alone, the one that raises is failed (``failed``), the others' next
    states are the batched step's, and :func:`update_step` then steps them and not it."""
    from model_executor.decoding import policies as pol
    from model_executor.decoding import propose_all
    from model_executor.dllm_request import DLLMRequest, decode_step, launch_step, update_step

    M, V = 7, 11
    g = torch.Generator().manual_seed(3)

    def requests():
        rs = [DLLMRequest([1, 2, 3 + i], 8, 4, lambda b: make_decoder("confidence", b, M, threshold=0.3), M, eos_id=5)
              for i in range(3)]
        return rs, [r.plan(propose_all([r.dec])[0]) for r in rs]

    logits = torch.randn(12, V, generator=g) * 3
    kept = torch.ones(12, dtype=torch.bool)
    firsts = [[0], [4], [8]]
    plain, steps = requests()
    decode_step(logits.clone(), kept, M, plain, steps, firsts)
    reqs, steps = requests()
    bad = reqs[1].dec
    commit = pol.PolicyDecoder._commit_on_device

    def failing(group, *a, **k):
        if bad in group:
            raise ValueError("this request's decision")
        return commit(group, *a, **k)

    monkeypatch.setattr(pol.PolicyDecoder, "_commit_on_device", staticmethod(failing))
    failed = {}
    preds, nexts = launch_step(logits.clone(), kept, M, reqs, steps, firsts, failed=failed)
    assert list(failed) == [1] and nexts[1] is None and all(r.dec.t == 0 for r in reqs)
    monkeypatch.setattr(pol.PolicyDecoder, "_commit_on_device", staticmethod(commit))
    update_step(preds, reqs, steps, firsts, failed=failed)
    for i in (0, 2):
        assert torch.equal(nexts[i][0], plain[i].dec.state) and torch.equal(reqs[i].dec.state, plain[i].dec.state)
        assert reqs[i].dec.t == 1
    assert reqs[1].dec.t == 0


def test_policy_decoders_update_together_as_they_do_alone(monkeypatch):
    """:func:`update_all`: policy decoders of blocks of different lengths, states and policies, updated in one
    batched step per policy, equal each decoder's oracle (the policy on one block)."""
    import sys

    from model_executor.decoding import PolicyDecoder, predict_rows, propose_all, update_all
    from oracles.decoders import make_oracle

    policies = sys.modules[PolicyDecoder.__module__]
    batches = []  # the decoders of each batched commit of greedy predictions
    grouped = policies.groups
    monkeypatch.setattr(policies, "groups", lambda items, key: (out := grouped(items, key),
                                                                batches.extend(len(i) for i in out))[0])

    M, V = 7, 11
    g = torch.Generator().manual_seed(5)
    lens = [4, 8, 3, 8, 6]
    methods = ["confidence", "static", "confidence", "localleap", "static"]
    blocks = _masked_blocks(lens, M, g)
    logits = torch.randn(sum(lens), V, generator=g, dtype=torch.float64) * 3
    preds = predict_rows(logits)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    kw = dict(threshold=0.5, relaxed_threshold=0.3, radius=2)
    together = [make_decoder(m, b, M, **kw) for m, b in zip(methods, blocks)]
    update_all(together, propose_all(together), preds, [[a] for a in starts])
    for dec, m, b, a in zip(together, methods, blocks, starts):
        alone = make_oracle(m, b, M, **kw)
        alone.update([logits[a: a + b.numel()]])
        assert torch.equal(dec.state, alone.state) and dec.state.numel() == b.numel(), m
        assert (dec.state != b).any()  # every block had masks: something committed
    assert sorted(batches) == [1, 2, 2]  # confidence x2, static x2, localleap alone


def _vllm_filtered(p: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The tokens vLLM's sampler keeps of the probabilities ``p``: ``min_p`` (an argmax-invariant logits processor,
    applied first), then ``top_k``, then ``top_p`` over what is left, renormalised."""
    keep = p >= min_p * p.max() if min_p else torch.ones(p.numel(), dtype=torch.bool)
    if top_k:
        keep &= p >= torch.where(keep, p, 0.0).topk(top_k).values[-1]
    if top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        srt, idx = (q / q.sum()).sort(descending=True)
        keep &= torch.zeros(p.numel(), dtype=torch.bool).scatter(0, idx, (srt.cumsum(0) - srt) < top_p)
    return keep


@pytest.mark.parametrize("temperature,flt", [(1.0, (0, 1.0, 0.0)), (0.7, (3, 1.0, 0.0)), (1.3, (0, 0.8, 0.0)),
                                             (1.0, (0, 1.0, 0.2)), (1.0, (0, 0.7, 0.2)), (1.0, (4, 0.8, 0.2))])
def test_sampled_tokens_follow_the_filtered_softmax(temperature, flt):
    """Over 20000 masked positions with the same logits, the sampled tokens' histogram is softmax(logits / T)
    restricted by (top_k, top_p, min_p) in vLLM's order (min_p, top_k, then top_p over what is left) and
    renormalised (each position draws its own counter-based noise); the mask token is never drawn. The combined
    filters are cases where min_p last (after top_k and top_p) would keep another set."""
    from model_executor.decoding import Sampling
    from model_executor.decoding.base import predict

    g = torch.Generator().manual_seed(0)
    V, N, mask = 12, 20000, 11
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    logits[mask] = 5.0  # the most likely token, were it allowed
    state = torch.full((N,), mask)
    pred = predict(logits.expand(N, V).clone(), state, mask, sampling=Sampling(temperature, 1, *flt), position0=40)
    counts = torch.bincount(pred.tokens, minlength=V).double() / N
    p = torch.softmax(torch.where(torch.arange(V) == mask, float("-inf"), logits) / temperature, -1)
    top_k, top_p, min_p = flt
    keep = _vllm_filtered(p, top_k, top_p, min_p)
    if min_p and top_p < 1.0:  # the order matters for these logits: min_p last keeps another set
        assert not torch.equal(_vllm_filtered(p, top_k, top_p, 0.0) & (p >= min_p * p.max()), keep)
    want = torch.where(keep, p, 0.0)
    want /= want.sum()
    assert counts[mask] == 0 and (counts[~keep] == 0).all()
    assert (counts - want).abs().max() < 0.012, (counts, want)
    assert keep.sum() < V - 1 or flt == (0, 1.0, 0.0)  # the filter removed something


def test_a_draw_is_a_function_of_seed_position_and_step():
    """Counter-based Gumbel-max (:mod:`model_executor.decoding.sampling`): a row's draw depends on its request's
    seed, its position and its step only, not on where it sits in the step, on which other rows are drawn or on
    the logits of the rows beside it; another seed, position or step draws afresh. Both confidence rules are the
    formulas they name."""
    from model_executor.decoding import Sampling, predict_rows
    from model_executor.decoding.sampling import row_draws

    g = torch.Generator().manual_seed(0)
    V, L = 50, 16
    logits = torch.randn(L, V, generator=g, dtype=torch.float64) * 0.5  # flat: every draw is a real draw
    s = Sampling(1.0, seed=123)

    def draw(lg, jobs, kept=None):
        return predict_rows(lg.clone(), kept=kept, draws=row_draws(jobs, None if kept is None else
                                                                   torch.where(kept, kept.long().cumsum(0) - 1,
                                                                               -1).numpy()))
    alone = draw(logits, [(s, 100, [0], [2], L, torch.ones(L, dtype=torch.bool).numpy())])
    # the same canvas second in a step, after another request's rows, with only its even rows kept
    other = torch.randn(L, V, generator=g, dtype=torch.float64)
    kept = torch.cat([torch.ones(L, dtype=torch.bool), torch.arange(L) % 2 == 0])
    both = draw(torch.cat([other, logits[::2]]), [(Sampling(0.7, seed=9), 40, [0], [0], L, kept[:L].numpy()),
                                                 (s, 100, [L], [2], L, kept[L:].numpy())], kept)
    assert torch.equal(both.tokens[L::2], alone.tokens[::2]) and torch.equal(both.conf[L::2], alone.conf[::2])
    for changed in [(Sampling(1.0, seed=124), 100, 2), (s, 101, 2), (s, 100, 3)]:
        again = draw(logits, [(changed[0], changed[1], [0], [changed[2]], L, torch.ones(L, dtype=torch.bool).numpy())])
        assert (again.tokens != alone.tokens).sum() > L // 2, changed
    z = logits
    p = torch.softmax(z, -1)
    assert torch.allclose(alone.conf.double(), p.gather(1, alone.tokens[:, None])[:, 0])  # drawn: untempered p
    T = 0.5
    hot = draw(logits, [(Sampling(T, seed=123, confidence="tempered"), 100, [0], [2], L,
                         torch.ones(L, dtype=torch.bool).numpy())])
    want = torch.minimum(p.max(-1).values, ((z.gather(1, hot.tokens[:, None])[:, 0] - z.max(-1).values) / T).exp())
    assert torch.allclose(hot.conf.double(), want)
    assert (hot.tokens != z.argmax(-1)).any()  # not the argmax everywhere: it drew


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16))
def test_a_step_with_drawn_rows_keeps_the_greedy_rows_greedy(dtype):
    """A step mixing greedy and sampled requests: the greedy rows get exactly the top-1 and confidence of a step
    without draws (their pass skips the drawn rows, which only the draw computes), the drawn rows their draws."""
    from model_executor.decoding import Sampling, predict_rows
    from model_executor.decoding.sampling import row_draws

    g = torch.Generator().manual_seed(4)
    L, V = 8, 60
    logits = (torch.randn(3 * L, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    ones = np.ones(L, dtype=bool)
    # rows [L, 2L) drawn (the second request), the others greedy
    jobs = [(Sampling(0.9, seed=5), 30, [L], [1], L, ones)]
    mixed = predict_rows(logits.clone(), draws=row_draws(jobs, None))
    greedy = predict_rows(logits.clone())
    drawn = predict_rows(logits[L: 2 * L].clone(), draws=row_draws([(Sampling(0.9, seed=5), 30, [0], [1], L, ones)],
                                                                    None))
    for part in (slice(0, L), slice(2 * L, 3 * L)):
        assert torch.equal(mixed.tokens[part], greedy.tokens[part]) and torch.equal(mixed.conf[part], greedy.conf[part])
    assert torch.equal(mixed.tokens[L: 2 * L], drawn.tokens) and torch.equal(mixed.conf[L: 2 * L], drawn.conf)
    assert not torch.equal(mixed.tokens[L: 2 * L], greedy.tokens[L: 2 * L])  # it drew


def test_a_requests_draw_keys_do_not_depend_on_the_seeds_beside_it():
    """Seeds are 64-bit: a seed past 2**63 (vLLM's ``seed + 1`` for the second of ``n`` samples of seed 2**63 - 1)
    in the same step must not change another request's keys (numpy would join the seeds as float64, rounding a
    seed past 2**53)."""
    from model_executor.decoding import Sampling
    from model_executor.decoding.sampling import row_draws

    L, ones = 4, np.ones(4, dtype=bool)
    other = (Sampling(0.9, seed=2 ** 53 + 1), 10, [0], [1], L, ones)
    alone = row_draws([other], None).keys
    beside = row_draws([other, (Sampling(0.9, seed=2 ** 63), 10, [L], [1], L, ones)], None).keys
    assert torch.equal(beside[:L], alone)
    high = row_draws([(Sampling(0.9, seed=2 ** 63), 10, [0], [1], L, ones)], None).keys
    assert torch.equal(beside[L:], high) and not torch.equal(high, alone)


def test_the_draws_in_place_hash_is_splitmix64():
    """The draw's per-token hash runs in place (``_mix_``, a cached ``token * golden``); its bits are SplitMix64's
    written out functionally (``_mix``), for every token range and row key, so a draw is the same on every
    device and in every version of the pass."""
    from model_executor.decoding.sampling import _GOLDEN, _mix, _srl, row_keys, uniforms

    keys = row_keys(torch.tensor([0, 7, -3, 2 ** 40]), torch.tensor([0, 5, 99, 1]), torch.tensor([0, 1, 2, 63]))
    for token0, n in ((0, 50), (13, 7), (0, 1)):
        v = torch.arange(token0, token0 + n, dtype=torch.int64)
        want = (_srl(_mix(keys[:, None] ^ (v * _GOLDEN)), 11).to(torch.float64) + 0.5) * 2.0 ** -53
        assert torch.equal(uniforms(keys, token0, n), want), (token0, n)
        assert torch.equal(uniforms(keys, token0, n), want)  # again: the cached token keys are not written


def test_filter_rows_is_the_scalar_filter_per_row():
    """The batched top-k / top-p / min-p of the step's draws keeps, row by row, what the one-row filter keeps."""
    from oracles.decoders import filter_logits
    from model_executor.decoding.sampling import filter_rows

    g = torch.Generator().manual_seed(2)
    knobs = [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.2), (5, 0.5, 0.1), (1, 1.0, 0.0), (0, 1e-9, 0.0)]
    x = torch.randn(len(knobs), 40, generator=g, dtype=torch.float64) * 2
    got = filter_rows(x.clone(), *(torch.tensor(c) for c in zip(*knobs)))
    want = torch.stack([filter_logits(row, *k) for row, k in zip(x, knobs)])
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[~torch.isinf(got)],
                                                                            want[~torch.isinf(want)])
    assert torch.isinf(got).any(-1).tolist() == [False] + [True] * (len(knobs) - 1)


def _toy_model(V: int, seed: int):
    """Deterministic bidirectional logits ``[L, V]`` (float64) of a canvas: every row depends on the whole
    canvas, so a draft's prediction differs from its parent's."""
    g = torch.Generator().manual_seed(seed)
    E, P = torch.randn(V, 16, generator=g, dtype=torch.float64), torch.randn(64, 16, generator=g, dtype=torch.float64)
    A, B = torch.randn(16, 16, generator=g, dtype=torch.float64), torch.randn(16, 16, generator=g, dtype=torch.float64)
    O = torch.randn(16, V, generator=g, dtype=torch.float64) * 3

    def model(canvas: torch.Tensor) -> torch.Tensor:
        h = E[canvas] + P[: canvas.numel()]
        return torch.tanh(h @ A + h.mean(0) @ B) @ O
    return model


def _toy_graph(formulas, parents):
    from model_executor.decoding import DraftGraph, GraphNode

    nodes = [GraphNode(formula=f, level=len(f), parents=p) for f, p in zip(formulas, parents)]
    return DraftGraph(format_version=1, model="toy", block_size=12, base_policy="confidence", threshold=0.9,
                      lookahead=3, nodes=nodes)


# level-1 and level-2 roots, deeper nodes with one or two parents, a second token rank, a formula naming one
# position twice (never applies), one written twice in another order (the same draft: deduplicated), and a
# child that often outscores its parent (11 over 10: under the static base it may enter only after it)
_TOY_GRAPH = _toy_graph([[(1, 1)], [(1, 1), (2, 1)], [(1, 2)], [(2, 1)], [(1, 1), (2, 1), (3, 1)], [(1, 1), (3, 1)],
                         [(1, 1), (1, 2)], [(1, 1), (2, 2)], [(1, 1), (2, 1), (3, 1), (4, 1)], [(2, 1), (1, 1)],
                         [(1, 1), (4, 1)], [(1, 1), (2, 1), (4, 1)]],
                        [[], [0, 3], [], [], [1, 5], [0], [], [0], [4], [0], [0], [10]])
_TOY_GRAPH_SMALL = _toy_graph([[(1, 1)], [(1, 1), (2, 1)], [(2, 1), (3, 2)]], [[], [0], []])


@pytest.mark.parametrize("method,knobs", [
    ("psd", [dict(policy="confidence", depth=3), dict(policy="static", depth=2), dict(policy="localleap", depth=3)]),
    ("psd", [dict(policy="confidence", depth=3, dag_shape="skip"), dict(policy="confidence", depth=3),
             dict(policy="localleap", depth=4, dag_shape="skip")]),
    ("psd", [dict(policy="confidence", dag=DraftDAG((frozenset(), frozenset({0}), frozenset({1}), frozenset({0, 1}),
                                                    frozenset({0, 1, 2, 3, 4, 5, 6, 7, 8, 9})),
                                                   ((), (0,), (0,), (1, 2), (3,)))),
             dict(policy="confidence", dag=DraftDAG((frozenset(), frozenset({0}), frozenset({1})),
                                                                   ((), (0,), (0,))))]),
    ("lopa", [dict(policy="confidence", branches=3), dict(policy="static", branches=2), dict(policy="localleap",
                                                                                          branches=12)]),
    ("freedave", [dict(steps=4), dict(steps=1), dict(steps=9)]),
    ("spiffy", [dict(policy="confidence", graph=_TOY_GRAPH, budget=3), dict(policy="static", graph=_TOY_GRAPH, budget=2),
                dict(policy="confidence", graph=_TOY_GRAPH_SMALL, budget=5)]),
])
def test_drafting_decoders_step_together_as_they_do_alone(method, knobs, monkeypatch):
    """The batched step (:func:`propose_all`, one :func:`predict_rows` pass, :func:`update_all`) of many decoders
    of one method, with different knobs, block lengths and progress, gives every decoder the canvases, states,
    NFE and counters of the method's oracle (the method on one block, ``tests/oracles/decoders.py``), until every
    block is done, also when a proposed decoder waits a step (the decoders updated together are not those
    proposed together); and the verify steps really ran batched (groups of several decoders with drafts)."""
    import sys

    from model_executor.decoding import predict_rows, propose_all, update_all
    from oracles.decoders import make_oracle

    module = sys.modules[type(make_decoder(method, torch.tensor([1, 2]), 0, **knobs[0])).__module__]
    sizes = []  # (decoders, most canvases) of each batched update: every update builds its row index once
    index = module.canvas_row_index
    monkeypatch.setattr(module, "canvas_row_index", lambda decs, canvas_rows, *a: (
        sizes.append((len(decs), max(map(len, canvas_rows)))), index(decs, canvas_rows, *a))[1])
    V, M = 9, 8  # the mask is the last token; the toy model never predicts it (excluded as the engines do)
    model = _toy_model(V, seed=3)
    g = torch.Generator().manual_seed(7)
    blocks = []
    for i in range(12):
        b = torch.randint(0, M, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g)
        b[torch.rand(b.numel(), generator=g) < 0.8] = M
        b[0] = M  # something to decode
        blocks.append(b)
    alone = [make_oracle(method, b, M, **knobs[i % len(knobs)]) for i, b in enumerate(blocks)]
    together = [make_decoder(method, b, M, **knobs[i % len(knobs)]) for i, b in enumerate(blocks)]
    nfe = [0] * len(blocks)
    proposed: dict = {}  # decoder -> its canvases (alone, together) not yet stepped
    t = 0
    while True:
        live = [i for i, d in enumerate(alone) if not d.done]
        assert live == [i for i, d in enumerate(together) if not d.done]
        if not live:
            break
        fresh = [i for i in live if i not in proposed]
        for i, prop in zip(fresh, propose_all([together[i] for i in fresh])):
            ca, cb = alone[i].canvases(), prop.canvases
            assert len(ca) == len(cb) and all(torch.equal(a, b) for a, b in zip(ca, cb)), (i, nfe[i])
            proposed[i] = (ca, prop)
        # as in the engines, a proposed request may wait a step (no room in the batch): every third step one
        # does, so decoders proposed together step apart, and one proposed alone steps with others
        wait = live[t % len(live)] if t % 3 == 1 and len(live) > 1 else None
        t += 1
        step = [i for i in live if i != wait]
        rows, firsts, need, props = [], [], [], []
        for i in step:
            ca, prop = proposed.pop(i)
            cb = prop.canvases
            props.append(prop)
            firsts.append([sum(r.shape[0] for r in rows) + k * ca[0].numel() for k in range(len(ca))])
            logits = [model(c) for c in ca]
            need.append((torch.stack(cb) == M).flatten())
            rows.extend(logits)
            alone[i].update([lg.clone() for lg in logits])
            nfe[i] += 1
        # as the engines: logits only at masked canvas positions
        kept = torch.cat(need)
        update_all([together[i] for i in step], props,
                   predict_rows(torch.cat(rows)[kept], mask_id=M, kept=kept), firsts)
        for i in step:
            assert torch.equal(alone[i].state, together[i].state), (i, nfe[i])
    assert [d.stats() for d in alone] == [d.stats() for d in together]
    assert max(nfe) > 2 and any(n > 1 and k > 1 for n, k in sizes)
    st = [d.stats() for d in together]  # drafts were accepted (and rejected): the acceptance rule was exercised
    got = {"psd": lambda s: (sum(s["node_accepted"]), sum(s["node_tried"])),
           "lopa": lambda s: (sum(s["branch_chosen"][1:]), sum(s["branch_chosen"])),
           "freedave": lambda s: (s["accepted_drafts"], 2 * s["accepted_drafts"] + 1),
           "spiffy": lambda s: (s["accepted_drafts"], sum(s["node_tried"]))}[method]
    acc, tried = map(sum, zip(*(got(x) for x in st)))
    assert 0 < acc < tried


@pytest.mark.parametrize("knobs", [dict(threshold=0.9, edit_threshold=0.9, max_post_edit_steps=16),
                                   dict(threshold=0.5, edit_threshold=0.0, max_post_edit_steps=3),
                                   dict(threshold=0.7, edit_threshold=0.5, max_post_edit_steps=0),
                                   dict(threshold=0.3, edit_threshold=1.0, max_post_edit_steps=5)])
def test_joint_threshold_steps_together_as_the_rule_alone(knobs):
    """LLaDA2.1's editing decoder: the batched step of many blocks (different lengths, progress and knobs; the
    engines' predictions of every row, as it reads filled positions) gives each block the states, forwards and
    edit counts of the rule run plainly on it alone (``oracles.decoders.JointThresholdOracle``); edits and
    post-edit steps happen (but never with ``edit_threshold`` 1), and ``max_post_edit_steps`` 0 is threshold
    unmasking alone."""
    from model_executor.decoding import predict_rows, propose_all, update_all
    from oracles.decoders import make_oracle

    V, M = 9, 8
    model = _toy_model(V, seed=5)
    g = torch.Generator().manual_seed(11)
    blocks = []
    for _ in range(12):
        b = torch.randint(0, M, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g)
        b[torch.rand(b.numel(), generator=g) < 0.8] = M
        b[0] = M
        blocks.append(b)
    mixed = [dict(knobs, threshold=knobs["threshold"] * (1 - 0.1 * (i % 2))) for i in range(len(blocks))]
    alone = [make_oracle("joint_threshold", b, M, **k) for b, k in zip(blocks, mixed)]
    together = [make_decoder("joint_threshold", b, M, **k) for b, k in zip(blocks, mixed)]
    assert all(d.reads_all_rows for d in together)
    nfe = [0] * len(blocks)
    while True:
        live = [i for i, d in enumerate(alone) if not d.done]
        assert live == [i for i, d in enumerate(together) if not d.done]
        if not live:
            break
        props = propose_all([together[i] for i in live])
        rows, firsts = [], []
        for i, prop in zip(live, props):
            (state,) = prop.canvases
            assert torch.equal(state, alone[i].canvases()[0])
            firsts.append([sum(r.shape[0] for r in rows)])
            rows.append(model(state))
            alone[i].update([rows[-1].clone()])
            nfe[i] += 1
        update_all([together[i] for i in live], props, predict_rows(torch.cat(rows), mask_id=M), firsts)
        for i in live:
            assert torch.equal(alone[i].state, together[i].state), (i, nfe[i])
    assert [d.stats() for d in alone] == [d.stats() for d in together]
    edits = sum(d.edits for d in together)
    post = sum(d.post_steps for d in together)
    if knobs["edit_threshold"] >= 1.0:
        assert edits == 0
    elif knobs["max_post_edit_steps"] > 0:
        assert edits > 0 and post > 0
    if knobs["max_post_edit_steps"] == 0:
        assert post == 0


def test_request_rules_apply_in_vllms_order():
    """A request's rules on a row of logits in vLLM's sampler's order: allowed tokens, banned words, min_tokens'
    stop tokens and the bias first, then the penalties on the biased logits (vLLM's ``apply_logits_processors``):
    a bias of +2 on a logit of 2 under repetition penalty 2 gives (2 + 2) / 2 = 2, not 2 / 2 + 2 = 3."""
    from model_executor.decoding import LogitsRules

    history = (torch.tensor([9]), torch.tensor([0, 1, 1]))  # (prompt, answer so far)
    row = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 4.0]], dtype=torch.float64)
    rules = LogitsRules(logit_bias={0: 2.0, 1: 3.0}, repetition_penalty=2.0, frequency_penalty=0.5,
                        presence_penalty=0.25, banned_token_ids=(3,))
    out = row.clone()
    rules.apply(out, torch.tensor([5]), history)
    # token 0: (2 + 2) / 2 - 0.5 - 0.25; token 1: (-1 + 3) / 2 - 2 * 0.5 - 0.25; token 9 (the prompt's): 4 / 2
    assert out[0, 0].item() == 1.25 and out[0, 1].item() == -0.25 and out[0, 9].item() == 2.0
    assert out[0, 3].item() == float("-inf") and out[0, 2].item() == 0.5
