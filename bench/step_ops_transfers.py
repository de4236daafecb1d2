"""Copies between host and device in a CPU stand-in run, where both are the CPU (:mod:`bench.step_ops_count`).

On the CPU ``Tensor.to(device)`` is a no-op, not an op, so a dispatch mode never sees the copies a GPU run makes.
While :class:`Transfers` is installed, the calls that move tensors are wrapped and judged by the tensors' host
tags (:class:`bench.step_ops_count.OpCounter` follows which tensors a GPU run keeps on the host):

* ``Tensor.to(x)`` / ``Tensor.cpu()``: the target is the host when ``x`` is a host tensor, the ``.device`` of one
  (``Tensor.device`` of a host tensor returns a device object remembered as the host's), or the string ``"cpu"``;
  any other device is the training device. Host → device: a copy, a synchronization unless ``non_blocking`` (a
  pageable copy torch makes blocking); device → host: a synchronization, the result a host tensor.
* ``torch.tensor(data, device=d)`` with ``d`` the training device: a host-to-device copy (blocking).

Only in the loop phase: inside the model every tensor is a device tensor.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Transfers"]


class Transfers:
    """The wrappers of ``Tensor.to``, ``Tensor.cpu``, ``Tensor.device`` and ``torch.tensor`` for one counter."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self._saved: list[tuple[Any, str, Any]] = []
        self._host_devices: dict[int, Any] = {}  # id → the device object (kept alive, so the id stays its own)

    def install(self) -> None:
        import torch

        device_attr = torch._C.TensorBase.device  # the getset descriptor of every tensor's ``.device``
        self._patch(torch.Tensor, "to", self._wrap_to(torch.Tensor.to))
        self._patch(torch.Tensor, "cpu", self._wrap_cpu(torch.Tensor.cpu))
        self._patch(torch.Tensor, "device", property(self._wrap_device(device_attr.__get__)))
        self._patch(torch, "tensor", self._wrap_tensor(torch.tensor))

    def remove(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()
        self._host_devices.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    # -------------------------------------------------------------------------------------------- judging
    def _in_loop(self) -> bool:
        return self.counter.phase() == "loop"

    def _is_host_target(self, target: Any) -> bool | None:
        """True: the host; False: the training device; None: not a place (a dtype, a flag)."""
        import torch

        if isinstance(target, torch.Tensor):
            return self.counter.is_host(target)
        if isinstance(target, torch.device):
            return id(target) in self._host_devices
        if isinstance(target, str):
            return target.split(":")[0] == "cpu"
        return None

    def _copied(self, source: Any, out: Any, to_host: bool, blocking: bool, what: str) -> None:
        c = self.counter
        if to_host:
            c.mark_host(out)
        else:
            for t in (source, out):  # on a GPU the result is a device tensor (the CPU may return ``source`` itself)
                c.unmark_host(t)
        if c.counting:
            c.add_op("loop", "sync" if blocking or to_host else "kernel", what, sys._getframe(2))

    # -------------------------------------------------------------------------------------------- wrappers
    def _wrap_to(self, original: Any) -> Any:
        def to(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(tensor, *args, **kwargs)
            if not self._in_loop():
                return out
            places = [p for p in (self._is_host_target(a) for a in (*args, kwargs.get("device"),
                                                                        kwargs.get("other"))) if p is not None]
            if not places:
                return out
            to_host, from_host = places[0], self.counter.is_host(tensor)
            if to_host != from_host:
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args))
                self._copied(tensor, out, to_host, blocking, "copy D2H (Tensor.to)" if to_host else
                             "copy H2D (Tensor.to)")
            return out

        return to

    def _wrap_cpu(self, original: Any) -> Any:
        def cpu(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(tensor, *args, **kwargs)
            if self._in_loop() and not self.counter.is_host(tensor):
                self._copied(tensor, out, True, True, "copy D2H (Tensor.cpu)")
            return out

        return cpu

    def _wrap_device(self, get: Any) -> Any:
        def device(tensor: Any) -> Any:
            value = get(tensor)
            if self.counter.is_host(tensor):
                self._host_devices[id(value)] = value
            return value

        return device

    def _wrap_tensor(self, original: Any) -> Any:
        def tensor(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            place = self._is_host_target(kwargs.get("device"))
            if place is False and self._in_loop():
                self._copied(out, out, False, True, "copy H2D (torch.tensor)")
            return out

        return tensor
