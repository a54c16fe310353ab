"""Measure one training step's memory (and time, where there is a clock worth reading).

NOTE [measurement protocol]
- One tracker on every device: a ``TorchDispatchMode`` that sees every tensor an op returns, counts the
  bytes of each storage from its creation until it is freed, and keeps the peak. Parameters, buffers and
  the inputs are counted from the start; a storage becomes a parameter gradient when it lands in
  ``.grad``. The parts at the peak are parameters (with buffers), gradients and activations (everything
  else: inputs, activations, their gradients, temporaries). Storages made inside ``on_host()`` (swap's
  copies in host memory) are counted apart, as ``host``, and never in the device's peak.
- ``meta``: the real program on meta tensors, nothing allocated; the tracker's peak is the measurement.
  No time is measured (there is nothing to time). The tracker counts the same step's FLOPs too, by the
  rules ``FlopCounterMode`` counts with (``torch.utils.flop_counter``'s registry, ``op_flops``): that mode's
  module hooks hold tensors the tracker would count, so it needed a step of its own.
- ``cpu``: the tracker's peak, and the wall time of a step, median and IQR of ``timed_steps`` steps after
  ``warmup_steps`` (the tracker is off while timing).
- ``cuda``: ``gc``, ``empty_cache`` and ``reset_peak_memory_stats``, one step, then
  ``max_memory_allocated`` and ``max_memory_reserved`` and NVML's used memory of the device (pynvml);
  warm-up steps, then CUDA-event timing of each step from an idle GPU to its end, median and IQR, with
  Python's cycle collector run between the timed steps and never inside one (``_timed``), and the GPU's
  kernel time of one more step, profiled (``gpu_kernel_ms``). The tracker's peak is taken on a
  separate step so that its hooks do not slow the timed ones, and the row carries it beside the
  allocator's figures so that their agreement shows. Only ``torch.cuda.OutOfMemoryError`` is caught
  (the caller turns it into an ``oom`` row). Run one measurement per process, one at a time per GPU.
Every step starts with the parameters' gradients set to None, so a step never sees the last one's.

NOTE [the tracker and gradient accumulation]
A value read by several layers gets its gradient summed by the autograd engine. Without a Python dispatch
mode the engine sums in place into a contribution it holds the last reference to (``InputBuffer``'s
``accumulate``: ``old.add_(new)``), so the sum costs nothing; with any mode active, the tracker's
included, every tensor counts as subclass-like and the engine sums out of place (``old + new``), one
gradient more at that moment than the device will ever hold (on PSPNet, whose encoder output feeds
five branches, +20% on a swap plan). The tracker puts the device's behaviour back: an ``add`` in the
backward pass (a current autograd node, grad mode off) whose result is the size of an operand is counted
only at the next op, and by then, if the engine held the operand's last reference, that operand has
been freed, as the in-place sum would have reused it. A sum whose operands both live on is counted as
an allocation, as on the device. The executor's recomputation also runs in the backward pass with grad
mode off, and its additions (a residual ``x + attn(x)``) are the program's, not the engine's: inside
``recomputing()`` every op's result counts at once (taken for sums, a LoRA layer's ``base(x) + x @ a @ b``
was measured one value low, its operands freed before its result counted).

NOTE [meta kernels remembered]
On meta an op's outputs are a function of its arguments' layouts alone: there are no values. Many of
PyTorch's meta kernels are Python decompositions, and some are slow: ``native_batch_norm`` and its backward
run about 7,800 Python calls each (4.4 ms a call), over 70% of the tracker's time in a PSPNet step, and a
trace runs the step twice more. So on meta the tracker runs each op once per layout of its arguments, keeps
its outputs' layouts (size, stride, offset, dtype, storage size), and later calls get new outputs of those
layouts, made by ``empty_strided``. Only ops that cannot change their inputs are kept: no view, no in-place
or ``out=`` op (an alias in the schema's returns, or a mutable schema), and an op that moved an input's
version counter, handed back an input's storage, made outputs that share a storage or made one off meta, is
run every time. Arguments the key cannot hold (a generator, a symbolic size, a tensor subclass) run the op
too, and so does every op while another dispatch mode is outside the tracker, which would not see a
remembered call. The storages are new either way, so the tracker counts them as it counts any op's. The
trace's probe remembers the same way (``harness.tracing.tracer.Draws``, which counts the FLOPs as the tracker does,
``op_flops``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import platform
import statistics
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils._pytree import tree_leaves

from strategies import cycle_collector_off

DEVICES = ("meta", "cpu", "cuda")
DEVICE_PARTS = ("params", "grads", "activations")
_placement = threading.local()


@contextlib.contextmanager
def on_host():
    """Storages created inside live in host memory (swap's copies): the tracker counts them apart."""
    _placement.host = getattr(_placement, "host", 0) + 1
    try:
        yield
    finally:
        _placement.host -= 1


@contextlib.contextmanager
def recomputing():
    """Ops run inside are the program's (the executor's recomputation), never the autograd engine's
    gradient sums (NOTE [the tracker and gradient accumulation])."""
    _placement.recomputing = getattr(_placement, "recomputing", 0) + 1
    try:
        yield
    finally:
        _placement.recomputing -= 1


@dataclass(frozen=True, slots=True)
class Measurement:
    device: str
    method: str
    peak_bytes: int | None  # the device's own figure where it has one (cuda: max allocated), else the tracker's
    tracker_peak_bytes: int | None  # None: compiled code, which the tracker cannot see (off meta)
    params_bytes: int | None  # parts at the tracker's peak
    grads_bytes: int | None
    activations_bytes: int | None
    host_peak_bytes: int = 0  # swap's copies in host memory, at their peak
    reserved_bytes: int | None = None
    nvml_used_bytes: int | None = None
    step_time_ms: float | None = None
    step_time_iqr_ms: float | None = None
    device_name: str = ""
    step_flops: int | None = None  # meta: the FLOPs of the ops the step ran (recomputations included)
    gpu_kernel_ms: float | None = None  # cuda: the GPU's kernel time in one profiled step after the timed ones


class MemoryTracker(TorchDispatchMode):
    """Counts the live bytes of every storage that ops create (see NOTE [measurement protocol])."""

    def __init__(self, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, part)
        self.current = {"params": 0, "grads": 0, "activations": 0, "host": 0}
        self.peak_bytes = 0
        self.peak_parts = dict(self.current)
        self.host_peak_bytes = 0
        self.flops = 0  # of the ops seen, by torch.utils.flop_counter's rules
        self._hooks = []
        self._sum: tuple | None = None  # (storage ref, part) of a gradient sum not yet counted
        for t in list(model.parameters()) + list(model.buffers()):
            self._add(t.untyped_storage(), "params")
        for t in inputs:
            self._add(t.untyped_storage(), "activations")
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.mark_grad))

    def _add(self, storage: torch.UntypedStorage, part: str):
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = (size, part)
        self.current[part] += size
        weakref.finalize(storage, self._free, key)
        self.host_peak_bytes = max(self.host_peak_bytes, self.current["host"])
        total = sum(self.current[p] for p in DEVICE_PARTS)
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_parts = dict(self.current)

    def _free(self, key: int):
        size, part = self.live.pop(key)
        self.current[part] -= size

    def _count_sum(self):
        """Count the gradient sum put off by NOTE [the tracker and gradient accumulation]."""
        if self._sum is not None:
            ref, part = self._sum
            self._sum = None
            if ref() is not None:
                self._add(ref(), part)

    def mark_grad(self, param: torch.Tensor):
        """Count ``param.grad`` as a gradient (a hook calls it; so does code that sets ``.grad`` itself)."""
        self._count_sum()
        storage = param.grad.untyped_storage()
        entry = self.live.get(id(storage))
        if entry is None:
            self._add(storage, "grads")
        elif entry[1] != "grads":
            self.current[entry[1]] -= entry[0]
            self.current["grads"] += entry[0]
            self.live[id(storage)] = (entry[0], "grads")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count_sum()
        kwargs = kwargs or {}
        out = meta_call(func, args, kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        part = "host" if getattr(_placement, "host", 0) else "activations"
        if func is torch.ops.aten.add.Tensor and _is_gradient_sum(out, args):
            self._sum = (weakref.ref(out.untyped_storage()), part)
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), part)
        return out

    def __exit__(self, *exc):
        self._count_sum()
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)


