"""The decoding methods written for one block, as their papers state them, line by line: the oracles of the
batched decoders (:mod:`model_executor.decoding`), which the tests hold equal to them canvas for canvas.

An oracle is driven one block at a time::

    dec = make_oracle(method, block_tokens, mask_id, **knobs)   # the knobs of make_decoder
    while not dec.done:
        canvases = dec.canvases()          # >= 1 versions of the block to forward (the state, drafts...)
        dec.update([forward(c) for c in canvases])   # per canvas [L, V] logits (or a RowPredictions slice)

The algorithms and the choices the papers leave open are documented in the decoders' modules (policies, lopa,
freedave, psd, spiffy); this module cites their lines and follows them without batching anything.
"""

from __future__ import annotations


import torch

from model_executor.decoding.base import BlockDecoder, Prediction, commit, predict, top_token_gaps
from model_executor.decoding.freedave import topk_jump
from model_executor.decoding.policies import Policy, make_policy, SPATIAL_POLICIES
from model_executor.decoding.psd import DraftDAG
from model_executor.decoding.spiffy import Ranked, top_logprobs
from model_executor.decoding.spiffy_graph import DraftGraph


class OracleDecoder(BlockDecoder):
    """One block's state (the decoders' own base); subclasses implement ``canvases`` and ``update``."""


class PolicyOracle(OracleDecoder):
    """A spatial policy alone: each forward predicts the block and the policy commits positions."""

    def __init__(self, block, mask_id, policy: Policy):
        super().__init__(block, mask_id)
        self.policy = policy

    def canvases(self):
        return [self.state]

    def update(self, logits):
        pred = predict(logits[0], self.state, self.mask_id)
        self.state = commit(self.state, pred, self.policy(pred.conf) & self.masked)


class LoPAOracle(OracleDecoder):
    """LoPA Alg. 1 (see :mod:`model_executor.decoding.lopa`)."""

    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None
        self.branches: list[torch.Tensor] = []
        self.chosen = [0] * (branches + 1)

    def _explore(self, pred: Prediction) -> None:
        """Build B0..Bk from the prediction of the current state (Eq. 1); commit at once when one is complete."""
        b0 = commit(self.state, pred, self.policy(pred.conf) & self.masked)
        rest = torch.where(b0 == self.mask_id, pred.conf, torch.full_like(pred.conf, float("-inf")))
        n = int(torch.isfinite(rest).sum())
        self.branches = [b0]
        if n:
            for p in torch.sort(rest, descending=True, stable=True).indices[: min(self.k, n)]:
                b = b0.clone()
                b[p] = pred.tokens[p]
                self.branches.append(b)
        complete = [b for b in self.branches if not (b == self.mask_id).any()]
        if complete:
            self.state, self.branches = complete[0], []

    def canvases(self):
        return [self.state] if self.pred is None else self.branches

    def update(self, logits):
        if self.pred is None:
            self.pred = predict(logits[0], self.state, self.mask_id)
        else:
            preds = [predict(lg, b, self.mask_id) for lg, b in zip(logits, self.branches)]
            # Eq. 2: each branch's mean confidence over its masked positions; the first best branch on ties
            conf = torch.stack([p.conf for p in preds])
            masked = torch.stack(self.branches).to(conf.device) == self.mask_id
            # in float64: top-1 confidences (each >= 1 / V) sum exactly there, in any order
            scores = torch.where(masked, conf, torch.zeros_like(conf)).double().sum(-1) / masked.sum(-1)
            j = int(scores.argmax())
            self.chosen[j] += 1
            self.state, self.pred = self.branches[j], preds[j]
        self._explore(self.pred)

    def stats(self):
        return {"branch_chosen": self.chosen}


class FreeDaveOracle(OracleDecoder):
    """FreeDave Alg. 2 (see :mod:`model_executor.decoding.freedave`)."""

    def __init__(self, block, mask_id, steps: int = 4):
        super().__init__(block, mask_id)
        self.steps = steps
        self.pred: Prediction | None = None
        self.drafts: list[torch.Tensor] = []
        self.accepted = self.iterations = 0

    def canvases(self):
        if self.pred is None:
            return [self.state]
        n = int(self.masked.sum())  # L5-13: draft k = the static scheduler's k-step jump
        self.drafts = [topk_jump(self.state, self.pred, k) for k in range(1, min(self.steps, n - 1) + 1)]
        return self.drafts

    def update(self, logits):
        if self.pred is None:  # L2: the first estimate of the block
            self.pred = predict(logits[0], self.state, self.mask_id)
        else:  # L18-37
            preds = [predict(lg, d, self.mask_id) for lg, d in zip(logits, self.drafts)]
            m = 0
            while m + 1 < len(self.drafts) and torch.equal(self.drafts[m + 1], topk_jump(self.drafts[m], preds[m], 1)):
                m += 1
            self.state, self.pred = self.drafts[m], preds[m]
            self.accepted += m
            self.iterations += 1
        if int(self.masked.sum()) == 1:  # L14-17: the last step needs no forward
            self.state = topk_jump(self.state, self.pred, 1)

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations}


