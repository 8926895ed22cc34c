"""PRESTO inside vLLM: ``speculative_config={"method": "psd", "mode": "presto", ...}`` on an AR (Llama) target.

A step of a running request schedules its *pending* tokens (the last step's accepted path and bonus token;
the first step after prefill: none but the sampled token) followed by its draft tree's nodes as vLLM draft
tokens, in the tree's order (by depth, so any prefix vLLM may cut for budget is still a tree). Then:

1. ``_prepare_inputs``: the nodes' positions become ``n - 1 + depth`` (vLLM numbered them sequentially; their
   K/V goes to slots past the accepted context, which nothing reads before they are rewritten) and the
   step's tree plan is published for :class:`attention_backends.vllm_tree.TreeCPUAttentionImpl`, which
   recomputes those rows under the ancestor mask.
2. ``_sample``: instead of vLLM's linear rejection sampler, the tree walk of
   :mod:`model_executor.decoding.tree` (greedy: the longest path matching the target's argmax, plus the
   bonus token; sampling: lossless multi-candidate rejection sampling) on the logits of the root (the last
   pending token) and of every node, which are exactly the rows vLLM's spec-decode metadata selects.
3. ``propose_draft_token_ids``: one batched forward of the block-diffusion drafter
   (:class:`model_executor.presto_engine.TreeDrafter`, plain PyTorch, its own paged cache) and a tree per
   request.
4. The runner reports ``recompute_from = n`` (the length before the tree) and :class:`PrestoScheduler` rolls
   ``num_computed_tokens`` back to it, so the accepted tokens are re-forwarded next step as pending tokens
   and their K/V is written exactly; rejected nodes leave nothing behind. This is what
   :class:`model_executor.presto_engine.PrestoEngine` does, so both engines forward the same rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec
import torch
from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from attention_backends.prefix_attention import AttentionPlan
from attention_backends.torch_ref import TorchPrefixAttention
from attention_backends.vllm_tree import TreeStep, install_tree_attention, set_tree_step
from model_executor.decoding.ngram import NGramModel
from model_executor.decoding.tree import TokenTree, accept_greedy, accept_sampling
from model_executor.models.reference import ReferenceDLLM
from model_executor.presto_engine import DraftState, TreeDrafter, draft_options

from .config import ConfigError, TreeKnobs, parse_config
from .worker import DLLMDraftTokenIds, RunnerSwapWorker

logger = init_logger(__name__)

SCHEDULER_CLS = "psd_plugin.presto.PrestoScheduler"
WORKER_CLS = "psd_plugin.presto.PrestoWorker"


class PrestoSpeculativeConfig(TreeKnobs, forbid_unknown_fields=True, kw_only=True):
    """The ``speculative_config`` of PRESTO mode: :class:`~psd_plugin.config.TreeKnobs` plus ``method`` ("psd"),
    ``mode`` ("presto") and ``model`` (the drafter checkpoint; default: the embedded drafter-tiny)."""

    method: Literal["psd"] = "psd"
    mode: Literal["presto"] = "presto"
    model: str | None = None


def parse(raw: dict) -> PrestoSpeculativeConfig:
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    if "drafter" in raw:
        raise ConfigError("speculative_config.drafter: PRESTO mode names its drafter with 'model'")
    return parse_config(msgspec.json.encode(raw), PrestoSpeculativeConfig, where="speculative_config")


def translate(engine_args, target_model_config, target_parallel_config, raw: dict) -> None:
    """Rewrite ``engine_args`` for PRESTO mode (the AR-target branch of :func:`psd_plugin.speculative.translate`)."""
    from vllm.platforms import current_platform

    from . import DEFAULT_DRAFTER, default_ngram
    from .speculative import PROPOSER_CLS

    cfg = parse(raw)
    hf = target_model_config.hf_config
    if getattr(hf, "model_type", None) != "llama":
        raise ConfigError(f"speculative_config mode 'presto' verifies with a Llama-format AR target; "
                          f"{target_model_config.model} is model_type {getattr(hf, 'model_type', '?')!r}")
    drafter = Path(cfg.model) if cfg.model else DEFAULT_DRAFTER
    if not (drafter / "config.json").exists():
        raise ConfigError(f"speculative_config.model {drafter}: not a model directory (no config.json)")
    from model_executor.models.configs import ArchSpec
    from model_executor.models.reference import read_config

    spec = ArchSpec.from_hf_config(read_config(drafter))
    if spec.family != "sdar":
        raise ConfigError(f"speculative_config.model {drafter}: the PRESTO drafter must be a block-diffusion "
                          f"(SDAR-format) model, got {spec.family}")
    if spec.vocab_size != hf.vocab_size:
        raise ConfigError(f"speculative_config.model {drafter}: vocabulary {spec.vocab_size} != the target's "
                          f"{hf.vocab_size}; the drafter must use the target's tokenizer")
    ngram = Path(cfg.ngram) if cfg.ngram else default_ngram(drafter)
    if ngram is not None:
        try:
            NGramModel.load(ngram)  # a missing or corrupt file fails here, before the engine starts
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"speculative_config.ngram: {e}") from None
    if not current_platform.is_cpu():
        raise ConfigError("psd-plugin's PRESTO path runs on vLLM's V1 CPU runner so far; on GPUs use the "
                          "reference engine (`psd generate --method presto`)")
    resolved = msgspec.structs.replace(cfg, model=str(drafter), ngram=str(ngram) if ngram else None)
    engine_args.additional_config = {**dict(engine_args.additional_config or {}),
                                     "presto": msgspec.to_builtins(resolved)}
    engine_args.speculative_config = {"method": "custom_class", "model": PROPOSER_CLS,
                                      "num_speculative_tokens": cfg.tree_budget}
    for name, want, have in (("scheduler_cls", SCHEDULER_CLS, engine_args.scheduler_cls),
                             ("worker_cls", WORKER_CLS, target_parallel_config.worker_cls)):
        if have not in (None, "auto", want):
            raise ConfigError(f"{name} {have!r}: PRESTO needs psd-plugin's; leave {name} unset")
    engine_args.scheduler_cls = SCHEDULER_CLS
    target_parallel_config.worker_cls = WORKER_CLS
    engine_args.worker_cls = WORKER_CLS


def from_vllm_config(vllm_config) -> PrestoSpeculativeConfig:
    from .speculative import stored_config

    return stored_config(vllm_config, "presto", PrestoSpeculativeConfig, "{'method': 'psd', 'mode': 'presto', ...}")


class PrestoScheduler(Scheduler):
    """vLLM's scheduler (one bonus token per step) plus the runner's ``recompute_from`` rewind."""

    def update_draft_token_ids(self, draft_token_ids) -> None:
        from .scheduler import apply_draft_updates

        apply_draft_updates(self, draft_token_ids)


class PrestoModelRunner(CPUModelRunner):
    """``CPUModelRunner`` that drafts token trees and verifies them (module docstring)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.presto = from_vllm_config(vllm_config)
        self.states: dict[str, DraftState] = {}
        self.trees: dict[str, TokenTree] = {}
        self.accepted: dict[str, int] = {}
        self._rf: dict[str, int] = {}
        # forwards: target forwards requests took part in (prefills included); steps: tree verifications
        self.totals = {"forwards": 0, "steps": 0, "tree_nodes": 0}

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        cfg = self.presto
        dtype = self.model_config.dtype
        drafter = ReferenceDLLM.from_pretrained(cfg.model, dtype=dtype)
        ngram = NGramModel.load(cfg.ngram) if cfg.ngram else None
        self.drafting = TreeDrafter(drafter, ngram, TorchPrefixAttention())
        self.opts = draft_options(drafter, search=cfg.search, tree_budget=cfg.tree_budget, width=cfg.width,
                                  top_b=cfg.top_b, lam=cfg.lam,
                                  adaptive=(cfg.adaptive_beta, cfg.adaptive_c) if cfg.adaptive_beta else None,
                                  draft_len=cfg.draft_len, candidates=cfg.candidates)
        # one drafter sequence per running request; torch.empty pages stay untouched until written
        self.max_len = self.model_config.max_model_len + self.opts["k"] + drafter.spec.block_size
        self.drafting.allocate([self.max_len] * self.scheduler_config.max_num_seqs)
        self.free_slots = list(range(self.scheduler_config.max_num_seqs))
        n = install_tree_attention(self.vllm_config)
        logger.info("PRESTO: drafter %s (%s search, budget %d), tree attention on %d layers", cfg.model,
                    cfg.search, cfg.tree_budget, n)

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return True  # each tree is capped to the room its request has left

    # ------------------------------------------------------------------------------------ verify
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        qsl = self.query_start_loc.np
        rows, qo, prefix, table, masks = [], [0], [], [], []
        bt = self.input_batch.block_table[0]
        self._verifying: dict[str, TokenTree] = {}
        self.totals["forwards"] += len(self.input_batch.req_ids)
        for i, rid in enumerate(self.input_batch.req_ids):
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid) or []
            tree = self.trees.get(rid)
            D = len(drafts)
            if not D or tree is None or list(drafts) != tree.tokens[:D]:
                continue
            tree = tree.prefix(D)  # vLLM may have cut the list for budget: a depth-ordered prefix is a tree
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            c = int(self.input_batch.num_computed_tokens_cpu[i])
            m = q1 - q0 - D
            n = c + m
            self.positions[q0 + m: q1] = torch.tensor(tree.depth, dtype=self.positions.dtype) + n - 1
            rows.append(torch.arange(q0, q1))
            qo.append(qo[-1] + q1 - q0)
            prefix.append(c)
            table.append(torch.from_numpy(bt.block_table.np[i]).long())
            masks.append(tree.verify_mask(m))
            self._verifying[rid] = tree
        step = None
        if rows:
            plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), torch.stack(table), bt.block_size,
                                 kind="custom", custom_masks=masks)
            step = TreeStep(torch.cat(rows), plan)
        set_tree_step(step)
        return out

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        set_tree_step(None)
        cu = spec_decode_metadata.cu_num_sampled_tokens.tolist()
        outs, start = [], 0
        for i, rid in enumerate(self.input_batch.req_ids):
            end = cu[i]
            lg = logits[start:end]
            start = end
            tree = self._verifying.get(rid) or TokenTree()
            temp = float(self.input_batch.temperature_cpu[i])
            if temp > 0:
                probs = torch.softmax(lg[: len(tree) + 1].double() / temp, -1)
                out, _ = accept_sampling(tree, probs, self.input_batch.generators.get(i))
            else:
                out, _ = accept_greedy(tree, lg[: len(tree) + 1].argmax(-1))
            self.accepted[rid] = len(out) - 1
            if len(tree):
                self.totals["steps"] += 1
                self.totals["tree_nodes"] += len(tree)
            outs.append(out)
        width = max(2, max(map(len, outs), default=1))
        ids = torch.full((len(outs), width), -1, dtype=torch.int32)
        for i, out in enumerate(outs):
            ids[i, : len(out)] = torch.tensor(out, dtype=torch.int32)
        return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)

    # ------------------------------------------------------------------------------------- draft
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts: list[list[int]] = []
        live: list[tuple[int, str, DraftState]] = []
        max_pos = self.drafting.drafter.spec.max_position
        for i, rid in enumerate(self.input_batch.req_ids):
            L = int(self.input_batch.num_tokens_no_spec[i])
            seq = self.input_batch.token_ids_cpu[i, :L].tolist()
            self._rf[rid] = L - self.accepted.pop(rid, 0) - 1
            drafts.append([])
            if not sampled_token_ids[i]:  # a chunked prefill still running: nothing sampled, nothing to draft
                continue
            st = self.states.get(rid)
            if st is not None and st.seq != seq[: len(st.seq)]:
                self._release(rid)
                st = None
            if st is None:
                if not self.free_slots:
                    continue
                st = DraftState([], self.free_slots.pop(), None)
                st.rho = self.drafting.new_rho([])
                self.states[rid] = st
            self.drafting.accepted(st, seq[len(st.seq):])
            room = min(self.model_config.max_model_len, max_pos) - L - 1
            if room <= 0 or L + self.opts["k"] + self.drafting.drafter.spec.block_size > min(self.max_len, max_pos):
                continue
            live.append((i, rid, st))
        if live:
            self.drafting.draft([st for _, _, st in live], self.opts)
            for i, rid, st in live:
                room = min(self.model_config.max_model_len, max_pos) - len(st.seq) - 1
                tree = st.tree.prefix(room)
                self.trees[rid] = tree
                drafts[i] = list(tree.tokens)
        return drafts

    def take_draft_token_ids(self):
        if not self._draft_token_req_ids:
            return None
        drafts, req_ids = self._get_draft_token_ids_cpu()
        rfs = [self._rf.get(rid, 1 << 30) for rid in req_ids]
        self._draft_token_req_ids = None
        return DLLMDraftTokenIds(list(req_ids), drafts, rfs, [0] * len(req_ids))

    def _release(self, rid: str) -> None:
        st = self.states.pop(rid, None)
        if st is not None:
            self.free_slots.append(st.slot)
        self.trees.pop(rid, None)

    def _on_request_state_removed(self, req_id, req_state) -> None:
        super_hook = getattr(super(), "_on_request_state_removed", None)
        if super_hook is not None:
            super_hook(req_id, req_state)
        self._release(req_id)
        self.accepted.pop(req_id, None)
        self._rf.pop(req_id, None)

    def presto_stats(self) -> dict:
        """Totals since start: target forwards per request summed (``forwards``), tree verifications
        (``steps``) and their nodes, and ``tree_nodes / steps``."""
        t = dict(self.totals)
        t["nodes_per_tree"] = t["tree_nodes"] / max(1, t["steps"])
        t["drafting_requests"] = len(self.states)  # requests holding a drafter slot now
        return t


class PrestoWorker(RunnerSwapWorker):
    """Builds :class:`PrestoModelRunner` (``worker_cls`` set by PRESTO mode)."""

    runner_cls = PrestoModelRunner

    def presto_stats(self) -> dict:
        """Verification figures (``LLM.collective_rpc("presto_stats")``): forwards, tree steps, nodes."""
        return self.model_runner.presto_stats()