_META_OUTPUTS: dict = {}  # (op, default dtype, arguments' layouts) -> outputs' layouts, or None: run it
_META_KEPT_AT_MOST = 200_000  # keys, across every net a process traces and measures
_REMEMBERABLE: dict = {}  # op -> whether its schema rules out returning an alias and writing an input


def op_flops(func, args, kwargs, out) -> int:
    """The FLOPs of one op as it reaches a dispatch mode, by ``torch.utils.flop_counter``'s registry (an op with
    no rule there counts none). The trace's prediction and the tracker's measurement both count by it.
    ``FlopCounterMode`` also runs the Python decomposition of an op it has no rule for and counts the parts; on
    the zoo that is BatchNorm's, whose parts have no rule either (a test holds the two counts equal)."""
    count = flop_registry.get(func._overloadpacket)
    return 0 if count is None else count(*args, **kwargs, out_val=out)


def meta_call(func, args, kwargs):
    """``func(*args, **kwargs)``, or on meta, outputs of the layouts it made before (NOTE [meta kernels
    remembered])."""
    if torch._C._len_torch_dispatch_stack():  # a mode outside this one would not see a remembered call
        return func(*args, **kwargs)
    rememberable = _REMEMBERABLE.get(func)
    if rememberable is None:
        schema = func._schema
        rememberable = _REMEMBERABLE[func] = not schema.is_mutable and not any(r.alias_info for r in schema.returns)
    key = _meta_key(func, args, kwargs) if rememberable else None
    if key is None:
        return func(*args, **kwargs)
    layouts = _META_OUTPUTS.get(key, _UNSEEN)
    if layouts is None:
        return func(*args, **kwargs)
    if layouts is not _UNSEEN:
        outputs = tuple(None if layout is None else _remade(layout) for layout in layouts[1])
        return outputs if layouts[0] else outputs[0]
    inputs = [a for a in tree_leaves((args, kwargs)) if type(a) in _PLAIN]
    versions = [t._version for t in inputs]
    out = func(*args, **kwargs)
    if len(_META_OUTPUTS) >= _META_KEPT_AT_MOST:
        _META_OUTPUTS.clear()
    _META_OUTPUTS[key] = _layouts(out, inputs, versions)
    return out