class PSDOracle(OracleDecoder):
    """PSD Alg. 1 (see :mod:`model_executor.decoding.psd`)."""

    def __init__(self, block, mask_id, policy: Policy, dag: DraftDAG):
        super().__init__(block, mask_id)
        self.policy, self.dag = policy, dag
        self.pred: Prediction | None = None
        self.nodes: list[int] = []
        self.drafts: list[torch.Tensor] = []
        self.sigma: torch.Tensor | None = None
        self.accepted_depth = self.iterations = 0
        self.node_tried = [0] * len(dag.sets)
        self.node_accepted = [0] * len(dag.sets)

    def _stage1(self, pred: Prediction) -> None:
        """L6-8 (and L26): commit π on a prediction of the current state, remember it for drafting."""
        self.pred = pred
        self.state = commit(self.state, pred, self.policy(pred.conf) & self.masked)

    def canvases(self):
        if self.pred is None:
            return [self.state]
        masked = self.masked
        # L13: σ = still-masked positions by step-t confidence (descending)
        conf = torch.where(masked, self.pred.conf, torch.full_like(self.pred.conf, float("-inf")))
        self.sigma = torch.sort(conf, descending=True, stable=True).indices[: int(masked.sum())]
        self.nodes, self.drafts = [], []
        for k, s in enumerate(self.dag.sets):  # L14-15: index assembly, Eq. 2
            if s and max(s) >= self.sigma.numel():
                continue
            pos = torch.zeros_like(masked)
            pos[self.sigma[list(s)]] = True
            self.nodes.append(k)
            self.drafts.append(commit(self.state, self.pred, pos))
        return [d for d in self.drafts if (d == self.mask_id).any()]  # a full draft needs no forward

    def update(self, logits):
        if self.pred is None:
            self._stage1(predict(logits[0], self.state, self.mask_id))
            return
        it = iter(logits)
        preds = [predict(next(it), d, self.mask_id) if (d == self.mask_id).any() else None for d in self.drafts]
        index = {k: n for n, k in enumerate(self.nodes)}
        accepted = {0}
        for n, k in enumerate(self.nodes[1:], 1):  # L20-22, topological order (parents come first)
            self.node_tried[k] += 1
            for p in self.dag.parents[k]:
                if p not in accepted or preds[index[p]] is None:
                    continue
                new = self.sigma[sorted(self.dag.sets[k] - self.dag.sets[p])]
                pp = preds[index[p]]
                if bool((self.policy(pp.conf)[new] & (pp.tokens[new] == self.drafts[n][new])).all()):
                    accepted.add(k)
                    self.node_accepted[k] += 1
                    break
        best = max(accepted, key=lambda k: (len(self.dag.sets[k]), -k))  # L25
        n = index[best]
        self.accepted_depth += len(self.dag.sets[best])
        self.iterations += 1
        self.state = self.drafts[n]
        if preds[n] is not None:
            self._stage1(preds[n])  # L26 (= the next iteration's Stage 1 on the same state)

    def stats(self):
        return {"accepted_positions": self.accepted_depth, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}


def ranks(state_q: torch.Tensor, pred: Prediction, max_i: int, max_j: int) -> Ranked:
    """Spiffy Eqs. 8-9 for ``pred`` (the prediction of ``state_q``): the masked positions by confidence, and the
    top-``max_j`` tokens with their log-probabilities at the ``max_i`` most confident."""
    masked = torch.isfinite(pred.conf)
    order = torch.sort(pred.conf, descending=True, stable=True).indices[: int(masked.sum())]
    at = order[:max_i]
    ids, gaps = top_token_gaps(pred.logits, at, pred.tokens[at], max_j)
    top_tok = torch.cat([pred.tokens[at].long().reshape(-1, 1).cpu(), ids.cpu()], 1)
    return Ranked(state_q, order.cpu(), top_tok,
                  torch.from_numpy(top_logprobs(pred.conf[at].double().cpu().numpy(), gaps.cpu().numpy())))


