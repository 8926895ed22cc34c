"""Plain-PyTorch reference model for LLaDA, Dream, SDAR and LLaDA2, and Llama as PRESTO's AR target (no vLLM
imports).

One transformer covers the formats; :class:`~model_executor.models.configs.ArchSpec` switches q/k/v bias
(Dream), per-head q/k RMSNorm (SDAR, LLaDA2), a fused q/k/v projection and partial RoPE (LLaDA2), experts in
place of the MLP (LLaDA2, :class:`MoE`) and the attention pattern. It is the oracle the vLLM
model classes are tested against, the model the training script optimises, and the engine's model on
machines without vLLM (GPU boxes).

Numerics follow the original code: RMSNorm in float32 then times the weight, NeoX-style RoPE (rotate
half) with angles computed in float32 and the rotation in float32 for LLaDA (``rope_full_precision``) but in
the activation dtype for Dream, SDAR and Llama (their code casts cos/sin first), SwiGLU MLP
``down(silu(gate(h)) * up(h))``.

``forward`` returns the raw per-position outputs. For Dream those are *shifted*: the prediction for
position ``i`` is the output at ``i - 1``; :meth:`ReferenceDLLM.token_logits` applies that shift for a
full sequence, and the decoding engine does it for windows (see ``model_executor.engine``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attention_backends.prefix_attention import AttentionPlan, PrefixAttention, run_in_order

from attention_backends.paged_kv_cache import PagedKVCache
from .configs import ArchSpec, CONFIG_CLASSES, MoESpec
from .weights import load_checkpoint

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/bf16/fp16 inputs, float64 for float64 (the exactness path)."""
    return torch.promote_types(dtype, torch.float32)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for NeoX-style rotary embedding, in float32 (float64 if asked)."""
    cd = _compute_dtype(dtype)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=cd) / head_dim))
    ang = positions.to(cd)[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, L, H, D]; cos/sin: [B, L, R] with R <= D: the first R dims of each head rotate (rotate-half within
    them), the rest pass through (LLaDA2's partial RoPE)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).to(x.dtype)


def attention_mask(spec: ArchSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Boolean mask [B, 1, Lq, Lk] (True = attend) for the family's attention pattern (None: attend everywhere).

    ``q_pos``/``k_pos`` are absolute positions [B, L]. Bidirectional models see every key; SDAR and LLaDA2 see keys in
    its own or an earlier block; causal models see keys at or before the query position.
    """
    if spec.attention == "bidirectional":
        return None
    if spec.attention == "block_causal":
        bs = spec.attention_block
        return ((k_pos[:, None, :] // bs) <= (q_pos[:, :, None] // bs))[:, None]
    return (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]


class SwiGLU(nn.Module):
    """``down(silu(gate(h)) * up(h))``: the MLP, each expert and the shared experts."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate = nn.Linear(hidden, width, bias=False)
        self.up = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Router(nn.Module):
    """LLaDA2's router: ``weight [experts, hidden]`` and the expert ``bias`` that only steers selection."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts))


def route(moe: MoESpec, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[T, top_k]`` and their weights (float32) for router ``logits [T, experts]`` (float32), as
    :class:`~model_executor.models.configs.MoESpec` describes: sigmoid scores, bias for selection only, the best
    ``topk_group`` groups by the sum of their two best biased scores, then the best ``top_k`` experts in them;
    weights are the unbiased scores renormalised, times ``scale``."""
    T = logits.shape[0]
    scores = logits.sigmoid()
    biased = scores + bias.to(scores.dtype)
    grouped = biased.view(T, moe.n_group, -1)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(moe.topk_group, dim=-1).indices, True)
    masked = biased.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(T, -1), float("-inf"))
    experts = masked.topk(moe.top_k, dim=-1).indices
    w = scores.gather(1, experts)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if moe.top_k > 1 else w
    return experts, w * moe.scale


class Layer(nn.Module):
    def __init__(self, spec: ArchSpec, index: int = 0):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.attn_norm = RMSNorm(h, spec.rms_norm_eps)
        q, kv = spec.num_heads * d, spec.num_kv_heads * d
        if spec.fused_qkv:
            self.qkv = nn.Linear(h, q + 2 * kv, bias=spec.qkv_bias)
        else:
            self.q = nn.Linear(h, q, bias=spec.qkv_bias)
            self.k = nn.Linear(h, kv, bias=spec.qkv_bias)
            self.v = nn.Linear(h, kv, bias=spec.qkv_bias)
        self.o = nn.Linear(q, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.mlp_norm = RMSNorm(h, spec.rms_norm_eps)
        self.moe = spec.moe is not None and spec.moe.is_moe_layer(index)
        if self.moe:  # canonical names layers.i.router, layers.i.experts.e.gate, layers.i.shared.up ...
            moe = spec.moe
            self.router = Router(h, moe.num_experts)
            self.experts = nn.ModuleList(SwiGLU(h, moe.intermediate_size) for _ in range(moe.num_experts))
            if moe.num_shared:
                self.shared = SwiGLU(h, moe.intermediate_size * moe.num_shared)
        else:
            self.gate = nn.Linear(h, spec.intermediate_size, bias=False)
            self.up = nn.Linear(h, spec.intermediate_size, bias=False)
            self.down = nn.Linear(spec.intermediate_size, h, bias=False)

    def _qkv(self, x, cos, sin):
        """q [B, L, H, D] and k, v [B, L, Hkv, D] of ``x [B, L, hidden]``, q/k-normed (SDAR, LLaDA2) and rotated."""
        s = self.spec
        B, L, _ = x.shape
        h = self.attn_norm(x)
        if s.fused_qkv:
            q, k, v = self.qkv(h).split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                                         s.num_kv_heads * s.head_dim], dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.reshape(B, L, s.num_heads, s.head_dim)
        k = k.reshape(B, L, s.num_kv_heads, s.head_dim)
        v = v.reshape(B, L, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _rest(self, x, a):
        """Output projection of the attention ``a [..., H * D]``, residual, and the MLP (or expert) block."""
        x = x + self.o(a)
        h = self.mlp_norm(x)
        if self.moe:
            return x + self._experts(h)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def _experts(self, h: torch.Tensor) -> torch.Tensor:
        """LLaDA2's expert block: routed experts, weighted and summed in float32 as its code does, plus the
        shared experts."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        cd = _compute_dtype(x.dtype)
        experts, w = route(self.spec.moe, F.linear(x.to(cd), self.router.weight.to(cd)), self.router.bias)
        out = torch.zeros(x.shape, dtype=cd, device=x.device)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]).to(cd) * w[rows, slot, None].to(cd))
        out = out.to(x.dtype)
        if self.spec.moe.num_shared:
            out = out + self.shared(x)
        return out.reshape(shape)

    def forward(self, x, cos, sin, mask):
        """Whole sequences ``x [B, L, hidden]`` under a ``[B, 1, L, L]`` mask (training, the oracle)."""
        B, L, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cos, sin))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        return self._rest(x, a.transpose(1, 2).reshape(B, L, -1))

    def forward_paged(self, i: int, x, cos, sin, attn, cache, write, order=None):
        """New tokens ``x [T, hidden]`` over the paged cache through the planned ``attn`` backend; stores the
        K/V of rows ``write[1]`` at cache slots ``write[0]`` (before attending: they never overlap a prefix).
        ``order``: the row of ``x`` of each plan row, when they differ (:func:`run_in_order`)."""
        q, k, v = (t[0] for t in self._qkv(x[None], cos[None], sin[None]))
        if write is not None:
            cache.write(i, write[0], k[write[1]], v[write[1]])
        kc, vc = cache.layers[i]
        return self._rest(x, run_in_order(attn, order, q, k, v, kc, vc).flatten(1))


