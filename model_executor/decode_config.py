"""One typed dLLM decoding config: the knobs a user sets, resolved once against the model, checked by one
function, and turned into decoders by one factory.

Every entry point goes through it: the ``psd`` command's ``--config``, the reference engine's ``generate``
and vLLM's ``speculative_config={"method": "psd", ...}`` (:mod:`psd_plugin.vllm.config` resolves it in the
front end; the scheduler, the per-request checks and the runner read the same resolved object).

- :class:`DecodeKnobs`: the user's knobs (msgspec: a bad value is an error naming the field and the
  allowed values).
- :func:`resolve`: the knobs plus the method, checked against the model (:class:`~.models.configs.ArchSpec`),
  with the model-dependent defaults filled in (block size, cache mode) and Spiffy's draft graph attached.
- :class:`DecodeConfig`: the result, immutable. :meth:`DecodeConfig.check_request` holds the per-request
  rules (penalties), :meth:`DecodeConfig.sampling` a request's sampling options, :meth:`DecodeConfig.step_rows`
  the one formula for how many rows a step of a request forwards, :meth:`DecodeConfig.decoder_factory` builds
  each block's decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Literal

import msgspec
import torch

from .block_schedule import CACHE_MODES, CacheSchedule, plan_blocks
from .decoding import METHODS, BlockDecoder, DraftDAG, Sampling, make_decoder
from .decoding.policies import SPATIAL_POLICIES

# Methods that give no logprobs: every canvas of their step holds positions committed from the last forward's
# predictions (LoPA's branches all extend its first, FreeDave's drafts all its first), whose distribution that
# step does not compute (DecodeConfig.check_request)
NO_LOGPROBS = ("lopa", "freedave")

Threshold = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MAX_SKIP_DEPTH = 10  # dag_shape skip: 55 drafts a step


class ConfigError(ValueError):
    """A user-supplied configuration is invalid; the message names the field."""


class DecodeKnobs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Knobs of the decoding methods; each method reads its own.

    - ``threshold``: τ of ``confidence``, the anchor threshold of ``localleap`` and the unmasking threshold of
      ``joint_threshold``, in (0, 1].
    - ``edit_threshold``, ``max_post_edit_steps``: ``joint_threshold`` (LLaDA2.1's editing decoder): a filled
      token is replaced by a different prediction more probable than ``edit_threshold`` (in [0, 1]; 0: any
      change, 1: never), for at most ``max_post_edit_steps`` forwards after the block's last mask is filled.
    - ``relaxed_threshold``, ``radius``: LocalLeap's neighbour threshold and window (block positions).
    - ``policy``: spatial backbone of ``psd``, ``lopa`` and Spiffy's base: static | confidence | localleap.
    - ``depth``: PSD draft-DAG depth d; 0 = the spatial policy alone.
    - ``dag_shape``: PSD's draft DAG: ``chain`` (default: nested prefixes of σ, d drafts) | ``skip`` (the chain
      plus each prefix with one earlier rank left out: d(d+1)/2 drafts, depth at most 10; more drafts a step,
      more tokens accepted a forward).
    - ``branches``: LoPA lookahead branches k; 0 = the spatial policy alone.
    - ``steps``: FreeDave draft steps d (1 = static decoding).
    - ``graph``: Spiffy draft-graph file (``psd calibrate``); default: the graph shipped for the embedded
      model and the chosen base ``policy`` (static or confidence).
    - ``budget``: Spiffy's pruned draft count D* per forward.
    - ``cache``: ``none`` | ``prefix`` (LLaDA, Dream; default) | ``dual`` (LLaDA, Dream: Fast-dLLM's DualCache,
      the block's later steps forward the block alone against the prefix and the masks after it as the block's
      first step left them) | ``block`` (block-causal SDAR and LLaDA2, exact; their default).
    - ``suffix``: bidirectional models (LLaDA, Dream), an approximation: a step forwards at most this many
      positions after the current block instead of every mask to the end of the answer region (fewer rows a
      forward on long answers). None (default): all of them.
    - ``refresh``: the prefix and dual caches, what a block's first step recomputes before the block: ``full``
      (default, Fast-dLLM: everything), ``answer`` (keeps the prompt's K/V from the request's first forward; an
      approximation), ``last`` (keeps every K/V cached so far, recomputes from the previous block on; an
      approximation). :mod:`model_executor.block_schedule` gives the windows.
    - ``sample_confidence``: what a sampled position's commit confidence is (:mod:`.decoding.sampling`):
      ``drawn`` (default; LLaDA, Fast-dLLM: the model's untempered probability of the drawn token) |
      ``tempered`` (SGLang's dLLM sampler: ``min(p_max, exp((z_drawn - z_max) / T))``).
    """

    threshold: Threshold = 0.9
    relaxed_threshold: Threshold = 0.75
    radius: Annotated[int, msgspec.Meta(ge=0, le=64)] = 4
    policy: Literal["static", "confidence", "localleap"] = "confidence"
    depth: Annotated[int, msgspec.Meta(ge=0, le=32)] = 3
    dag_shape: Literal["chain", "skip"] = "chain"
    branches: Annotated[int, msgspec.Meta(ge=0, le=32)] = 3
    steps: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    graph: str | None = None
    budget: Annotated[int, msgspec.Meta(ge=1, le=64)] = 3
    edit_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.9
    max_post_edit_steps: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 16
    cache: Literal["none", "prefix", "dual", "block"] | None = None
    suffix: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] | None = None
    refresh: Literal["full", "answer", "last"] = "full"
    sample_confidence: Literal["drawn", "tempered"] = "drawn"


