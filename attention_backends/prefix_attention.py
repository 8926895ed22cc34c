"""Attention of new tokens over a paged prefix plus themselves: the one interface both backends implement.

Draft verification (LoPA branches, FreeDave / Spiffy / PSD draft canvases, PRESTO token trees) forwards
many new tokens per request that all share the request's cached prefix but must not all see each other.
An :class:`AttentionPlan` describes one batch of that work, once per forward (it is reused by every
layer, like FlashInfer's ``plan``/``run`` split):

- request ``r`` owns query rows ``qo_indptr[r]:qo_indptr[r + 1]`` and a cached prefix of
  ``prefix_lens[r]`` tokens on the pages ``block_table[r]`` of a paged KV cache laid out
  ``[num_pages, page_size, num_kv_heads, head_dim]`` (FlashInfer's ``NHD``); every new row sees the
  whole prefix, and, when the plan has one, the request's cached *suffix*: the positions
  ``[suffix_starts[r], suffix_starts[r] + suffix_lens[r])`` of the same pages (DualCache's kept K/V of the
  masks after a block);
- the rows of a request are cut into *segments* (``seg_indptr``; default: one segment per request). A row
  sees only the rows of its own segment, under the mask ``kind``:

  - ``bidirectional``: all of them (a draft canvas: each canvas of a request is one segment);
  - ``causal``: those at or before it (row order);
  - ``block_causal``: those whose attention block ``positions // block_size`` is not later (SDAR);
  - ``custom``: an arbitrary boolean ``[n_s, n_s]`` matrix per segment (``custom_masks``): a DAG of
    drafts or a token tree (each token sees its ancestors).

A backend object is long-lived (it owns workspaces); per forward it is ``plan``-ned with the batch and the
head geometry, then ``run`` once per layer with that layer's new ``q, k, v`` and paged cache. Backends:
:class:`attention_backends.torch_backend.TorchPrefixAttention` (runs anywhere; what CI tests) and
:class:`attention_backends.flashinfer_backend.FlashInferPrefixAttention` (CUDA, fp16/bf16). Both compute
the prefix once per request (or per segment, where that pads less on CPU) however many canvases it has:
FlashInfer as a paged prefix part and a ragged new-token part merged by log-sum-exp, the PyTorch backend as
one masked attention per batch entry over its ``[prefix | new rows]`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

MaskKind = Literal["bidirectional", "causal", "block_causal", "custom"]
MASK_KINDS = ("bidirectional", "causal", "block_causal", "custom")
BACKENDS = ("auto", "torch", "flashinfer")


@dataclass
class AttentionPlan:
    """One batch of prefix + new-token attention (module docstring). Every tensor is a host (CPU) tensor: a plan
    is made on the host, and a backend copies what its device needs once per forward."""

    qo_indptr: torch.Tensor  # [R + 1]
    prefix_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, max_pages]
    page_size: int
    kind: MaskKind = "bidirectional"
    seg_indptr: torch.Tensor | None = None  # [S + 1]; None: one segment per request
    positions: torch.Tensor | None = None  # [T]; needed by block_causal
    block_size: int = 0  # block_causal's attention block
    custom_masks: list[torch.Tensor] | None = None  # kind "custom": one bool [n_s, n_s] per segment
    # [R] first position and length of each request's cached suffix (None: no request has one); the caller
    # keeps it clear of the prefix and of the positions of the request's new rows (checked: the prefix only)
    suffix_starts: torch.Tensor | None = None
    suffix_lens: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in MASK_KINDS:
            raise ValueError(f"mask kind {self.kind!r}; allowed: {', '.join(MASK_KINDS)}")
        for name in ("qo_indptr", "prefix_lens", "block_table", "seg_indptr", "positions", "suffix_starts",
                     "suffix_lens"):
            _on_host(name, getattr(self, name))
        # the checks on numpy views of the host tensors: a few microseconds where a dozen small torch ops take
        # tens, once per forward
        qo_t = self.qo_indptr = self.qo_indptr.long()
        self.prefix_lens = self.prefix_lens.long()
        qo, prefix = qo_t.numpy(), self.prefix_lens.numpy()
        R = qo.size - 1
        if R < 0 or int(qo[0]) != 0 or (qo[1:] < qo[:-1]).any():
            raise ValueError("qo_indptr must start at 0 and not decrease")
        if prefix.shape != (R,):
            raise ValueError(f"prefix_lens must have one entry per request ({R}), got {tuple(prefix.shape)}")
        if (prefix < 0).any():
            raise ValueError("prefix_lens must be >= 0")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0 (got {self.page_size})")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != R:
            raise ValueError(f"block_table must be [num_requests={R}, max_pages], got {tuple(self.block_table.shape)}")
        if (self.suffix_starts is None) != (self.suffix_lens is None):
            raise ValueError("suffix_starts and suffix_lens go together")
        end = prefix
        if self.suffix_lens is not None:
            self.suffix_starts, self.suffix_lens = self.suffix_starts.long(), self.suffix_lens.long()
            starts, lens = self.suffix_starts.numpy(), self.suffix_lens.numpy()
            if lens.shape != (R,) or starts.shape != (R,):
                raise ValueError(f"suffix_starts and suffix_lens must have one entry per request ({R})")
            if (lens < 0).any() or ((lens > 0) & (starts < prefix)).any():
                raise ValueError("a suffix must have length >= 0 and start at or after its request's prefix end")
            end = np.maximum(prefix, np.where(lens > 0, starts + lens, 0))
        need = int(((end + self.page_size - 1) // self.page_size).max()) if R else 0
        if need > self.block_table.shape[1]:
            raise ValueError(f"block_table has {self.block_table.shape[1]} pages per request; the cached keys "
                             f"need {need}")
        seg_t = qo_t if self.seg_indptr is None else self.seg_indptr.long()
        seg = seg_t.numpy()
        if int(seg[0]) != 0 or int(seg[-1]) != int(qo[-1]) or (seg[1:] < seg[:-1]).any():
            raise ValueError("seg_indptr must run from 0 to the number of new tokens without decreasing")
        at = np.minimum(np.searchsorted(seg, qo), seg.size - 1)  # seg is sorted: a membership test in O(R log S)
        if not (seg[at] == qo).all():
            raise ValueError("a segment must not span two requests (every qo_indptr entry must be in seg_indptr)")
        self.seg_indptr = seg_t
        T = int(qo[-1])
        if self.kind == "block_causal":
            if self.positions is None or self.positions.shape != (T,) or self.block_size <= 0:
                raise ValueError(f"block_causal needs positions [{T}] and block_size > 0")
        if self.kind == "custom":
            lens = np.diff(seg).tolist()
            if self.custom_masks is None or len(self.custom_masks) != len(lens):
                raise ValueError(f"custom needs one mask per segment ({len(lens)})")
            for s, (m, n) in enumerate(zip(self.custom_masks, lens)):
                if m.shape != (n, n) or m.dtype != torch.bool:
                    raise ValueError(f"custom mask of segment {s} must be bool [{n}, {n}], got {m.dtype} {tuple(m.shape)}")
                _on_host(f"custom mask of segment {s}", m)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def seg_lens(self) -> torch.Tensor:
        return self.seg_indptr[1:] - self.seg_indptr[:-1]

    def segment_blocks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The segments' masks, grouped by segment length: per distinct length ``n``, the segments of that length
        ``[k]`` and their masks ``[k, n, n]`` (row ``i`` sees row ``j``) under the mask kind."""
        n = self.seg_lens
        out = []
        for length in torch.unique(n).tolist():
            segs = (n == length).nonzero().flatten()
            k, a = segs.numel(), torch.arange(length)
            if self.kind == "bidirectional":
                vis = torch.ones(k, length, length, dtype=torch.bool)
            elif self.kind == "causal":
                vis = torch.ones(length, length, dtype=torch.bool).tril().expand(k, length, length)
            elif self.kind == "block_causal":
                blk = (self.positions.long() // self.block_size)[self.seg_indptr[segs][:, None] + a]  # [k, n]
                vis = blk[:, None, :] <= blk[:, :, None]
            else:
                vis = torch.stack([self.custom_masks[i] for i in segs.tolist()]) if k \
                    else torch.zeros(0, length, length, dtype=torch.bool)
            out.append((segs, vis))
        return out

    def segment_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every ordered pair of rows of one segment, segment by segment and row-major within it: plan rows
        ``i [N]`` and ``j [N]`` and whether row ``i`` sees row ``j`` under the mask kind (``N = sum n_s ** 2``;
        FlashInfer's flattened per-segment mask order)."""
        N, at = self._flat_layout()
        i, j = torch.empty(N, dtype=torch.long), torch.empty(N, dtype=torch.long)
        vis = torch.empty(N, dtype=torch.bool)
        for segs, m in self.segment_blocks():
            length = m.shape[-1]
            idx = (at[segs][:, None] + torch.arange(length * length)).flatten()
            rows = self.seg_indptr[segs][:, None] + torch.arange(length)  # [k, n]
            i[idx] = rows[:, :, None].expand(-1, length, length).flatten()
            j[idx] = rows[:, None, :].expand(-1, length, length).flatten()
            vis[idx] = m.flatten()
        return i, j, vis

    def _flat_layout(self) -> tuple[int, torch.Tensor]:
        """``N = sum n_s ** 2`` and where each segment's flattened mask starts."""
        sq = self.seg_lens ** 2
        return int(sq.sum()), torch.cumsum(sq, 0) - sq

    def segment_mask(self, s: int) -> torch.Tensor | None:
        """Visibility ``[n_s, n_s]`` among segment ``s``'s rows (None: all visible)."""
        a, b = int(self.seg_indptr[s]), int(self.seg_indptr[s + 1])
        if self.kind == "bidirectional":
            return None
        if self.kind == "causal":
            return torch.ones(b - a, b - a, dtype=torch.bool).tril()
        if self.kind == "block_causal":
            blk = self.positions[a:b] // self.block_size
            return blk[None, :] <= blk[:, None]
        return self.custom_masks[s]

    def packed_segment_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment's mask packed as FlashInfer's ``segment_packbits(..., bitorder="little")`` packs it
        (:func:`pack_mask`): ``(packed uint8 [bytes], byte indptr int64 [S + 1])``, host tensors."""
        N, at = self._flat_layout()
        bits = torch.empty(N, dtype=torch.bool)
        for segs, m in self.segment_blocks():
            length = m.shape[-1]
            bits[(at[segs][:, None] + torch.arange(length * length)).flatten()] = m.flatten()
        return _pack_bits(bits, self.seg_lens ** 2)

    @property
    def cached_lens(self) -> torch.Tensor:
        """``[R]`` cached keys each request's rows see: its prefix plus its suffix."""
        return self.prefix_lens if self.suffix_lens is None else self.prefix_lens + self.suffix_lens

    def cached_positions(self) -> torch.Tensor:
        """``[R, max_cached]`` positions of each request's cached keys (prefix, then suffix), 0 past their end."""
        return torch.from_numpy(self._cached_positions())

    def cached_slots(self) -> torch.Tensor:
        """``[R, max_cached]`` flat cache slots (``page * page_size + offset``) of each request's cached keys
        (prefix, then suffix), 0 past their end."""
        return torch.from_numpy(self.cached_slots_array())

    def cached_slots_array(self) -> np.ndarray:
        """:meth:`cached_slots` as an int64 numpy array (what a plan built in numpy reads)."""
        C = self.cached_lens.numpy()
        pos = self._cached_positions(C)
        ps = self.page_size
        slots = self.block_table.numpy()[np.arange(C.size)[:, None], pos // ps].astype(np.int64) * ps + pos % ps
        return np.where(np.arange(pos.shape[1]) < C[:, None], slots, 0)

    def _cached_positions(self, C: np.ndarray | None = None) -> np.ndarray:
        C = self.cached_lens.numpy() if C is None else C
        i = np.arange(int(C.max()) if C.size else 0)
        pos = i[None, :]
        if self.suffix_lens is not None:
            prefix = self.prefix_lens.numpy()[:, None]
            pos = np.where(i < prefix, i, self.suffix_starts.numpy()[:, None] + i - prefix)
        return np.where(i < C[:, None], pos, 0)


class PrefixAttention(Protocol):
    """What a backend provides (see the module docstring)."""

    name: str

    def plan(self, plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             scale: float | None = None, device: torch.device | str | None = None,
             cached: torch.Tensor | None = None) -> None:
        """``cached``: ``[T]`` flat cache slots where the caller writes each new row's K/V before ``run`` (-1:
        not written); a backend may read those rows' keys from the cache."""

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor: ...


def run_in_order(attn: PrefixAttention, order: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """``attn.run`` over rows in the model's order: ``order`` (the model row of each plan row) gathers them into
    the plan's order and scatters the output back; None: the rows already are in plan order (or the backend was
    planned with the row map and reads them in place)."""
    if order is None:
        return attn.run(q, k, v, k_cache, v_cache)
    out = torch.empty_like(q)
    out[order] = attn.run(q[order], k[order], v[order], k_cache, v_cache).to(out.dtype)
    return out


def check_run_inputs(T: int, geom: tuple[int, int, int], q, k, v, k_cache, v_cache) -> None:
    """Raise a clear error unless ``q [T, H, D]``, ``k, v [T, Hkv, D]`` and caches ``[pages, page, Hkv, D]``
    match what a backend was planned for (``geom = (H, Hkv, D)``)."""
    H, Hkv, D = geom
    if q.shape != (T, H, D) or k.shape != (T, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"planned for q [{T}, {H}, {D}] and k, v [{T}, {Hkv}, {D}]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (Hkv, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be [pages, page_size, {Hkv}, {D}]; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


# Head sizes FlashInfer's FA2 prefill kernels are built for (on the H100, head size 16 stopped in its kernel
# dispatch: "Invalid configuration"); 64 and 128 are the ones the GPU tests ran.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def make_backend(name: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 head_dim: int | None = None) -> PrefixAttention:
    """The backend for ``name``: ``flashinfer`` (CUDA, fp16/bf16, head sizes :data:`FLASHINFER_HEAD_DIMS`,
    ``pip install 'psd-plugin[gpu]'``), ``torch`` (anywhere, any dtype and head size), or ``auto`` (FlashInfer
    where it applies, else torch). ``head_dim``: the model's head size, where the caller knows it."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}; allowed: {', '.join(BACKENDS)}")
    device = torch.device(device)
    fits = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    head_fits = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    if name == "flashinfer" or (name == "auto" and fits and head_fits and flashinfer_available()):
        if not fits:
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device and float16/bfloat16 "
                             f"(got {device}, {dtype}); allowed here: torch")
        if not head_fits:
            raise ValueError(f"attention backend 'flashinfer': head size {head_dim} is not one of its kernels' "
                             f"({', '.join(map(str, FLASHINFER_HEAD_DIMS))}); allowed here: torch")
        if not flashinfer_available():
            raise ValueError("attention backend 'flashinfer': flashinfer is not installed "
                             "(pip install 'psd-plugin[gpu]'); allowed here: torch")
        from .flashinfer_backend import FlashInferPrefixAttention

        return FlashInferPrefixAttention(device)
    from .torch_backend import TorchPrefixAttention

    return TorchPrefixAttention()


def pack_mask(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-segment boolean masks as FlashInfer's ``segment_packbits(..., bitorder="little")`` does:
    row-major bits, little-endian within a byte, each segment starting on a byte. Returns ``(packed uint8,
    byte indptr)``."""
    if not masks:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.long)
    return _pack_bits(torch.cat([m.reshape(-1).cpu() for m in masks]),
                      torch.tensor([m.numel() for m in masks], dtype=torch.long))


def _pack_bits(bits: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bits [sum counts]`` (bool, segment after segment) packed little-endian, each segment from a new byte."""
    nbytes = (counts + 7) // 8
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(nbytes, 0)])
    N = bits.numel()
    seg = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=N)
    local = torch.arange(N) - (torch.cumsum(counts, 0) - counts)[seg]
    packed = torch.zeros(int(indptr[-1]), dtype=torch.int32).index_add_(
        0, indptr[:-1][seg] + local // 8, bits.to(torch.int32) << (local % 8).to(torch.int32))
    return packed.to(torch.uint8), indptr


def unpack_mask(packed: torch.Tensor, indptr: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """Segment ``s``'s ``[n, n]`` boolean mask from :func:`pack_mask`'s output."""
    b = packed[int(indptr[s]): int(indptr[s + 1])]
    bits = (b[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[: n * n].view(n, n).bool()


def _on_host(name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: a plan is built on the host from host tensors (reading a device "
                         "tensor here would stall the device every forward)")


def to_device(tensors: dict[str, torch.Tensor | None], device: torch.device | str) -> dict[str, torch.Tensor | None]:
    """Host tensors on ``device`` in one transfer: on the CPU the tensors themselves (no copy); elsewhere packed
    into one buffer (pinned on CUDA), copied with one ``non_blocking`` copy, and viewed back per tensor."""
    device = torch.device(device)
    if device.type == "cpu":
        return dict(tensors)
    parts, offset, layout = [], 0, {}
    for name, t in tensors.items():
        if t is None:
            continue
        t = t.contiguous()
        n = t.numel() * t.element_size()
        layout[name] = (offset, t.dtype, t.shape)
        parts.append((offset, t))
        offset += (n + 15) // 16 * 16  # every view starts aligned for its dtype
    buf = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for o, t in parts:
        buf[o: o + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))
    dev = buf.to(device, non_blocking=True)
    out = {name: None for name in tensors}
    for name, (o, dtype, shape) in layout.items():
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out[name] = dev[o: o + n].view(dtype).view(shape)
    return out
