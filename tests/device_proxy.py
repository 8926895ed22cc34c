"""A stand-in accelerator for CPU tests: tensors marked :class:`OnDevice` behave as CUDA tensors do towards host
tensors, with their real values.

Inside :class:`DeviceProxy`, a marked tensor reports ``device`` ``cuda:0``; an op that mixes a marked tensor
with a host tensor of one or more dimensions raises :class:`DeviceMixing` (as PyTorch raises for a CUDA and a
CPU operand; host scalars are allowed, as PyTorch allows them); moving a host tensor ``.to`` the device, or
creating one there, marks it; ``.cpu()`` / ``.to("cpu")`` / a cross-device ``copy_`` unmarks it and is counted
in ``copies`` (a device-to-host copy: a sync); reading a marked tensor's values on the host (``item``,
``tolist``, ``bool`` ...) is counted in ``reads``. So a decoding path can be run on this CPU with its logits
"on the device" and its state on the host, and checked for the crashes and syncs a GPU run would have.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
PROJECT = ("model_executor/", "attention_backends/", "psd_plugin/")


class OnDevice(torch.Tensor):
    """A host tensor that stands for a tensor on the accelerator (module docstring)."""


class DeviceMixing(RuntimeError):
    pass


def mark(t: torch.Tensor) -> OnDevice:
    return t.as_subclass(OnDevice)


def _plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, OnDevice) else x


def _is_device(d) -> bool:
    if isinstance(d, str):
        try:
            d = torch.device(d)
        except RuntimeError:
            return False
    return isinstance(d, torch.device) and d.type == "cuda"


def _site() -> str:
    """The innermost project frame of the current call, "path:function"."""
    for f in reversed(traceback.extract_stack()[:-2]):
        p = f.filename.replace("\\", "/")
        if any(k in p for k in PROJECT) and "/tests/" not in p:
            return f"{p[p.index(next(k for k in PROJECT if k in p)):]}:{f.name}"
    return "?"


class DeviceProxy(TorchFunctionMode):
    """The mode that gives :class:`OnDevice` tensors their device semantics (module docstring)."""

    def __init__(self, device_generators: bool = False):
        """``device_generators``: every ``torch.Generator`` is taken for the device's (as vLLM's runner makes its
        requests' generators on its device, which is the host on this CPU); else a host generator drawing on
        the device raises :class:`DeviceMixing`, as CUDA refuses it."""
        super().__init__()
        self.device_generators = device_generators
        self.copies: list[str] = []  # device -> host copies, by call site
        self.reads: list[str] = []  # host reads of device values (item, tolist, bool ...)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        leaves = tree_flatten((args, kwargs))[0]
        dev = [t for t in leaves if isinstance(t, OnDevice)]
        if name == "__get__" and getattr(func, "__self__", None) is not None and \
                getattr(func.__self__, "__name__", "") == "device":
            return DEVICE if isinstance(args[0], OnDevice) else torch.device("cpu")
        target = kwargs.get("device")
        if name == "to":
            for a in list(args[1:]) + [kwargs.get("device")]:
                if isinstance(a, (torch.device, str)) and not isinstance(a, bool):
                    try:
                        target = torch.device(a)
                    except RuntimeError:
                        continue
                    break
        if isinstance(target, torch.device) and target.type == "cpu" and name in ("to",) and dev:
            self.copies.append(_site())
            kwargs = {k: v for k, v in kwargs.items()}
            return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
        if name == "cpu" and dev:
            self.copies.append(_site())
            return func(*tree_map(_plain, args), **kwargs)
        if name in HOST_READS and dev:
            self.reads.append(f"{_site()} {name}")
            return func(*tree_map(_plain, args), **kwargs)
        to_device = _is_device(target) or (name == "to" and any(_is_device(a) for a in args[1:]))
        if to_device:  # made on, or moved to, the device: computed here, marked
            args = tuple(torch.device("cpu") if _is_device(a) else a for a in args)
            kwargs = {k: (torch.device("cpu") if _is_device(v) else v) for k, v in kwargs.items()}
            if not self.device_generators and kwargs.get("generator") is not None and \
                    getattr(kwargs["generator"], "device", torch.device("cpu")).type != "cuda" and \
                    not getattr(kwargs["generator"], "_on_device", False):
                raise DeviceMixing(f"{name}: a host generator draws on the device ({_site()})")
            out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
            return tree_map(lambda t: mark(t) if type(t) is torch.Tensor else t, out)
        host = [t for t in leaves if type(t) is torch.Tensor and t.dim() > 0]
        if dev and host:
            if name == "copy_" and isinstance(args[0], torch.Tensor) and not isinstance(args[0], OnDevice):
                self.copies.append(_site())  # host <- device: a copy, allowed
                return func(*tree_map(_plain, args), **kwargs)
            if not (name == "copy_" and isinstance(args[0], OnDevice)):  # device <- host copies are fine
                raise DeviceMixing(f"{name} mixes device and host tensors ({_site()}): "
                                   f"{[tuple(t.shape) for t in dev]} on the device, "
                                   f"{[tuple(t.shape) for t in host]} on the host")
        out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
        if dev:
            out = tree_map(lambda t: mark(t) if type(t) is torch.Tensor else t, out)
        return out
