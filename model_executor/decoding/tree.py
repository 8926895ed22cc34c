"""PRESTO token trees: prefix-aligned scoring, tree construction, and lossless verification rules.

A draft round starts from the accepted context. The drafter gives marginals ``q_d`` for the next ``k``
positions (``logq [k, V]``, log-probabilities); the prefix scorer gives ``log ρ(t | c)``. Then:

- token score ``s_{d,t}(c_d) = log q_d(t) + λ_d log ρ_d(t | c_d)`` (PRESTO Eq. 6-8), with a fixed
  ``λ`` or the entropy-adaptive ``λ_d(H_d) = β H_d / (H_d + C)`` (appendix F); a path's score ``S`` sums
  its tokens' scores (Eq. 8), so a child's score is its parent's plus one term;
- tree construction under a node budget ``B`` (draft nodes, the root not counted):
  ``linear`` — the drafter's top-1 chain, ``B`` long at most (DFlash's linear draft);
  ``beam`` — beam search with global retention (Alg. 1: expand every in-beam node by its top-``b``
  children, keep the top-``W`` new nodes as the next beam, retain all nodes; return the top-``B``). A
  choice: the beam always runs to the drafter's depth ``k``. Alg. 1's ``while |T| < B`` would stop it at
  depth 2 whenever ``B <= W·b + b`` (110 for the paper's W = b = 10), which cannot produce the deep trees
  behind the paper's τ ≈ 9-11 at B = 128; retaining everything and keeping the top-B at the end does;
  ``best_first`` — best-first search (Alg. 2: expand the highest-scoring frontier node by its top-``b``
  children until ``B`` nodes exist; return the top-``B``). Every term of ``S`` is ``<= 0`` (``log q <= 0``,
  ``log ρ <= 0``), so a node never outscores its parent and the top-``B`` set is closed under ancestors
  (ties are broken by depth, parents first);
- children are expanded from the ``candidates`` highest ``q_d`` tokens (a choice for large vocabularies;
  exact when ``candidates >= V``): a token the drafter puts outside its top candidates is not drafted.

Verification (the target's logits at the root and at every node, one forward with an ancestor mask):
``accept_greedy`` walks the tree along the target's argmax and returns the matched path plus the target's
bonus token, so outputs equal greedy decoding of the target. ``accept_sampling`` is SpecInfer's
multi-candidate rejection sampling with deterministic candidates: at a node whose target distribution is
``p``, try its children in score order, accepting child ``x`` with probability ``p(x)``; on rejection set
``p(x) = 0`` and renormalise; if none is accepted, sample the bonus token from what is left. Each step's
output is distributed exactly as ``p`` (the draft ``q`` of a deterministic candidate is a point mass, so
``min(1, p/q) = p(x)`` and the residual ``max(p - q, 0)`` is ``p`` without ``x``), so sampling is lossless.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

Search = Literal["linear", "beam", "best_first"]
SEARCHES = ("linear", "beam", "best_first")
LogRho = Callable[[tuple[int, ...]], torch.Tensor]  # draft path so far -> log ρ(· | c) [V]


@dataclass
class TokenTree:
    """Draft nodes in creation order; ``parent[i] = -1`` for children of the root (the last accepted token)."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)
    paths: list[tuple[int, ...]] = field(default_factory=list)  # root-to-node tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.score.append(score)
        self.paths.append((self.paths[parent] if parent >= 0 else ()) + (token,))
        return len(self.tokens) - 1

    def path(self, i: int) -> tuple[int, ...]:
        return self.paths[i] if i >= 0 else ()

    def children(self) -> list[list[int]]:
        """Children of every node (index ``len(self)`` holds the root's), in score order."""
        ch: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parent):
            ch[p if p >= 0 else len(self)].append(i)
        for c in ch:
            c.sort(key=lambda i: -self.score[i])
        return ch

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool: node ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors."""
        n = len(self)
        m = torch.zeros(n, n, dtype=torch.bool)
        par, rows, cur = torch.tensor(self.parent, dtype=torch.long), torch.arange(n), torch.arange(n)
        while n:  # walk every node up to the root at once: one step per tree level
            ok = cur >= 0
            if not bool(ok.any()):
                break
            m[rows[ok], cur[ok]] = True
            cur = torch.where(ok, par[cur.clamp_min(0)], cur)
        return m

    def verify_mask(self, pending: int) -> torch.Tensor:
        """``[pending + N, pending + N]`` bool for a verification forward of ``pending`` accepted tokens (causal
        among themselves; the last one is the root) followed by the nodes (each sees them all, its ancestors
        and itself)."""
        m, n = pending, len(self)
        mask = torch.zeros(m + n, m + n, dtype=torch.bool)
        mask[:m, :m] = torch.ones(m, m, dtype=torch.bool).tril()
        mask[m:, :m] = True
        mask[m:, m:] = self.ancestor_mask()
        return mask

    def prefix(self, n: int) -> "TokenTree":
        """The first ``n`` nodes (a tree whenever parents come before children, as :meth:`select` orders them)."""
        out = TokenTree()
        for i in range(min(n, len(self))):
            out.add(self.tokens[i], self.parent[i], self.score[i])
        return out

    def select(self, budget: int) -> "TokenTree":
        """The top-``budget`` nodes by score (ties: shallower first), renumbered; closed under ancestors."""
        keep = sorted(range(len(self)), key=lambda i: (-self.score[i], self.depth[i], i))[:budget]
        keep.sort(key=lambda i: (self.depth[i], i))  # parents before children
        new = {}
        out = TokenTree()
        for i in keep:
            p = self.parent[i]
            if p >= 0 and p not in new:
                raise AssertionError("top-B selection lost an ancestor")
            new[i] = out.add(self.tokens[i], new[p] if p >= 0 else -1, self.score[i])
        return out


def adaptive_lambda(logq: torch.Tensor, beta: float, c: float) -> torch.Tensor:
    """``λ_d(H_d) = β H_d / (H_d + C)`` per depth from the marginals' entropies (PRESTO appendix F)."""
    h = -(logq.exp() * logq).nan_to_num(0.0).sum(-1)
    return beta * h / (h + c)