@dataclass(frozen=True)
class DecodeConfig:
    """A resolved decoding config (:func:`resolve`): what every engine decodes a request with."""

    method: str
    block_size: int  # the decoding block: tokens a request commits block by block
    cache: str
    knobs: DecodeKnobs
    aligned: bool  # blocks cut at multiples of the model's attention block (SDAR, LLaDA2)
    graph: object = None  # Spiffy's loaded and checked DraftGraph
    dag: object = None  # PSD: a draft DAG other than the nested one (tests, calibrated DAGs)
    shift: int = 0  # 1 when position i is predicted by the output at i - 1 (Dream)
    attention_block: int = 1  # the model's attention block (block-causal models)

    @property
    def schedule(self) -> CacheSchedule:
        """The windows a request's steps forward (:class:`~.block_schedule.CacheSchedule`)."""
        k = self.knobs
        return CacheSchedule(self.cache, self.shift, self.attention_block, k.suffix, k.refresh)

    def describe(self) -> dict:
        """The config as plain values (method, block size, cache and the knobs), for reports."""
        return {"method": self.method, "block_size": self.block_size, **msgspec.structs.asdict(self.knobs)}

    def max_canvases(self) -> int:
        """The most canvases one step of a request forwards (the state and its drafts)."""
        k = self.knobs
        if self.method == "psd" and self.dag is not None:
            return len(self.dag.sets)
        return {"psd": DraftDAG.size(k.dag_shape, k.depth), "lopa": k.branches + 1, "freedave": k.steps,
                "spiffy": k.budget + 1}.get(self.method, 1)

    def step_rows(self, prompt_len: int, max_tokens: int, chunked: bool = False) -> int:
        """The most rows one step of a request forwards, over all its canvases (what it needs of a step's
        token budget); the first step of a block forwards its state canvas alone, the request's first the prompt
        too (``block``: vLLM may prefill the prompt apart; ``none``: every step is a full window). vLLM prefills
        a prompt, and re-prefills a preempted request's prompt and committed tokens, in one step (chunked
        prefill is off for non-causal layers), and a preempted request's replays run to the same point
        (:meth:`~model_executor.dllm_request.DLLMRequest.preempted`): up to the start of the last block.
        ``chunked``: vLLM prefills in chunks here (block-causal pages of whole attention blocks,
        :func:`psd_plugin.vllm.config.chunks_prompts`), so a re-prefill is no single step."""
        P, M, B, s = prompt_len, max_tokens, self.block_size, self.knobs.suffix
        W = M if s is None else min(M, B + s)  # a block and the masks forwarded after it
        later = {"none": P + M, "prefix": W + 1, "dual": min(M, B) + 1,
                 "block": 2 * B + P % B}[self.cache]  # block: uncached finished tokens + the current block
        if self.cache == "block":
            first = 0
        elif self.cache == "none" or self.knobs.refresh == "full":
            first = P + M  # the last block's first window runs from 0 to the end of the answer region
        else:  # the request's first window; a later block's from the prompt's end, or from the previous block
            later_first = M if self.knobs.refresh == "answer" or s is None else min(M, 2 * B + s)
            first = max(P + W, later_first + 1)
        refill = 0 if chunked else plan_blocks(P, M, B, self.aligned)[-1][0]  # preempted in its last block
        return max(first, self.max_canvases() * later, refill)

    def check_request(self, penalized: bool = False, logprobs: bool = False) -> None:
        """Raise :class:`ConfigError` for request options this config cannot decode (every method samples):
        ``penalized``, a request with penalties; ``logprobs``, one asking for logprobs."""
        if penalized and self.method not in SPATIAL_POLICIES:
            raise ConfigError(f"penalties with decoding {self.method!r}: they count the tokens committed so far, "
                              "which its draft canvases would see out of date; use decoding "
                              f"{' | '.join(SPATIAL_POLICIES)}")
        if logprobs and self.method in NO_LOGPROBS:
            raise ConfigError(
                f"logprobs with decoding {self.method!r}: a step's canvases all start from tokens committed from "
                "the last forward's predictions (LoPA's first branch, FreeDave's first draft), so that forward has "
                "no distribution for them; use decoding "
                f"{' | '.join(m for m in METHODS if m not in NO_LOGPROBS)}")

    def sampling(self, temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
                 ) -> Sampling | None:
        """A request's :class:`~.decoding.Sampling` under this config (None: greedy, ``temperature`` 0); ``top_k``
        -1 or 0 keeps every token."""
        if not temperature > 0:
            return None
        return Sampling(temperature, seed, max(top_k, 0), top_p, min_p, self.knobs.sample_confidence)

    def decoder_factory(self, mask_id: int, sampling: Sampling | None = None
                        ) -> Callable[[torch.Tensor], BlockDecoder]:
        """``make(block)``: the decoder of one block of a request sampled with ``sampling`` (None: greedy)."""
        k = self.knobs
        kw = dict(threshold=k.threshold, relaxed_threshold=k.relaxed_threshold, radius=k.radius, policy=k.policy,
                  depth=k.depth, dag_shape=k.dag_shape, branches=k.branches, steps=k.steps, budget=k.budget,
                  graph=self.graph, dag=self.dag, sampling=sampling, edit_threshold=k.edit_threshold, max_post_edit_steps=k.max_post_edit_steps)

        def make(block: torch.Tensor) -> BlockDecoder:
            return make_decoder(self.method, block, mask_id, **kw)
        return make


