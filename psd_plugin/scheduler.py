"""vLLM V1 scheduler for dLLMs: a step's canvases are scheduled whole, and committed blocks roll in.

Differences from vLLM's ``Scheduler`` (see :mod:`psd_plugin.worker` for the protocol):

- no bonus token: ``num_sampled_tokens_per_step = 0``, so a step that commits nothing rolls all its
  drafts back, and a step that completes a block reports the block's tokens as accepted;
- after each step the runner's ``recompute_from`` moves ``num_computed_tokens`` back to where the next
  forward starts (the K/V before it stays in the paged cache);
- the runner's ``extra_slots`` are reserved for the request on top of its scheduled tokens (private KV
  pages of extra draft canvases);
- spec-decode metrics in dLLM terms (as vLLM's own diffusion logging reads them): one *draft* = one
  decoding forward of a request, its *draft tokens* = the block's positions, *accepted tokens* = the tokens
  it committed; so ``vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts`` is TPF;
- all or nothing: a running request whose canvases do not fit the step's token budget waits for the
  next step instead of being cut (a cut canvas would waste a forward).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.metrics import SpecDecodingStats


class DLLMScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_sampled_tokens_per_step = 0
        # the runner's spec-decode bookkeeping counts drafts + 1 rows per request; a dLLM step may schedule
        # drafts only (no recomputed token), so keep one row per request free in its buffers
        self.max_num_scheduled_tokens = max(1, self.max_num_scheduled_tokens - self.max_num_running_reqs)
        self._extra_slots: dict[str, int] = {}
        allocate = self.kv_cache_manager.allocate_slots

        def allocate_slots(request, num_new_tokens, *a, **kw):
            extra = self._extra_slots.get(request.request_id, 0)
            kw["num_lookahead_tokens"] = max(kw.get("num_lookahead_tokens", 0), extra)
            return allocate(request, num_new_tokens, *a, **kw)

        self.kv_cache_manager.allocate_slots = allocate_slots

    def schedule(self, *args, **kwargs):
        budget = self.max_num_scheduled_tokens
        deferred, kept = [], []
        for r in self.running:
            need = r.num_tokens_with_spec - r.num_computed_tokens
            if r.spec_token_ids and need > budget:
                deferred.append(r)
            else:
                kept.append(r)
                budget -= max(0, need)
        if not deferred:
            return super().schedule(*args, **kwargs)
        self.running = kept
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.running = deferred + self.running

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        if not self.log_stats or not num_draft_tokens:
            return None
        if spec_decoding_stats is None:
            spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        spec_decoding_stats.observe_draft(num_draft_tokens=self.num_spec_tokens,
                                          num_accepted_tokens=min(num_accepted_tokens, self.num_spec_tokens))
        return spec_decoding_stats

    def update_draft_token_ids(self, draft_token_ids) -> None:
        apply_draft_updates(self, draft_token_ids)
        for req_id, extra in zip(draft_token_ids.req_ids, getattr(draft_token_ids, "extra_slots", None) or []):
            if req_id in self.requests:
                self._extra_slots[req_id] = extra

    def _free_request(self, request, *args, **kwargs):
        self._extra_slots.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


def apply_draft_updates(scheduler: Scheduler, draft_token_ids) -> None:
    """Set each running request's drafts and roll ``num_computed_tokens`` back to the runner's
    ``recompute_from`` (where its next forward starts; the K/V before it stays in the paged cache)."""
    rfs = getattr(draft_token_ids, "recompute_from", None)
    for i, (req_id, drafts) in enumerate(zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids)):
        r = scheduler.requests.get(req_id)
        if r is None or r.is_finished():
            continue
        r.spec_token_ids = list(drafts)
        if rfs is not None:
            r.num_computed_tokens = min(r.num_computed_tokens, rfs[i])