class ReferenceDLLM(nn.Module):
    """LLaDA / Dream / SDAR / LLaDA2 transformer in plain PyTorch, parameters under canonical names."""

    def __init__(self, spec: ArchSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Layer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "ReferenceDLLM":
        cfg = read_config(path, allow_ar=True)
        spec = ArchSpec.from_ar_config(cfg) if cfg.get("model_type") == "llama" else ArchSpec.from_hf_config(cfg)
        model = cls(spec)
        model.load_canonical(load_checkpoint(spec, path))
        return model.to(device=device, dtype=dtype).eval()

    def load_canonical(self, tensors: dict[str, torch.Tensor]) -> None:
        sd = {(k if k.endswith(".bias") else k + ".weight"): v for k, v in tensors.items()}
        self.load_state_dict(sd, strict=True)

    def canonical_state(self) -> dict[str, torch.Tensor]:
        return {k.removesuffix(".weight"): v for k, v in self.state_dict().items()}

    # ---------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None | str = "auto") -> torch.Tensor:
        """Raw outputs [B, L, V] of whole sequences ``input_ids`` [B, L] (training, tests, the oracle).

        ``positions`` defaults to ``arange(L)``; ``mask="auto"`` builds the family's pattern
        (:func:`attention_mask`), an explicit boolean ``[B, 1, L, L]`` mask (or None = attend everywhere)
        is used as given. Decoding with a KV cache goes through :meth:`forward_paged`.
        """
        B, L = input_ids.shape
        if positions is None:
            positions = torch.arange(L, device=input_ids.device).expand(B, L)
        if isinstance(mask, str):
            mask = attention_mask(self.spec, positions, positions)
        x = self.embed(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self._head(x)

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                      cache: PagedKVCache, attn: PrefixAttention, write: tuple[torch.Tensor, torch.Tensor] | None = None,
                      logits_rows: torch.Tensor | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
        """Raw outputs of the new tokens ``input_ids [T]`` at ``positions [T]``, laid out and masked by ``plan``
        (shared paged prefixes, draft segments; :mod:`attention_backends.prefix_attention`), only at
        ``logits_rows`` when given. ``write = (slots, rows)`` stores those rows' K/V in ``cache``. ``order``: the
        input row of each plan row, when the inputs are not in plan order
        (:class:`~attention_backends.step_batch.StepBatch`'s model order)."""
        from attention_backends.torch_backend import TorchPrefixAttention

        s = self.spec
        x = self.embed(input_ids)
        kw = {}
        if write is not None:  # rows whose K/V is in the cache when the layers attend
            kw["cached"] = torch.full((input_ids.numel(),), -1, dtype=torch.long)
            kw["cached"][write[1].cpu()] = write[0].long().cpu()
        if order is not None and isinstance(attn, TorchPrefixAttention):  # it reads the rows in place
            kw["rows"], order = order, None
        attn.plan(plan, s.num_heads, s.num_kv_heads, s.head_dim, x.dtype, device=x.device, **kw)
        order = None if order is None else order.to(x.device)
        return self.forward_planned(input_ids, positions, cache, attn, write, logits_rows, order, x)

    def forward_planned(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                        attn: PrefixAttention, write: tuple[torch.Tensor, torch.Tensor] | None = None,
                        logits_rows: torch.Tensor | None = None, order: torch.Tensor | None = None,
                        x: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward_paged` after ``attn`` was planned: device work only (no host reads, no allocation the
        inputs' shapes do not fix), so with ``input_ids``, ``positions``, ``write``, ``logits_rows`` and
        ``order`` in persistent device buffers it can be captured in a CUDA graph and replayed after the next
        step's plan (``benchmarks/cuda_graph_step.py``)."""
        x = self.embed(input_ids) if x is None else x
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(i, x, cos, sin, attn, cache, write, order)
        return self._head(x if logits_rows is None else x[logits_rows])

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions``: angles in float32 (float64 on the exactness path), then in the activation
        dtype unless the family rotates in full precision (:attr:`ArchSpec.rope_in_float32`), as the authors'
        code does (Dream/SDAR/Llama cast cos/sin to the activations' dtype before rotating; LLaDA does not)."""
        cos, sin = rope_cos_sin(positions, self.spec.rotary_dim or self.spec.head_dim, self.spec.rope_theta, dtype)
        if not self.spec.rope_in_float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return F.linear(x, self.embed.weight if self.spec.tie_embeddings else self.lm_head.weight)

    def token_logits(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        """Logits aligned with the tokens (row i predicts token i), Dream's shift applied."""
        out = self.forward(input_ids, **kw)
        if self.spec.shift_logits:
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out


def read_config(path: str | os.PathLike, allow_ar: bool = False) -> dict:
    """Read ``config.json`` of a checkpoint directory, with a clear error if it is missing or corrupt
    (``allow_ar``: a Llama-format AR model is accepted too, as PRESTO's target)."""
    f = Path(path) / "config.json"
    if not f.exists():
        raise FileNotFoundError(f"{path}: no config.json (is this a model directory?)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    cfg["_name_or_path"] = str(path)  # as transformers' configs carry it (SDAR's mask token lookup); a stale
    # one saved in config.json (a training run's path) would point elsewhere, as AutoConfig also overrides it
    if cfg.get("model_type") not in CONFIG_CLASSES and not (allow_ar and cfg.get("model_type") == "llama"):
        ArchSpec.from_hf_config(cfg)  # raises the unknown-model_type error
    return cfg