def resolve(method: str, knobs: DecodeKnobs, spec, *, block_size: int | None = None, graph=None, dag=None,
            where: str = "config") -> DecodeConfig:
    """Check ``method`` and ``knobs`` against the model ``spec`` and fill the model's defaults: a block-causal
    model (SDAR, LLaDA2) decodes in its attention block with the ``block`` cache (or ``none``); a bidirectional
    one in blocks of ``block_size`` (default 8) with ``prefix`` (or ``none`` / ``dual``). ``graph``: Spiffy's
    loaded draft graph (the caller loads and checks the file)."""
    if method not in METHODS:
        raise ConfigError(f"{where}: method {method!r}; allowed: {', '.join(METHODS)}")
    cache = knobs.cache
    if cache is not None and cache not in CACHE_MODES:
        raise ConfigError(f"{where}.cache {cache!r}; allowed: {', '.join(CACHE_MODES)}")
    if block_size is not None and block_size <= 0:
        raise ConfigError(f"{where}.block_size must be > 0 (got {block_size})")
    if spec.attention == "block_causal":
        if block_size not in (None, spec.attention_block):
            raise ConfigError(f"{where}.block_size {block_size}: a block-causal {spec.family} model decodes in its "
                              f"attention block; allowed: {spec.attention_block}")
        if cache not in (None, "none", "block"):
            raise ConfigError(f"{where}.cache {cache!r} is for bidirectional models; a block-causal {spec.family} "
                              "model allows: none, block")
        block_size, cache = spec.attention_block, cache or "block"
    else:
        if cache == "block":
            raise ConfigError(f"{where}.cache 'block' is exact only for block-causal models (SDAR, LLaDA2); "
                              f"{spec.family} allows: none, prefix, dual")
        block_size, cache = block_size or 8, cache or "prefix"
    if knobs.suffix is not None and spec.attention == "block_causal":
        raise ConfigError(f"{where}.suffix {knobs.suffix}: a block-causal {spec.family} model forwards no masks after "
                          "the block; suffix is for bidirectional models (LLaDA, Dream)")
    if knobs.refresh != "full" and cache not in ("prefix", "dual"):
        raise ConfigError(f"{where}.refresh {knobs.refresh!r} is for the prefix and dual caches (cache is {cache!r}); "
                          f"allowed with cache {cache!r}: full")
    if knobs.dag_shape == "skip" and knobs.depth > MAX_SKIP_DEPTH:
        drafts = knobs.depth * (knobs.depth + 1) // 2  # not built: DraftDAG.shaped keeps what it builds
        raise ConfigError(f"{where}.depth {knobs.depth} with dag_shape 'skip' would draft {drafts} canvases a step; "
                          f"allowed: depth 0-{MAX_SKIP_DEPTH} (or dag_shape 'chain')")
    if method == "spiffy" and graph is None:
        raise ConfigError(f"{where}: method 'spiffy' needs a draft graph ('graph': a path from psd calibrate)")
    cfg = DecodeConfig(method, block_size, cache, msgspec.structs.replace(knobs, cache=cache),
                       aligned=spec.attention == "block_causal", graph=graph if method == "spiffy" else None, dag=dag,
                       shift=int(spec.shift_logits), attention_block=spec.attention_block or 1)
    cfg.decoder_factory(spec.mask_token_id)(torch.zeros(1, dtype=torch.long))  # the knobs build a decoder
    return cfg
