"""A CPU stand-in for the parts of flashinfer-python 0.7.0.post1 the FlashInfer backend calls, written from its
source (``flashinfer/prefill.py``, ``cascade.py``, ``data/include/flashinfer/page.cuh``, ``attention/variants.cuh``)
so that the backend's planning (host indptrs, page indices, last-page lengths, the packed mask and its byte
offsets, the row maps) runs against the oracle without CUDA. It keeps the behaviours the backend depends on:

- ``plan`` takes host or device indptrs and reads host copies (``qo_indptr.to("cpu")``); the tests check the
  backend hands it host tensors (:attr:`PLANNED` records the devices);
- the ragged wrapper's ``packed_custom_mask`` route derives ``mask_indptr`` in bits (``_compute_mask_indptr``)
  while the kernel adds it to a byte pointer (``variants.cuh``), and an unmasked ``plan`` leaves the previous
  ``_custom_mask_buf`` in place (its run then applies it);
- the paged kernel reads each cache tensor through its page, token and head strides with the head dimension
  contiguous, and the equal-stride FA2 primary needs K and V to have the same strides (``batch_prefill_paged.cuh``);
- log-sum-exps are base 2 and ``merge_state`` merges them as such;
- CUDA-graph mode (``use_cuda_graph=True`` with index buffers given at construction): ``plan`` checks the fixed
  batch size and copies into those buffers (the page indices and the packed mask into their leading part), and
  ``run`` reads the buffers, as the kernels a captured graph replays do.

Not a kernel: float32 loops over batch entries.
"""

from __future__ import annotations

import math

import torch

PLANNED: list[dict] = []  # per plan call: (device type, dtype) of every tensor argument


def _record(kind: str, **tensors) -> None:
    PLANNED.append({"wrapper": kind, **{k: (t.device.type, t.dtype) for k, t in tensors.items()
                                        if isinstance(t, torch.Tensor)}})


