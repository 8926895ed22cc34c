"""Host-to-device uploads that do not make the host wait: a host tensor is copied into a pinned buffer of its
owner's (one per key, reused every step, grown when needed) and sent from there with ``non_blocking``. From
pageable memory a copy to a CUDA device is staged by the driver, which may wait for the stream's earlier work
(the forward) before the host goes on; from pinned memory the host queues the copy and goes on, launching the
kernels that read it behind the device's work.

Reuse is safe where the owner reads something of the device back before it uploads under the same key again
(a step's predictions or decisions): that read waits for the stream, the upload before it included. Each
engine owns one :class:`Staging` (the vLLM runner, :mod:`psd_plugin.vllm.runner`; the reference engine), used
for its own uploads and, through :func:`~model_executor.dllm_request.decode_step`, by the decoders that decide
on the device (:meth:`~model_executor.decoding.base.DeviceRowPredictions.upload`).
"""

from __future__ import annotations

import torch


class Staging:
    """Pinned host buffers by key (module docstring)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def upload(self, key: str, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` on ``device`` without the host waiting; ``host`` itself where the device is the host. Without
        a CUDA runtime (a stand-in device in the tests) a plain non-blocking copy."""
        if device.type == "cpu":
            return host
        if not torch.cuda.is_available():
            return host.to(device, non_blocking=True)
        k = (key, host.dtype)
        buf = self._buffers.get(k)
        if buf is None or buf.numel() < host.numel():
            buf = self._buffers[k] = torch.empty(max(host.numel(), 1 << 12), dtype=host.dtype, pin_memory=True)
        staged = buf[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(device, non_blocking=True)
