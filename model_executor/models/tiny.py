"""Small random checkpoints in each real format (LLaDA, Dream, SDAR, LLaDA2), for tests and benchmarks.

They are written exactly as the real ones are: ``config.json`` with the family's field names,
``model.safetensors`` under the family's tensor names, and a tokenizer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .configs import ArchSpec, DreamConfig, LLaDA2MoeConfig, LLaDAConfig, SDARConfig
from .reference import ReferenceDLLM
from .weights import save_checkpoint


def tiny_config(family: str, vocab_size: int, *, mask_token_id: int, eos_token_id: int, hidden: int = 128,
                layers: int = 2, heads: int = 2, kv_heads: int = 1, mlp: int = 256, block_size: int | None = None,
                max_positions: int = 512):
    if family == "llada":
        return LLaDAConfig(d_model=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=mlp,
                           vocab_size=vocab_size, embedding_size=vocab_size, rope_theta=10000.0,
                           max_sequence_length=max_positions, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
                           pad_token_id=eos_token_id, bos_token_id=1, architectures=["LLaDAModelLM"])
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=10000.0,
                  max_position_embeddings=max_positions, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
                  pad_token_id=eos_token_id, bos_token_id=1)
    if family == "dream":
        return DreamConfig(architectures=["DreamModel"], **common)
    if family == "sdar":
        return SDARConfig(architectures=["SDARForCausalLM"], block_size=block_size or 4, **common)
    if family == "llada2":
        # LLaDA2-mini's layout, shrunk: layer 0 dense, the others 8 experts in 4 groups (best 2 groups, top 2
        # experts) plus one shared expert; RoPE on half of each head; every field its published config sets.
        return LLaDA2MoeConfig(architectures=["LLaDA2MoeModelLM"], block_size=block_size or 8, head_dim=hidden // heads,
                               moe_intermediate_size=mlp // 4, num_experts=8, num_shared_experts=1,
                               num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               first_k_dense_replace=1, norm_topk_prob=True, score_function="sigmoid",
                               moe_router_enable_expert_bias=True, router_dtype="fp32", partial_rotary_factor=0.5,
                               rotary_dim=hidden // heads // 2, use_bias=False, use_qkv_bias=False, use_qk_norm=True,
                               rms_norm_eps=1e-6, tie_word_embeddings=False, **common)
    raise ValueError(f"family {family!r}; allowed: llada, dream, sdar, llada2")


def make_tiny_checkpoint(family: str, out: str | Path, tokenizer_dir: str | Path, seed: int = 0, **kw) -> Path:
    """Write a random ``family`` checkpoint with the tokenizer of ``tokenizer_dir``; returns ``out``."""
    from transformers import AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = tiny_config(family, len(tok), mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id, **kw)
    spec = ArchSpec.from_hf_config(cfg)
    torch.manual_seed(seed)
    model = ReferenceDLLM(spec)
    with torch.no_grad():
        for p in model.parameters():
            # random norms and biases too, so that a mix-up of any tensor shows in the logits
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 2 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
            if p.dim() == 2:
                p.mul_(1 / p.shape[1] ** 0.5)
    save_checkpoint(spec, model.canonical_state(), out)
    cfg.save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out
