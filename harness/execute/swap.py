"""Swapped values: copied to host memory as they are saved, and back for the backward pass.

NOTE [swapping]
A saved tensor whose storage belongs to a swapped node (``plan.swapped``) is copied to host memory when
it is first packed, once per storage however often it is saved; the token keeps the host copy and the
tensor's geometry, so the device storage dies at its last forward use. The copy back starts when the
backward of the node's ``prefetch`` trigger starts (a pre-hook on that node's ``grad_fn``; -1: when the
forward pass ends), and the device copy is dropped when its last token is unpacked. A token unpacked
before its copy back started fetches it then (a stall). On CUDA the copies run on two side streams into
one pinned host pool: the copy out waits for the compute stream and ``record_stream`` keeps the device
block from reuse until it is done; the copy back waits for the copy out, and the compute stream waits
for the copy back before the tensor is used. On ``meta`` and ``cpu`` the copies are made at once, in
``measure.on_host()``, so the tracker moves them out of the device's tally.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harness.measure import on_host
from harness.tracing.state import tensors_of
from strategies import Plan, members

if TYPE_CHECKING:
    from harness.execute.store import _Saved


@dataclass(eq=False)
class _HostCopy:
    """A swapped storage: its bytes in host memory, and on the device again once fetched."""

    host: torch.Tensor  # uint8, the whole storage
    device: torch.device
    tokens: int = 0  # saved tensors of this storage not yet unpacked
    fetched: torch.Tensor | None = None
    copied_out: object = None  # CUDA events
    copied_in: object = None


class _Swap:
    """The copies of swapped values to host memory and back (NOTE [swapping])."""

    def __init__(self, graph, plan: Plan):
        self.groups = set(members(plan.swapped))
        self.fetch_at: dict[int, list[int]] = {}  # trigger node (-1: end of forward) -> swapped groups
        for g, trigger in plan.prefetch:
            self.fetch_at.setdefault(trigger, []).append(g)
        self.streams = _SwapStreams(sum(graph.mem_bytes[g] + _ALIGN for g in self.groups))
        self.host_copies: dict[int, tuple[weakref.ref, _HostCopy]] = {}  # storage id -> copy
        self.swapped_groups: dict[int, list[_HostCopy]] = {}  # swapped group -> its copies
        self.fetch_triggers: dict[int, object] = {}  # prefetch trigger group -> its grad_fn

    def note_value(self, g: int, value) -> None:
        """A value the forward made: where it triggers a prefetch, the ``grad_fn`` that starts it. The
        backward of a value starts at its last writer's grad_fn, not at a view's: a view taken last (U-Net's
        crop) runs its backward as soon as its reader's has, long before the value's."""
        if g in self.fetch_at and (first := _first_tensor(value))._base is None:
            self.fetch_triggers[g] = first.grad_fn

    def start_backward(self) -> None:
        """At the forward's end: each trigger's pre-hook, and the copies back that start at once."""
        for g, grad_fn in self.fetch_triggers.items():
            if grad_fn is not None:  # else the tokens fetch when unpacked
                grad_fn.register_prehook(lambda grad_outputs, g=g: self.fetch(self.fetch_at[g]))
        self.fetch(self.fetch_at.get(-1, ()))

    def copy_out(self, g: int, storage: torch.UntypedStorage) -> _HostCopy:
        entry = self.host_copies.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return entry[1]
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        with on_host():
            host = self.streams.host_buffer(whole)
        copy = _HostCopy(host=host, device=storage.device)
        copy.copied_out = self.streams.copy(host, whole, outwards=True)
        self.host_copies[id(storage)] = (weakref.ref(storage), copy)
        self.swapped_groups.setdefault(g, []).append(copy)
        return copy

    def fetch(self, groups):
        for g in groups:
            for copy in self.swapped_groups.get(g, ()):
                if copy.fetched is None and copy.tokens:
                    copy.fetched = torch.empty_like(copy.host, device=copy.device)
                    copy.copied_in = self.streams.copy(copy.fetched, copy.host, outwards=False,
                                                       after=copy.copied_out)

    def swapped_in(self, saved: _Saved) -> torch.Tensor:
        copy = saved.swapped
        if copy.fetched is None:  # before its prefetch (or its trigger has no grad_fn): a stall
            self.fetch([saved.group])
        self.streams.wait(copy.copied_in)
        _, size, stride, offset, dtype = saved.geometry
        value = copy.fetched.view(dtype).as_strided(size, stride, offset)
        copy.tokens -= 1
        if copy.tokens == 0:
            copy.fetched = None
        return value


class _SwapStreams:
    """Where swap's copies run: on CUDA two side streams and one pinned pool; elsewhere at once."""

    def __init__(self, host_bytes: int):
        self.host_bytes = host_bytes
        self.cuda = False
        self.used = 0

    def host_buffer(self, whole: torch.Tensor) -> torch.Tensor:
        if whole.device.type != "cuda":
            return torch.empty(whole.numel(), dtype=torch.uint8, device=whole.device)
        if not self.cuda:
            self.cuda = True
            self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()
            self.pool = _pinned_pool(self.host_bytes)
        size = -(-whole.numel() // _ALIGN) * _ALIGN
        if self.used + size > self.pool.numel():  # more than the plan counted: a buffer of its own
            return torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True)
        self.used += size
        return self.pool[self.used - size:self.used - size + whole.numel()]

    def copy(self, destination: torch.Tensor, source: torch.Tensor, outwards: bool, after=None):
        """``destination.copy_(source)``; on CUDA on a side stream, returning its event."""
        if not self.cuda:
            destination.copy_(source)
            return None
        stream = self.out_stream if outwards else self.in_stream
        stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
        (source if outwards else destination).record_stream(stream)
        return stream.record_event()

    def wait(self, event):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


_ALIGN = 512  # pool slices start where the CUDA allocator would start blocks


_PINNED: dict[str, torch.Tensor] = {}  # the pool outlives a step: pinning host memory is slow and synchronizes


def _pinned_pool(size: int) -> torch.Tensor:
    """A pinned host buffer of at least ``size`` bytes, made once and grown when a plan needs more."""
    pool = _PINNED.get("pool")
    if pool is None or pool.numel() < size:
        _PINNED["pool"] = pool = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return pool


def _first_tensor(value) -> torch.Tensor:
    return tensors_of((value,))[0]