def instantiate(formula, q: Ranked) -> tuple[torch.Tensor, float] | None:
    """The draft of ``formula`` on ``Y_q`` and the logarithm of its localScore (Eq. 12), or None if it does not
    apply."""
    if any(i > q.order.numel() for i, _ in formula):
        return None
    pos = [int(q.order[i - 1]) for i, _ in formula]
    if len(set(pos)) != len(pos):
        return None
    draft = q.state.clone()
    logp = 0.0
    for (i, j), p in zip(formula, pos):
        draft[p] = q.top_tok[i - 1, j - 1]
        logp += float(q.logp[i - 1, j - 1])
    return draft, logp / len(formula)  # log localScore


def _extends(draft: torch.Tensor, state: torch.Tensor, mask_id: int) -> bool:
    known = state != mask_id
    return bool((draft[known] == state[known]).all()) and int((draft != mask_id).sum()) > int(known.sum())


class SpiffyOracle(OracleDecoder):
    """Spiffy §4: drafts from a calibrated graph, Alg. 1 verification (see :mod:`model_executor.decoding.spiffy`)."""

    def __init__(self, block, mask_id, rule: Policy, graph: DraftGraph, budget: int = 3,
                 max_commit: int | None = None):
        super().__init__(block, mask_id)
        self.rule, self.graph, self.budget, self.max_commit = rule, graph, budget, max_commit
        self.kids = graph.children()
        self.max_i = max(i for n in graph.nodes for i, _ in n.formula)
        self.max_j = max(j for n in graph.nodes for _, j in n.formula)
        self.q: Ranked | None = None
        self.drafts: list[torch.Tensor] = []
        self.draft_nodes: list[int] = []
        self.accepted = self.iterations = 0
        self.node_tried = [0] * len(graph.nodes)
        self.node_accepted = [0] * len(graph.nodes)

    def next_state(self, state: torch.Tensor, pred: Prediction) -> torch.Tensor:
        """The base policy's step ``Next(state, prediction)``."""
        return commit(state, pred, self.rule(pred.conf) & torch.isfinite(pred.conf))

    def _draft_candidates(self) -> list[tuple[int, torch.Tensor, float]]:
        inst: dict[int, tuple[torch.Tensor, float]] = {}
        for k, node in enumerate(self.graph.nodes):
            got = instantiate(node.formula, self.q)
            # a draft must extend the state and keep a mask: a complete next state ends the block anyway
            if got is not None and _extends(got[0], self.state, self.mask_id) and (got[0] == self.mask_id).any():
                inst[k] = got
        scored = []
        seen: list[torch.Tensor] = []
        for k, (draft, local) in inst.items():
            if any(torch.equal(draft, s) for s in seen):
                continue
            seen.append(draft)
            child = [inst[c][1] for c in self.kids[k] if c in inst]
            # Eqs. 13-14 in logarithms: a geometric mean is the exponential of the mean of the logarithms
            child_score = sum(child) / len(child) if child else local  # Eq. 13
            scored.append(((local + child_score) * 0.5, k, draft))  # Eq. 14
        scored.sort(key=lambda t: (-t[0], t[1]))
        chosen: list[tuple[int, torch.Tensor, float]] = []
        admitted: set[int] = set()
        for s, k, d in scored:  # top-D* by score, keeping the pruned graph connected
            if len(chosen) == self.budget:
                break
            node = self.graph.nodes[k]
            added = int((d != self.mask_id).sum()) - int((self.state != self.mask_id).sum())
            direct = self.max_commit is None or added <= self.max_commit
            if direct or admitted.intersection(node.parents):
                chosen.append((k, d, s))
                admitted.add(k)
        return chosen

    def canvases(self):
        self.drafts, self.draft_nodes = [], []
        if self.q is not None:
            for k, d, _ in self._draft_candidates():
                self.draft_nodes.append(k)
                self.drafts.append(d)
                self.node_tried[k] += 1
        return [self.state] + self.drafts

    def update(self, logits):
        rows = list(logits)
        pred = predict(rows[0], self.state, self.mask_id)
        pending = set(range(len(self.drafts)))
        while True:  # Alg. 1: commit from the state's exact prediction, then reuse an equal draft's
            new = self.next_state(self.state, pred)
            y_q, q = self.state, pred
            self.state = new
            if self.done:
                break
            hit = next((n for n in pending if torch.equal(self.drafts[n], new)), None)
            if hit is None:
                break
            pending.discard(hit)
            self.accepted += 1
            self.node_accepted[self.draft_nodes[hit]] += 1
            pred = predict(rows[1 + hit], self.drafts[hit], self.mask_id)
        self.q = None if self.done else ranks(y_q, q, self.max_i, self.max_j)
        self.iterations += 1

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}


