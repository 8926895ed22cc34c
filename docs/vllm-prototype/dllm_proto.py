"""Throwaway prototype: single-canvas dLLM decoding on vLLM's V1 CPU runner (prefix mode, LLaDA)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput, SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

L = 8
LOG = []


class StubProposer:
    def __init__(self, vllm_config):
        pass

    def load_model(self, target_model):
        pass

    def propose(self, *a, **k):
        raise RuntimeError("unused")


@dataclass
class DLLMDraftTokenIds(DraftTokenIds):
    recompute_from: list[int] = field(default_factory=list)


class ProtoScheduler(Scheduler):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.num_sampled_tokens_per_step = 0

    def update_draft_token_ids(self, d):
        for rid, toks, rf in zip(d.req_ids, d.draft_token_ids, d.recompute_from):
            r = self.requests.get(rid)
            if r is None or r.is_finished():
                continue
            r.spec_token_ids = list(toks)
            r.num_computed_tokens = min(r.num_computed_tokens, rf)


@dataclass
class St:
    prompt: list
    total: int
    blocks: list
    blk: int = 0
    fresh: bool = True
    dec: object = None
    nfe: int = 0


class ProtoRunner(CPUModelRunner):
    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        from model_executor.models.configs import ArchSpec
        self.spec = ArchSpec.from_hf_config(vllm_config.model_config.hf_config)
        self.dl: dict[str, St] = {}
        self._rows: list = []
        self._rf: list = []

    def _on_request_state_removed(self, req_id, req_state):
        self.dl.pop(req_id, None)

    def _mk(self, st: St):
        from model_executor.decoding import make_decoder
        b0, b1 = st.blocks[st.blk]
        st.dec = make_decoder("confidence", torch.full((b1 - b0,), self.spec.mask_token_id), self.spec.mask_token_id)
        st.fresh = True

    def _state(self, rid):
        st = self.dl.get(rid)
        if st is None:
            rs = self.requests[rid]
            P = len(rs.prompt_token_ids)
            total = P + rs.sampling_params.max_tokens
            starts = list(range(P, total, L))
            st = St(list(rs.prompt_token_ids), total, [(a, min(total, a + L)) for a in starts])
            self._mk(st)
            self.dl[rid] = st
        return st

    def _prepare_inputs(self, so, nst):
        li, sdm, mx = super()._prepare_inputs(so, nst)
        shift = 1 if self.spec.shift_logits else 0
        rows, plan = [], []
        qsl = self.query_start_loc.np
        for i, rid in enumerate(self.input_batch.req_ids):
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            st = self._state(rid)
            if not drafts:
                plan.append(None)
                continue
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            b0, b1 = st.blocks[st.blk]
            r0 = int(qsl[i]) + (b0 - shift - c)
            assert r0 >= int(qsl[i]), (r0, qsl[i])
            plan.append(len(rows))
            rows.extend(range(r0, r0 + b1 - b0))
            LOG.append(("step", rid, c, int(nst[i]), len(drafts), b0, b1))
        self._rows = plan
        if not rows:
            rows = [0]
        return torch.tensor(rows, dtype=torch.int64), sdm, mx

    def sample_tokens(self, grammar_output):
        if self.execute_model_state is None:
            return super().sample_tokens(grammar_output)
        ems = self.execute_model_state
        self.execute_model_state = None
        so, logits = ems.scheduler_output, ems.logits
        shift = 1 if self.spec.shift_logits else 0
        outs, drafts, rfs = [], [], []
        for i, rid in enumerate(self.input_batch.req_ids):
            st = self._state(rid)
            emit = []
            if self._rows[i] is not None:
                b0, b1 = st.blocks[st.blk]
                lg = logits[self._rows[i]: self._rows[i] + b1 - b0]
                st.nfe += 1
                st.fresh = False
                st.dec.update([lg.float()])
                if st.dec.done:
                    emit = st.dec.state.tolist()
                    if st.blk + 1 < len(st.blocks):
                        st.blk += 1
                        self._mk(st)
            outs.append(emit)
            b0, b1 = st.blocks[st.blk]
            canvas = st.dec.canvases()[0].tolist()
            drafts.append(canvas + [self.spec.mask_token_id] * (st.total - b1))
            rfs.append(0 if st.fresh else b0 - shift)
        W = max(2, max(len(o) for o in outs))
        t = torch.full((len(outs), W), -1, dtype=torch.int32)
        for i, o in enumerate(outs):
            t[i, : len(o)] = torch.tensor(o, dtype=torch.int32) if o else t[i, :0]
        (nans, _, lp, valid, plp, rid_copy, r2i_copy, _) = self._bookkeeping_sync(
            so, SamplerOutput(sampled_token_ids=t, logprobs_tensors=None), logits, ems.hidden_states,
            so.total_num_scheduled_tokens)
        self._draft_token_ids = drafts
        self._draft_token_req_ids = list(self.input_batch.req_ids)
        self._rf = rfs
        return ModelRunnerOutput(req_ids=rid_copy, req_id_to_index=r2i_copy, sampled_token_ids=valid,
                                 logprobs=None, prompt_logprobs_dict=plp, kv_connector_output=None)

    def take_draft_token_ids(self):
        if not self._draft_token_req_ids:
            return None
        d = DLLMDraftTokenIds(list(self._draft_token_req_ids), self._draft_token_ids, self._rf)
        self._draft_token_req_ids = None
        return d

    def dllm_nfe(self):
        return {k: v.nfe for k, v in self.dl.items()}


class ProtoWorker(CPUWorker):
    def init_device(self):
        import vllm.v1.worker.cpu_worker as m
        orig = m.CPUModelRunner
        m.CPUModelRunner = ProtoRunner
        try:
            super().init_device()
        finally:
            m.CPUModelRunner = orig


def _worker_nfe(self):
    return self.model_runner.dllm_nfe()


ProtoWorker.dllm_nfe = _worker_nfe
