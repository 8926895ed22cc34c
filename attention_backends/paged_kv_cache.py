"""A paged KV cache for the reference engines: per layer ``[num_pages, page_size, num_kv_heads, head_dim]`` K and V.

The layout is FlashInfer's ``NHD`` paged layout, so the same cache feeds either attention backend. A batch
of requests is decoded together, so pages are handed out once per batch (``allocate``: each request gets
the pages its whole sequence needs) and the batch's cache is dropped when it finishes; there is no
eviction. Writes go to flat slots ``page * page_size + offset`` (vLLM's slot mapping).
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, seq_lens: list[int], page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        """Room for one sequence of each length in ``seq_lens``; ``block_table[i]`` lists sequence ``i``'s pages."""
        self.page_size = page_size
        n_pages = [(n + page_size - 1) // page_size for n in seq_lens]
        first = torch.tensor([0] + n_pages[:-1]).cumsum(0)
        width = max(n_pages, default=0)
        self.block_table = first[:, None] + torch.arange(width)  # [num_seqs, max_pages]; unused tail entries
        total = sum(n_pages)
        shape = (total, page_size, num_kv_heads, head_dim)
        # uninitialised: a page is only read where it was written (a large allocation is not resident until touched)
        self.layers = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                       for _ in range(num_layers)]

    def slots(self, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slots of ``positions`` of sequences ``seq`` (same shape)."""
        page = self.block_table[seq, positions // self.page_size]
        return page * self.page_size + positions % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [n, Hkv, D]`` at ``slots [n]`` of ``layer``."""
        kc, vc = self.layers[layer]
        slots = slots.to(kc.device)
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))