def build_tree(logq: torch.Tensor, log_rho: LogRho | None, *, budget: int, search: Search = "beam",
               lam: float | torch.Tensor = 0.2, width: int = 10, top_b: int = 10, candidates: int = 64) -> TokenTree:
    """A draft tree for one request (module docstring). ``logq [k, V]``: the drafter's log-marginals of the
    next ``k`` positions; ``log_rho(path)``: ``log ρ(· | context + path)`` (None: no prefix correction);
    ``lam``: a float or a ``[k]`` tensor (per-depth λ, e.g. :func:`adaptive_lambda`)."""
    if search not in SEARCHES:
        raise ValueError(f"search {search!r}; allowed: {', '.join(SEARCHES)}")
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1 (got {budget})")
    k, V = logq.shape
    logq = logq.double()
    lams = torch.as_tensor(lam, dtype=torch.float64).expand(k)
    top_q = logq.topk(min(candidates, V), dim=-1).indices  # [k, C] candidate tokens per depth
    cand_l = top_q.tolist()
    tree = TokenTree()

    def expand(nodes: list[int], n: int) -> list[list[int]]:
        """Add the top-``n`` children by token score of every node in ``nodes`` (all at one depth)."""
        d = 0 if nodes[0] < 0 else tree.depth[nodes[0]]
        if d >= k:
            return [[] for _ in nodes]
        s = logq[d, top_q[d]].expand(len(nodes), -1)
        if log_rho is not None and float(lams[d]) != 0.0:
            s = s + lams[d] * torch.stack([log_rho(tree.path(v)) for v in nodes])[:, top_q[d]]
        s = s + torch.tensor([0.0 if v < 0 else tree.score[v] for v in nodes], dtype=torch.float64)[:, None]
        best = s.topk(min(n, s.shape[1]), dim=1)
        vals, idx = best.values.tolist(), best.indices.tolist()
        return [[tree.add(cand_l[d][j], v, x) for x, j in zip(vs, js)] for v, vs, js in zip(nodes, vals, idx)]

    if search == "linear":  # the drafter's own top-1 chain: no prefix correction
        log_rho = None
        node = -1
        while len(tree) < budget:
            new = expand([node], 1)[0]
            if not new:
                break
            node = new[0]
        return tree
    if search == "beam":
        beam = [-1]
        for _ in range(k):
            new = [c for cs in expand(beam, top_b) for c in cs] if beam else []
            beam = sorted(new, key=lambda i: -tree.score[i])[:width]
        return tree.select(budget)
    frontier = [(0.0, 0, -1)]  # (-score, tie, node): a max-heap on the score
    tie = 1
    while len(tree) < budget and frontier:
        _, _, v = heapq.heappop(frontier)
        for c in expand([v], top_b)[0]:
            heapq.heappush(frontier, (-tree.score[c], tie, c))
            tie += 1
    return tree.select(budget)