def _attend(q, k, v, mask, scale):
    """q [n, H, D], k, v [m, Hkv, D], mask [n, m] bool -> out [n, H, D], lse [n, H] (base 2)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), kk) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, n]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", p, vv), (lse * math.log2(math.e)).T.contiguous()


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", **_):
        assert kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
        self.device, self._backend = float_workspace_buffer.device, backend
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert torch.is_tensor(qo_indptr_buf) and torch.is_tensor(kv_indptr_buf)
            assert len(kv_indptr_buf) == len(qo_indptr_buf)
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr_buf, kv_indptr_buf
        self._custom_mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, sm_scale=None, q_data_type="float16",
             kv_data_type=None, non_blocking=True, **_):
        _record("ragged", qo_indptr=qo_indptr, kv_indptr=kv_indptr, packed_custom_mask=packed_custom_mask)
        if custom_mask is not None or packed_custom_mask is not None:  # prefill.py: _compute_mask_indptr (bits)
            mask_indptr = torch.zeros_like(qo_indptr)
            mask_indptr[1:] = torch.cumsum((qo_indptr[1:] - qo_indptr[:-1]) * (kv_indptr[1:] - kv_indptr[:-1]), 0)
        assert custom_mask is None, "the backend packs its masks on the host"
        if self._use_cuda_graph:
            if len(qo_indptr) - 1 != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
            if packed_custom_mask is not None:
                assert torch.is_tensor(self._custom_mask_buf) and torch.is_tensor(self._mask_indptr_buf)
                self._custom_mask_buf[: len(packed_custom_mask)].copy_(packed_custom_mask)
                self._mask_indptr_buf.copy_(mask_indptr)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr.to(self.device), kv_indptr.to(self.device)
            if packed_custom_mask is not None:  # no else: an unmasked plan keeps the previous mask (0.7.0.post1)
                self._custom_mask_buf = packed_custom_mask.to(self.device)
                self._mask_indptr_buf = mask_indptr.to(self.device)
        self._causal = causal
        self._scale = head_dim_qk ** -0.5 if sm_scale is None else sm_scale

    def run(self, q, k, v, return_lse=False, **_):
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        qo, kv = self._qo_indptr_buf.long(), self._kv_indptr_buf.long()  # what the kernel reads
        for b in range(qo.numel() - 1):
            a0, a1, c0, c1 = int(qo[b]), int(qo[b + 1]), int(kv[b]), int(kv[b + 1])
            n, m = a1 - a0, c1 - c0
            if n == 0:
                continue
            mask = torch.ones(n, m, dtype=torch.bool)
            if self._custom_mask_buf is not None:  # variants.cuh: a byte pointer plus mask_indptr[b]
                base = int(self._mask_indptr_buf[b])
                off = torch.arange(n)[:, None] * m + torch.arange(m)
                mask = ((self._custom_mask_buf.long()[base + off // 8] >> (off % 8)) & 1).bool()
            if self._causal:
                mask &= torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
            out[a0:a1], lse[a0:a1] = _attend(q[a0:a1], k[c0:c1], v[c0:c1], mask, self._scale)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 backend="auto", **_):
        assert kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
        self.device, self._backend = float_workspace_buffer.device, backend
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert all(torch.is_tensor(t) for t in (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                                                    paged_kv_last_page_len_buf))
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr_buf, paged_kv_indptr_buf
        self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = paged_kv_indices_buf, paged_kv_last_page_len_buf

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             sm_scale=None, q_data_type="float16", kv_data_type=None, non_blocking=True, seq_lens=None, **_):
        _record("paged", qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr, paged_kv_indices=paged_kv_indices,
                paged_kv_last_page_len=paged_kv_last_page_len, seq_lens=seq_lens)
        assert custom_mask is None and packed_custom_mask is None and not causal
        ind, last = paged_kv_indptr.to("cpu").long(), paged_kv_last_page_len.to("cpu").long()
        lens = (ind[1:] - ind[:-1] - 1).clamp(min=0) * page_size + last  # page.py: get_seq_lens
        if seq_lens is not None:
            assert torch.equal(seq_lens.to("cpu").long(), lens), "seq_lens disagree with the pages"
        if self._use_cuda_graph:
            if len(qo_indptr) - 1 != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed during the lifecycle of the wrapper")
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            self._qo_indptr_buf.copy_(qo_indptr)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices)
        else:
            self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr.to(self.device), paged_kv_indptr.to(self.device)
            self._paged_kv_indices_buf = paged_kv_indices.to(self.device)
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device)
        self._page = page_size
        self._scale = head_dim_qk ** -0.5 if sm_scale is None else sm_scale

    def run(self, q, paged_kv_cache, return_lse=False, **_):
        kc, vc = paged_kv_cache
        assert kc.dim() == 4 and kc.shape[1] == self._page, "NHD pages [pages, page_size, Hkv, D]"
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1, "the head dimension must be contiguous"
        assert kc.stride() == vc.stride(), "the FA2 primary needs K and V with equal strides"
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full(q.shape[:2], float("-inf"))
        qo, ind = self._qo_indptr_buf.long(), self._paged_kv_indptr_buf.long()  # what the kernel reads
        last, all_pages = self._paged_kv_last_page_len_buf.long(), self._paged_kv_indices_buf.long()
        for b in range(qo.numel() - 1):
            a0, a1 = int(qo[b]), int(qo[b + 1])
            pages = all_pages[int(ind[b]): int(ind[b + 1])]
            m = max(int(ind[b + 1] - ind[b]) - 1, 0) * self._page + int(last[b])
            slot = torch.arange(m)
            # page.cuh: page * stride_page + entry * stride_n + head * stride_h + feature
            k = kc[pages[slot // self._page], slot % self._page]
            v = vc[pages[slot // self._page], slot % self._page]
            out[a0:a1], lse[a0:a1] = _attend(q[a0:a1], k, v, torch.ones(a1 - a0, m, dtype=torch.bool), self._scale)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


def merge_state(v_a, s_a, v_b, s_b):
    """cascade.py: merge two partial attentions by their base-2 log-sum-exps."""
    assert v_a.is_contiguous() and v_b.is_contiguous() and s_a.is_contiguous() and s_b.is_contiguous()
    s = torch.logaddexp2(s_a.float(), s_b.float())
    w_a, w_b = torch.exp2(s_a.float() - s)[..., None], torch.exp2(s_b.float() - s)[..., None]
    return (v_a.float() * w_a + v_b.float() * w_b).to(v_a.dtype), s