class JointThresholdOracle(OracleDecoder):
    """LLaDA2.1's editing decoder on one block, as its authors' ``generate`` loop runs it (read, not run here;
    SGLang's JointThreshold agrees): per forward, greedy tokens ``x`` and their probabilities ``p`` at every
    position; masked positions with ``p > threshold`` unmask (if none does while masks remain, the most
    probable masked one); positions the block filled earlier take a different ``x`` when ``p > edit_threshold``.
    A forward that starts with no mask counts as a post-edit step; the loop ends when such a step edits
    nothing, or before a post-edit step past ``max_post_edit_steps``."""

    def __init__(self, block, mask_id, threshold: float, edit_threshold: float, max_post_edit_steps: int):
        super().__init__(block, mask_id)
        self.threshold, self.edit_threshold, self.max_post = threshold, edit_threshold, max_post_edit_steps
        self.generated = block == mask_id
        self.post_steps = self.edits = 0
        self.stopped = False

    @property
    def done(self):
        full = not bool(self.masked.any())
        return full and (self.stopped or self.post_steps + 1 > self.max_post)  # the next post step would be past it

    def canvases(self):
        return [self.state]

    def update(self, logits):
        lg = logits[0].double().clone()
        lg[:, self.mask_id] = float("-inf")
        p_all = torch.softmax(lg, -1)
        p, x = p_all.max(-1)
        masked = self.masked
        if not bool(masked.any()):
            self.post_steps += 1
        transfer = masked & (p > self.threshold)
        if bool(masked.any()) and not bool(transfer.any()):
            transfer[torch.where(masked, p, torch.full_like(p, -1.0)).argmax()] = True
        edit = self.generated & ~masked & (x != self.state) & (p > self.edit_threshold)
        self.state = torch.where(transfer | edit, x, self.state)
        self.edits += int(edit.sum())
        if not bool(masked.any()) and not bool(edit.any()):
            self.stopped = True

    def stats(self):
        return {"edits": self.edits, "post_edit_steps": self.post_steps}


def make_oracle(method: str, block: torch.Tensor, mask_id: int, *, threshold: float = 0.9,
                relaxed_threshold: float = 0.75, radius: int = 4, policy: str = "confidence", depth: int = 3,
                branches: int = 3, steps: int = 4, dag: DraftDAG | None = None, dag_shape: str = "chain",
                graph: DraftGraph | None = None, budget: int = 3,
                edit_threshold: float = 0.9, max_post_edit_steps: int = 16) -> OracleDecoder:
    """The oracle of ``make_decoder(method, block, mask_id, **knobs)``, with the same knobs."""
    knobs = dict(threshold=threshold, relaxed_threshold=relaxed_threshold, radius=radius)
    if method in SPATIAL_POLICIES:
        return PolicyOracle(block, mask_id, make_policy(method, **knobs))
    if method == "freedave":
        return FreeDaveOracle(block, mask_id, steps=steps)
    if method == "spiffy":
        return SpiffyOracle(block, mask_id, make_policy(policy, threshold=threshold), graph, budget=budget,
                            max_commit=1 if policy == "static" else None)
    if method == "lopa":
        return LoPAOracle(block, mask_id, make_policy(policy, **knobs), branches=branches)
    if method == "joint_threshold":
        return JointThresholdOracle(block, mask_id, threshold, edit_threshold, max_post_edit_steps)
    if method == "psd":
        return PSDOracle(block, mask_id, make_policy(policy, **knobs), dag or DraftDAG.shaped(dag_shape, depth))
    raise ValueError(f"method {method!r}")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The one-row oracle of :func:`model_executor.decoding.sampling.filter_rows`: keep, per row of (temperature-scaled) ``logits [..., V]``, the ``top_k`` best tokens (0 or -1: all), the
    smallest set of best tokens whose probability reaches ``top_p``, and the tokens with at least ``min_p``
    times the best one's probability; the others get -inf. The best token always stays. Returns a new tensor."""
    out = logits.clone()
    V = out.shape[-1]
    if 0 < top_k < V:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out.masked_fill_(out < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = out.sort(dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = (cum - srt.softmax(-1)) >= top_p  # the mass before this token already reaches top_p
        out.scatter_(-1, idx, srt.masked_fill(drop, float("-inf")))
    if min_p > 0.0:
        p = out.softmax(-1)
        out.masked_fill_(p < min_p * p.amax(-1, keepdim=True), float("-inf"))
    return out