def accept_greedy(tree: TokenTree, target_tokens: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy verification. ``target_tokens [N + 1]``: the target's argmax after the root (row 0) and after
    node ``i`` (row ``i + 1``). Returns (accepted tokens incl. the bonus token, accepted node indices)."""
    ch = tree.children()
    toks = target_tokens.tolist()
    out, nodes, cur = [], [], len(tree)
    while True:
        want = toks[0 if cur == len(tree) else cur + 1]
        out.append(want)
        nxt = next((c for c in ch[cur] if tree.tokens[c] == want), None)
        if nxt is None:
            return out, nodes
        nodes.append(nxt)
        cur = nxt


def accept_sampling(tree: TokenTree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Lossless tree speculative sampling (module docstring). ``target_probs [N + 1, V]``: the target's
    (temperature-scaled) distribution after the root (row 0) and after node ``i`` (row ``i + 1``), on the
    generator's device (the draws are made there). Two reads of the device: the walk's draws
    (:func:`sampling_draws`), then the bonus token (:func:`sampling_bonus`); an engine batching requests makes
    each of them one copy for all (:func:`~model_executor.presto_round.accept_all`)."""
    out, nodes, row, rejected = sampling_walk(tree, sampling_draws(tree, target_probs, generator).cpu())
    out.append(int(sampling_bonus(target_probs, row, rejected, generator)))
    return out, nodes


def _edges(tree: TokenTree) -> tuple[list[list[int]], list[int], list[int], dict[int, int]]:
    """Every parent -> child edge, node by node (the root first), children in order: the children lists, per
    edge its parent's row of ``target_probs`` and the child's token, and each node's first edge."""
    ch = tree.children()
    rows, toks, first = [], [], {}
    for parent in [len(tree), *range(len(tree))]:
        first[parent] = len(rows)
        for c in ch[parent]:
            rows.append(0 if parent == len(tree) else parent + 1)
            toks.append(tree.tokens[c])
    return ch, rows, toks, first


def sampling_draws(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """What the walk of :func:`accept_sampling` reads, on the probabilities' device: per edge (:func:`_edges`)
    the child token's target probability at its parent, then one uniform per edge (drawn from ``generator``,
    all at once: every edge gets its own, used or not), then every row's total. ``[2E + N + 1]`` float64."""
    _, rows, toks, _ = _edges(tree)
    dev, E = target_probs.device, len(rows)
    p = target_probs.double()
    pairs = p[torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
              torch.tensor(toks, dtype=torch.long).to(dev, non_blocking=True)] if E else p.new_zeros(0)
    u = torch.rand(E, generator=generator, dtype=torch.float64, device=dev)
    return torch.cat([pairs, u, p.sum(-1)])


def sampling_walk(tree: TokenTree, draws: torch.Tensor) -> tuple[list[int], list[int], int, list[int]]:
    """The walk of :func:`accept_sampling` on the host over ``draws`` (:func:`sampling_draws`, on the host): at a
    node, try its children in order, accepting child ``x`` when its uniform is below ``p(x)`` renormalised over
    what the rejected siblings left. Returns (accepted tokens, accepted nodes, the row of ``target_probs`` the
    bonus token is drawn from (the last accepted node's; 0: the root's), that row's rejected tokens)."""
    ch, rows, _, first = _edges(tree)
    E = len(rows)
    pairs, u, totals = draws[:E].tolist(), draws[E: 2 * E].tolist(), draws[2 * E:].tolist()
    out, nodes, cur = [], [], len(tree)
    while True:
        left = totals[0 if cur == len(tree) else cur + 1]
        rejected: list[int] = []
        chosen = None
        for k, c in enumerate(ch[cur]):
            x, e = tree.tokens[c], first[cur] + k
            px = 0.0 if x in rejected or left <= 0 else pairs[e] / left
            if u[e] < px:
                chosen = c
                break
            if x not in rejected:
                left -= pairs[e]
                rejected.append(x)
        if chosen is None:
            return out, nodes, 0 if cur == len(tree) else cur + 1, rejected
        out.append(tree.tokens[chosen])
        nodes.append(chosen)
        cur = chosen


def sampling_bonus(target_probs: torch.Tensor, row: int, rejected: list[int],
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """The bonus token: a draw from the target distribution of ``row`` without the ``rejected`` tokens, on the
    probabilities' device (``[1]``, not read here)."""
    p = target_probs[row].double().clone()
    if rejected:
        p[torch.tensor(rejected, dtype=torch.long).to(p.device, non_blocking=True)] = 0.0
    return torch.multinomial(p / p.sum(), 1, generator=generator)