_UNSEEN = object()
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass may compute what its layout does not say
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(func, args, kwargs) -> tuple | None:
    """What a meta kernel's outputs depend on: the op, the default dtype, and every argument, a tensor by its
    layout on meta; None where an argument is anything else."""
    key = [func, torch.get_default_dtype()]
    for a in (*args, *kwargs.items()) if kwargs else args:
        part = _meta_part(a)
        if part is None and a is not None:
            return None
        key.append(part)
    return tuple(key)


def _meta_part(a):
    if type(a) in _PLAIN:
        return (a.shape, a.stride(), a.storage_offset(), a.dtype) if a.device.type == "meta" else None
    if isinstance(a, _SCALARS):
        return (type(a), a)  # 1, 1.0 and True are equal keys, and make different dtypes
    if isinstance(a, (tuple, list)):
        parts = tuple(_meta_part(b) for b in a)
        return None if any(p is None and b is not None for p, b in zip(parts, a)) else (type(a), parts)
    return None


def _layouts(out, inputs: list[torch.Tensor], versions: list[int]) -> tuple | None:
    """(whether ``out`` is a tuple, each output's layout); None where the op must run every time."""
    outputs = out if isinstance(out, tuple) else (out,)
    tensors = [o for o in outputs if o is not None]
    if any(type(o) is not torch.Tensor or o.device.type != "meta" for o in tensors):
        return None
    if any(t._version != v for t, v in zip(inputs, versions)):
        return None
    storages = {o.untyped_storage()._cdata for o in tensors}
    if len(storages) < len(tensors) or not storages.isdisjoint(t.untyped_storage()._cdata for t in inputs):
        return None
    layouts = tuple(None if o is None else (o.shape, o.stride(), o.storage_offset(), o.dtype,
                                            o.untyped_storage().nbytes()) for o in outputs)
    if any(layout is not None and _remade(layout) is None for layout in layouts):
        return None
    return isinstance(out, tuple), layouts


