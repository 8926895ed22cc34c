"""Which code of the project reads tensor data on the host: the calls that are GPU->CPU syncs on a device tensor.

    from sync_audit import SyncAudit, on_device

    with SyncAudit() as audit:
        builder.build(0, common_attn_metadata)
    audit.sites   # {"attention_backends/vllm_backend.py:build cpu", ...}: "path:function op"

A ``torch.overrides.TorchFunctionMode`` records every call of a host-reading op (:data:`OPS`: ``item``,
``tolist``, ``__bool__``, ``__int__``, ``__index__``, ``__float__``, ``nonzero``, one-argument ``torch.where``
(``nonzero``'s twin), ``cpu``, ``to`` with a device, ``copy_``, ``numpy``, and the data-dependent ``equal``,
``masked_select``, ``unique``, ``bincount`` (its output size is the data's maximum), boolean-mask indexing and
``repeat_interleave`` without ``output_size``) at the innermost stack frame inside the project's packages
(``psd_plugin/``, ``model_executor/``, ``attention_backends/``; ``packages=`` names others), as
``"path:function op"``; calls from elsewhere (vLLM, PyTorch) are not recorded. ``audit.report()`` lists them
with line numbers and counts.

On a CPU every tensor is a host tensor, so by default a ``.cpu()`` or a ``copy_`` of host tensors is recorded
too. ``SyncAudit(device_only=True)`` records only what would stall a device: ops on *stand-ins for device
tensors* (:func:`on_device` marks a CPU tensor as one; whatever is computed from it is one too, until an op
brings it to the host; a ``copy_`` from one into a host tensor is a read), and blocking copies to a non-CPU
device (``.to(device)`` or ``copy_`` into a device tensor without ``non_blocking=True``,
``torch.tensor(..., device=...)``).

Where the device *is* the host (vLLM's CPU runner, the reference engine on a CPU) the code under audit names the
CPU as its device and skips its uploads, so no blocking copy to a device can show. Inside a
:class:`device_proxy.DeviceProxy` it can: the proxy's tensors (``device_proxy.mark``) report ``cuda:0`` and are
stand-ins for this audit too, so an upload to their device is a copy to a non-CPU device. Enter the audit inside
the proxy (it must see each call before the proxy hands it on as plain tensors)::

    with DeviceProxy(), SyncAudit(device_only=True) as audit:
        step_predictions(mark(logits), ...)
"""

from __future__ import annotations

import collections
import re
import sys

import torch
from torch.overrides import TorchFunctionMode

from device_proxy import OnDevice

_T = torch.Tensor
# op name of each recorded function (Tensor methods and their torch.* twins)
OPS = {
    _T.item: "item", _T.tolist: "tolist", _T.__bool__: "__bool__", _T.__int__: "__int__",
    _T.__index__: "__index__", _T.__float__: "__float__", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
    _T.argwhere: "nonzero", torch.argwhere: "nonzero", _T.cpu: "cpu", _T.numpy: "numpy", torch.equal: "equal",
    _T.equal: "equal", torch.masked_select: "masked_select", _T.masked_select: "masked_select",
    torch.unique: "unique", _T.unique: "unique", torch.bincount: "bincount", _T.bincount: "bincount",
}
_TO_HOST = {"cpu", "numpy", "tolist", "item"}  # their result is on the host: no longer a device stand-in
PACKAGES = ("psd_plugin", "model_executor", "attention_backends")


_THIS = __file__.replace("\\", "/")


class DeviceStandIn(torch.Tensor):
    """A CPU tensor that stands in for a device tensor (:func:`on_device`); results computed from it are too."""


def on_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a stand-in for a device tensor: a ``SyncAudit(device_only=True)`` records what reads it."""
    return t.as_subclass(DeviceStandIn)


class SyncAudit(TorchFunctionMode):
    def __init__(self, device_only: bool = False, packages: tuple[str, ...] = PACKAGES):
        """``device_only``: record only what would stall a device (module docstring); ``packages``: the top-level
        directories whose frames name a site."""
        super().__init__()
        self.device_only = device_only
        self._where = re.compile(r"(?:^|/)((?:" + "|".join(map(re.escape, packages)) + r")/.*\.py)$")
        self.calls: collections.Counter = collections.Counter()  # (path, function, line, op) -> count

    @property
    def sites(self) -> set[str]:
        """``"path:function op"`` of every recorded call."""
        return {f"{path}:{fn} {op}" for path, fn, _, op in self.calls}

    def report(self) -> str:
        return "\n".join(f"{path}:{line} ({fn}) {op} x{n}" for (path, fn, line, op), n in sorted(self.calls.items()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = self._op(func, args, kwargs)
        if op is not None:
            self._record(op)
        out = func(*args, **kwargs)
        if op in _TO_HOST or (op == "to" and isinstance(out, DeviceStandIn) and out.device.type == "cpu"
                              and _moves_to_host(args, kwargs)):
            if isinstance(out, DeviceStandIn):
                out = out.as_subclass(torch.Tensor)
        return out

    def _op(self, func, args, kwargs) -> str | None:
        """The op ``func(*args, **kwargs)`` is when it reads data on the host (or copies to a device
        blockingly), else None."""
        this = args[0] if args and isinstance(args[0], torch.Tensor) else None
        name = OPS.get(func)
        if func is _T.__getitem__:
            index = args[1] if len(args) > 1 else None
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                name = "mask indexing"
                this = next(p for p in parts if isinstance(p, torch.Tensor) and p.dtype == torch.bool) \
                    if not self._device(this) else this
        elif func in (torch.repeat_interleave, _T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                name = "repeat_interleave"
                this = repeats
        elif func is torch.where and len(args) + len(kwargs) == 1:  # torch.where(cond): nonzero(as_tuple=True)
            name = "where"
            this = args[0] if args else kwargs.get("condition")
        elif func is _T.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if not self.device_only:
                return "copy_"
            if self._device(src) and not self._device(this):
                return "copy_"  # device -> host: the host waits for the data
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if self._device(this) and not self._device(src) and this.device.type != "cpu" and blocking:
                return "copy_(device) blocking"  # host -> a device that is not the host (under a DeviceProxy)
            return None
        elif func in (_T.to, _T.cuda):
            target = _target_device(args, kwargs) if func is _T.to else torch.device("cuda")
            if target is None:
                return None
            if self.device_only:
                if target.type == "cpu":
                    return "to(cpu)" if self._device(this) else None
                if self._device(this):  # already there: no host copy
                    return None
                return None if kwargs.get("non_blocking") else "to(device) blocking"
            return f"to({target.type})"
        elif func is torch.tensor:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type != "cpu":
                return "tensor(device=...)"
            return None
        if name is None:
            return None
        if self.device_only and not (self._device(this) or any(self._device(a) for a in args[1:2])):
            return None
        return name

    @staticmethod
    def _device(t) -> bool:
        return isinstance(t, (DeviceStandIn, OnDevice))

    def _record(self, op: str) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename.replace("\\", "/")
            m = None if path == _THIS else self._where.search(path)
            if m:
                self.calls[(m.group(1), frame.f_code.co_name, frame.f_lineno, op)] += 1
                return
            frame = frame.f_back


def _target_device(args, kwargs) -> torch.device | None:
    """The device a ``Tensor.to`` call names (None: a dtype-only conversion)."""
    dev = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, torch.Tensor):
            dev = a.device
    return None if dev is None else torch.device(dev)


def _moves_to_host(args, kwargs) -> bool:
    dev = _target_device(args, kwargs)
    return dev is not None and dev.type == "cpu"
