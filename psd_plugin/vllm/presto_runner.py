"""PRESTO in vLLM: a block-diffusion drafter's token trees verified by an AR target in one forward per step.

The round is :mod:`model_executor.presto_round`'s (shared with the reference engine); this runner decides
how its rows reach vLLM, through the same hooks as the dLLM runner (:mod:`.runner`):

1. ``_prepare_inputs``: a step of a request schedules its *pending* tokens (the last step's accepted path and
   bonus token; after the prefill, the sampled token) followed by its tree's nodes as vLLM draft tokens, in
   the tree's order (by depth, so any prefix vLLM may cut for budget is still a tree). The step's layout gives
   the nodes their positions ``n - 1 + depth`` and each tree request its ancestor mask (``custom``; other
   requests causal); the attention backend computes every row once, under that mask.
2. ``_sample``: the tree walk (:func:`model_executor.presto_round.accept_all`: greedy, or lossless
   multi-candidate rejection sampling with the request's generator) on the logits of the root (the last
   pending token) and of every node, the rows vLLM's spec-decode metadata selects.
3. ``propose_draft_token_ids``: one batched forward of the drafter
   (:class:`model_executor.presto_round.TreeDrafter`, plain PyTorch, its own paged cache) and a tree per
   request.
4. ``recompute_from = n`` (the length before the tree): :class:`~.scheduler.PrestoScheduler` rolls
   ``num_computed_tokens`` back to it, so the accepted tokens are re-forwarded next step as pending tokens
   and their K/V is written exactly; what the nodes wrote past ``n`` is never read.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput

from attention_backends.prefix_attention import make_backend
from attention_backends.step_batch import Rows, build_step_batch
from model_executor.decoding.ngram import NGramModel
from model_executor.decoding.tree import TokenTree
from model_executor.models.reference import ReferenceDLLM
from model_executor.dllm_request import engine_fault
from model_executor.presto_round import DraftState, TreeDrafter, accept_all, draft_options, verify_layout

from . import compat
from .config import presto_from_vllm_config
from .next_step import NextStep
from .runner import PSDRunnerMixin, request_seed

logger = init_logger(__name__)


class PrestoRunnerMixin(PSDRunnerMixin):
    """Drafts token trees and verifies them (module docstring)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.presto = presto_from_vllm_config(vllm_config)
        self.states: dict[str, DraftState] = {}
        self.trees: dict[str, TokenTree] = {}  # the tree each request verifies next
        self._verifying: dict[str, TokenTree] = {}
        self.accepted: dict[str, int] = {}
        self._generators: dict[str, torch.Generator] = {}  # unseeded sampled requests' (_generator)
        # forwards: target forwards requests took part in (prefills included); steps: tree verifications
        self.totals = {"forwards": 0, "steps": 0, "tree_nodes": 0}
        self.drafting_failures = 0  # drafting forwards that raised (their requests stepped without a tree)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        cfg = self.presto
        # on the runner's device, beside the target. Its weights and paged cache (below) are allocated before
        # vLLM's memory profile, and its largest forward runs in it (_dummy_sampler_run): vLLM sizes its KV
        # cache from what is left of gpu_memory_utilization (docs/presto.md)
        drafter = ReferenceDLLM.from_pretrained(cfg.model, dtype=self.model_config.dtype, device=self.device)
        ngram = NGramModel.load(cfg.ngram) if cfg.ngram else None
        self.drafting = TreeDrafter(drafter, ngram, make_backend("auto", self.device, self.model_config.dtype,
                                                                        drafter.spec.head_dim))
        self.opts = draft_options(drafter, search=cfg.search, tree_budget=cfg.tree_budget, width=cfg.width,
                                  top_b=cfg.top_b, lam=cfg.lam,
                                  adaptive=(cfg.adaptive_beta, cfg.adaptive_c) if cfg.adaptive_beta else None,
                                  draft_len=cfg.draft_len, candidates=cfg.candidates)
        # one drafter sequence per running request
        self.max_len = self.model_config.max_model_len + self.opts["k"] + drafter.spec.attention_block
        self.drafting.allocate([self.max_len] * self.scheduler_config.max_num_seqs)
        # a drafting forward takes the target's token budget of rows, or one request's longest: its peak is
        # in vLLM's memory profile (_dummy_sampler_run)
        self.drafting.max_rows = max(self.scheduler_config.max_num_batched_tokens, self.max_len)
        self.free_slots = list(range(self.scheduler_config.max_num_seqs))
        logger.info("PRESTO: drafter %s (%s search, budget %d)", cfg.model, cfg.search, cfg.tree_budget)

    def _dummy_sampler_run(self, hidden_states):
        """vLLM's memory profile runs this after its largest target forward: the drafter's largest forward
        (:meth:`TreeDrafter.profile`) runs here too, so its activations and logits are in the peak."""
        if hidden_states.shape[0]:
            self.drafting.profile(self.scheduler_config.max_num_seqs, self.opts["k"])
        return super()._dummy_sampler_run(hidden_states)

    # ------------------------------------------------------------------------------------ verify
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        req_ids, qsl, computed = compat.batch_rows(self)
        entries = []
        self._verifying = {}
        self.totals["forwards"] += len(req_ids)
        for i, rid in enumerate(req_ids):
            q0, q1, c = int(qsl[i]), int(qsl[i + 1]), int(computed[i])
            drafts = compat.scheduled_drafts(scheduler_output, rid)
            tree = self.trees.get(rid)
            D = len(drafts)
            entry = None
            if D and tree is not None and drafts == tree.tokens[:D] and rid not in self.failed:
                try:
                    tree = tree.prefix(D)  # vLLM may have cut the list for budget: a depth-ordered prefix is a tree
                    m = q1 - q0 - D
                    pos, mask = verify_layout(tree, m, c + m)
                    entry = Rows(q1 - q0, c, positions=pos, mask=mask)
                    self._verifying[rid] = tree
                except Exception as e:
                    self._fail(rid, "laying out its tree", e)
            if entry is None:  # a prefill chunk, a step without a tree, a failed request: causal
                pos = torch.arange(c, c + q1 - q0)
                mask = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool).tril()
                entry = Rows(q1 - q0, c, positions=pos, mask=mask)
            entries.append(entry)
        self._publish(build_step_batch(entries))
        return out

    def sample_tokens(self, grammar_output):
        """vLLM's step output, without the prompt logprobs of a request that failed in the step that finished its
        prompt: vLLM computed them there, the request emits nothing, and vLLM's scheduler asserts that a request
        emitting nothing has none (the engine ended); the request's error is all it gets."""
        out = super().sample_tokens(grammar_output)
        plp = getattr(out, "prompt_logprobs_dict", None)
        for rid in [r for r in plp or () if r in self.failed]:
            plp.pop(rid)
        return out

    def _sample(self, logits, spec_decode_metadata):
        self._publish(None)
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        req_ids, _, _ = compat.batch_rows(self)
        cu = compat.sampled_rows_end(spec_decode_metadata)  # host counts: no device read
        greedy = logits.argmax(-1).cpu()  # every request's greedy verdict rows, one copy
        outs: list[list[int]] = [[] for _ in req_ids]
        live = [i for i in range(len(req_ids))  # vLLM discards an unfinished prefill: draw nothing for it
                if not compat.prefill_unfinished(self, i)]
        live = [i for i in live if req_ids[i] not in self.failed]
        trees = [self._verifying.get(req_ids[i]) or TokenTree() for i in live]
        starts = [0, *cu[:-1]]
        verdicts = self._accept(live, trees, [logits[starts[i]: cu[i]] for i in live],
                                [greedy[starts[i]: cu[i]] for i in live], req_ids)
        for i, tree, out in zip(live, trees, verdicts):
            if out is None:  # failed (_accept)
                continue
            self.accepted[req_ids[i]] = len(out) - 1
            if len(tree):
                self.totals["steps"] += 1
                self.totals["tree_nodes"] += len(tree)
            outs[i] = out
        width = max(2, max(map(len, outs), default=1))
        ids = torch.full((len(outs), width), -1, dtype=torch.int32)
        for i, out in enumerate(outs):
            ids[i, : len(out)] = torch.tensor(out, dtype=torch.int32)
        return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)

    def _accept(self, live: list[int], trees: list[TokenTree], logits: list, argmax: list, req_ids: list[str]) -> list:
        """:func:`accept_all` of the batch rows ``live``; where it raises, each request's walk is taken alone, and
        one that raises alone is failed (its verdict None)."""
        temps = [compat.request_temperature(self, i) for i in live]
        gens = [self._generator(req_ids[i], i) for i in live]
        try:
            return accept_all(trees, logits, temps, gens, argmax=argmax)
        except Exception as e:
            if engine_fault(e):
                raise
        out = []
        for k, i in enumerate(live):
            try:
                out += accept_all([trees[k]], [logits[k]], [temps[k]], [gens[k]], argmax=[argmax[k]])
            except Exception as e:
                self._fail(req_ids[i], "verifying its tree", e)
                out.append(None)
        return out

    def _generator(self, rid: str, row: int) -> torch.Generator | None:
        """The request's generator: vLLM's for a seeded request; for an unseeded sampled one, one seeded from
        its id (:func:`.runner.request_seed`), so every tensor-parallel rank accepts the same path."""
        gen = compat.request_generator(self, row)
        if gen is None and compat.request_temperature(self, row) > 0:
            gen = self._generators.get(rid)
            if gen is None:
                gen = self._generators[rid] = torch.Generator(device=self.device).manual_seed(request_seed(rid))
        return gen

    # ------------------------------------------------------------------------------------- draft
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        req_ids, _, _ = compat.batch_rows(self)
        drafts: list[list[int]] = [[] for _ in req_ids]
        rfs: list[int] = []
        live: list[tuple[int, str, DraftState]] = []
        max_pos = self.drafting.drafter.spec.max_position
        limit = min(self.model_config.max_model_len, max_pos)
        for i, rid in enumerate(req_ids):
            prompt, output = compat.request_tokens(self, rid)
            seq = prompt + output
            L = len(seq)
            rfs.append(L - self.accepted.pop(rid, 0) - 1)
            if not sampled_token_ids[i] or rid in self.failed:  # a chunked prefill still running: nothing to draft
                continue
            st = self._draft_state(rid, seq)
            if st is None or limit - L - 1 <= 0 or \
                    L + self.opts["k"] + self.drafting.drafter.spec.attention_block > min(self.max_len, max_pos):
                continue
            live.append((i, rid, st))
        if live and not self._draft([st for _, _, st in live]):
            for _, rid, _ in live:  # their drafting state may be half-written: start it again next step
                self._release(rid)
            live = []
        if live:
            for i, rid, st in live:
                tree = st.tree.prefix(limit - len(st.seq) - 1)
                self.trees[rid] = tree
                drafts[i] = list(tree.tokens)
        self.set_next_drafts(req_ids, drafts, [NextStep(r) for r in rfs])
        return drafts

    def _draft_state(self, rid: str, seq: list[int]) -> DraftState | None:
        """The request's drafting state, advanced to its tokens ``seq``; None when no drafter slot is free or it
        could not be advanced (the request then steps without a tree; its state starts again next step)."""
        st = self.states.get(rid)
        if st is not None and st.seq != seq[: len(st.seq)]:
            self._release(rid)
            st = None
        try:
            if st is None:
                if not self.free_slots:
                    return None
                st = DraftState([], self.free_slots.pop(), None)
                self.states[rid] = st
                st.rho = self.drafting.new_rho([])
            self.drafting.accepted(st, seq[len(st.seq):])
            return st
        except Exception as e:
            if engine_fault(e):
                raise
            self._release(rid)
            self.drafting_failures += 1
            logger.error("PRESTO: drafting state of request %s failed; it steps without a tree", rid, exc_info=e)
            return None

    def _draft(self, states: list[DraftState]) -> bool:
        """One batched drafting forward for ``states``; False when it raised. A drafting failure costs no request:
        they are verified without a tree this step (a plain AR step, whose token is the target's own), so the
        output is unchanged; the failure is logged."""
        try:
            self.drafting.draft(states, self.opts)
            return True
        except Exception as e:
            if engine_fault(e):
                raise
            self.drafting_failures += 1
            logger.error("PRESTO: drafting failed for %d requests; they decode this step without a tree (their "
                         "outputs are unchanged)", len(states), exc_info=e)
            return False

    def _release(self, rid: str) -> None:
        st = self.states.pop(rid, None)
        if st is not None:
            self.free_slots.append(st.slot)
        self.trees.pop(rid, None)

    def _on_request_state_removed(self, req_id, req_state) -> None:
        super()._on_request_state_removed(req_id, req_state)
        self._release(req_id)
        self.accepted.pop(req_id, None)
        self._generators.pop(req_id, None)

    def presto_stats(self) -> dict:
        """Totals since start: target forwards per request summed (``forwards``), tree verifications
        (``steps``) and their nodes, and ``tree_nodes / steps``."""
        t = dict(self.totals)
        t["nodes_per_tree"] = t["tree_nodes"] / max(1, t["steps"])
        t["drafting_requests"] = len(self.states)  # requests holding a drafter slot now
        t["drafting_failures"], t["failed"] = self.drafting_failures, self.failures
        return t