def _remade(layout) -> torch.Tensor | None:
    """A new meta tensor of ``layout``; None where ``empty_strided`` cannot make its storage's size or offset."""
    size, stride, offset, dtype, nbytes = layout
    t = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return t if offset == 0 and t.untyped_storage().nbytes() == nbytes else None


def _is_gradient_sum(out, args) -> bool:
    """An ``add`` the autograd engine may run in place on the device (NOTE [the tracker and gradient
    accumulation])."""
    if torch.is_grad_enabled() or torch._C._current_autograd_node() is None or getattr(_placement, "recomputing", 0):
        return False
    size = out.untyped_storage().nbytes()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().nbytes() == size for a in args[:2])


def measure(step: Callable[[], object], model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], device: str,
            warmup_steps: int = 2, timed_steps: int = 5, compiled: bool = False) -> Measurement:
    """Measure ``step`` (one training step of ``model`` on ``inputs``) on ``device``. A ``compiled`` step
    off meta runs compiled code, which no dispatch mode sees: the cuda allocator measures its memory, and on
    cpu nothing does (NOTE [measuring torch.compile] in ``harness/execute/compiled.py``)."""
    check_device(device)
    if compiled and device != "meta":
        return _measure_compiled(step, model, device, warmup_steps, timed_steps)
    if device == "meta":
        # A tensor the program makes without naming a device is made on meta too, as in the trace.
        with torch.device("meta"):
            tracked = _tracked_step(step, model, inputs)
        return Measurement(device="meta", method="meta-tracker", peak_bytes=tracked.peak_bytes,
                           tracker_peak_bytes=tracked.peak_bytes, device_name="meta", **_parts(tracked),
                           step_flops=tracked.flops)
    tracked = _tracked_step(step, model, inputs)
    if device == "cpu":
        times = _timed(step, model, warmup_steps, timed_steps, _wall_ms)
        return Measurement(device="cpu", method="cpu-tracker+wall-clock", peak_bytes=tracked.peak_bytes,
                           tracker_peak_bytes=tracked.peak_bytes, device_name=_cpu_name(), **_parts(tracked),
                           **_median_iqr(times))
    return _measure_cuda(step, model, tracked, warmup_steps, timed_steps)


def _tracked_step(step, model, inputs) -> MemoryTracker:
    clear_grads(model)
    with MemoryTracker(model, inputs) as tracker:
        step()
    clear_grads(model)
    return tracker


def _parts(tracker: MemoryTracker) -> dict:
    return dict(params_bytes=tracker.peak_parts["params"], grads_bytes=tracker.peak_parts["grads"],
                activations_bytes=tracker.peak_parts["activations"], host_peak_bytes=tracker.host_peak_bytes)


def clear_grads(model):
    for p in model.parameters():
        p.grad = None


def _timed(step, model, warmup_steps, timed_steps, clock) -> list[float]:
    """The times of ``timed_steps`` steps after ``warmup_steps`` (``harness.results.TIMING_PROTOCOL``): the cycle
    collector runs between the timed steps, never inside one, where a full collection of a large program's
    objects would add milliseconds to whichever step it fell in."""
    for _ in range(warmup_steps):
        clear_grads(model)
        step()
    times = []
    for _ in range(timed_steps):
        clear_grads(model)
        with collected_then_held_off():
            times.append(clock(step))
    clear_grads(model)
    return times


@contextlib.contextmanager
def collected_then_held_off():
    """Python's cycle collector run now and held off until the block ends: a timed block is timed without a
    collection falling in it (``harness.results.TIMING_PROTOCOL``)."""
    gc.collect()
    with cycle_collector_off():
        yield


def _wall_ms(step) -> float:
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def _cuda_ms(step) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _median_iqr(times: list[float]) -> dict:
    if len(times) < 2:
        return dict(step_time_ms=times[0] if times else None, step_time_iqr_ms=0.0 if times else None)
    q1, _, q3 = statistics.quantiles(times, n=4)
    return dict(step_time_ms=statistics.median(times), step_time_iqr_ms=q3 - q1)


def _measure_cuda(step, model, tracked, warmup_steps, timed_steps) -> Measurement:
    clear_grads(model)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    nvml_used = _nvml_used_bytes()
    times = _timed(step, model, warmup_steps, timed_steps, _cuda_ms)
    kernel_ms = _gpu_kernel_ms(step, model) if timed_steps else None
    parts = _parts(tracked) if tracked is not None else dict(params_bytes=None, grads_bytes=None,
                                                             activations_bytes=None)
    return Measurement(device="cuda", method="cuda-allocator+nvml+cuda-events", peak_bytes=allocated,
                       tracker_peak_bytes=tracked and tracked.peak_bytes, reserved_bytes=reserved,
                       nvml_used_bytes=nvml_used, device_name=torch.cuda.get_device_name(), **parts,
                       gpu_kernel_ms=kernel_ms, **_median_iqr(times))


def _gpu_kernel_ms(step, model) -> float:
    """The time the GPU spends running kernels in one step, profiled after the timed ones (the profiler's
    host cost stays out of the timed steps). Beside the step's wall time it tells the host's share: a
    step whose wall time is well above its kernel time kept the GPU waiting on the host."""
    clear_grads(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiled:
        step()
        torch.cuda.synchronize()
    clear_grads(model)
    return sum(e.self_device_time_total for e in profiled.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def _measure_compiled(step, model, device, warmup_steps, timed_steps) -> Measurement:
    unseen = dict(tracker_peak_bytes=None, params_bytes=None, grads_bytes=None, activations_bytes=None)
    if device == "cpu":
        times = _timed(step, model, warmup_steps, max(timed_steps, 1), _wall_ms)
        return Measurement(device="cpu", method="cpu-wall-clock only (compiled: nothing measures its memory)",
                           peak_bytes=None, device_name=_cpu_name(), **unseen, **_median_iqr(times))
    measured = _measure_cuda(step, model, None, warmup_steps, timed_steps)  # no tracker: its fields stay empty
    return dataclasses.replace(measured, method="cuda-allocator+nvml+cuda-events (compiled)")


def _nvml_used_bytes() -> int:
    return nvml_memory(torch.cuda.current_device()).used


def nvml_memory(cuda_index: int = 0):
    """NVML's memory figures (``total``, ``free``, ``used``) of the CUDA device ``cuda_index``, without a CUDA
    context: CUDA numbers the devices CUDA_VISIBLE_DEVICES lists (indices or UUIDs), NVML all of them."""
    import pynvml

    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    device = visible[cuda_index] if visible else str(cuda_index)
    pynvml.nvmlInit()
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(device) if device.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(device)))
        return pynvml.nvmlDeviceGetMemoryInfo(handle)
    finally:
        pynvml.nvmlShutdown()


def _cpu_name() -> str:

    return platform.processor() or platform.machine()


def check_device(device: str) -> None:
    """Raise a clear error for a device this machine cannot run; never fall back silently."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid devices: {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for but torch sees no CUDA GPU here; use device=meta "
                           "(the default: counts bytes without allocating) or device=cpu")
