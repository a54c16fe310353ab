"""Cost models: what recomputing a layer costs, by Kusumoto et al. 2019's weights, by FLOPs, by measured time, or
by a callable of the user's.

``cost_model`` names one of ``COST_MODELS``, or is a callable ``(layer, flops) -> float`` that weighs one fx
call: ``layer`` is what the call calls (the ``nn.Module`` of a module call, the function or method name of
any other) and ``flops`` what ``torch.utils.flop_counter`` counted for it; an IR node's cost is the sum over
its calls, as for the named models. ``trace(model, x, cost_model=lambda layer, flops: flops + 1e7)``, say,
charges every call a launch's worth of FLOPs besides its own.

NOTE [measured costs]
Kusumoto et al. 2019 weighs a convolution as 10 and any other layer as 1 (``cost_model=paper``); FLOPs weigh a
BatchNorm or a ReLU as nearly free, though on a GPU they take memory bandwidth and, eagerly, a launch each.
``cost_model=measured`` gives each IR node the time its members take to run, in milliseconds, on the
device the cell runs on: the traced program runs under ``torch.no_grad`` (as a recomputation does,
``harness/execute/``), each fx node timed alone (on CUDA between synchronisations, so its launches
count, as they do in an eager recomputation), the median of three runs after a warm-up. The timing runs
leave the model as they found it: every buffer written (running statistics) is put back, by tensor and
value, and so is every generator the program draws from. What the time-centric DPs then minimise, and
the row's ``predicted_overhead_cost``, is the forward time a plan recomputes, in milliseconds. Each cell
times its layers again, so two runs of a cell may choose different plans where two cost nearly the same. The
times are eager; a compiled step fuses what it recomputes with the backward (``harness/execute/compiled.py``),
where a BatchNorm's or a ReLU's recomputation is nearly free. Meta holds no values to time: refused there.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Union

import torch
import torch.fx as fx

from harness.tracing.state import generators_of, state_kept
from harness.tracing.traced import Traced, target_of


COST_MODELS = ("paper", "flops", "measured")
CostModel = Union[str, Callable[[object, int], float]]  # a name of COST_MODELS, or a user's (layer, flops) -> cost
_CONV_TYPES = (torch.nn.modules.conv._ConvNd,)
_CONV_FUNCTIONS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d}


def check_cost_model(cost_model: CostModel, device: str) -> None:
    if callable(cost_model):
        return
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model {cost_model!r}; valid: {', '.join(COST_MODELS)}")
    if cost_model == "measured" and device == "meta":
        raise ValueError("cost_model=measured times every layer on the device, and meta holds no values to time: "
                         "use device=cpu or device=cuda, or cost_model=paper or flops on meta")


def measured_costs(traced: Traced, example_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each IR node's forward time in milliseconds on the example's device (NOTE [measured costs])."""
    module, device = traced.module, example_input.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {}

    class Timed(fx.Interpreter):
        def run_node(self, node):
            if node.op in ("placeholder", "get_attr", "output"):
                return super().run_node(node)
            sync()
            start = time.perf_counter()
            result = super().run_node(node)
            sync()
            times.setdefault(node.name, []).append(time.perf_counter() - start)
            return result

    with state_kept(module, ({device}, generators_of(module))), torch.no_grad():
        for _ in range(1 + repeats):  # the first warms up (allocator, cuDNN's choice of algorithm)
            Timed(module).run(example_input.clone())
    # The median of the timed runs (the warm-up's time is left out), summed over an IR node's members.
    return [sum(1e3 * statistics.median(times[name][1:]) for name in names if name in times)
            for names in traced.members]


def layer_cost(node: fx.Node, module: torch.nn.Module, cost_model: CostModel, flop_count: int | None) -> float:
    """What one fx call weighs under ``cost_model`` (``measured`` takes Kusumoto et al.'s weights here, which the
    trace then replaces with the times measured on the device)."""
    target = target_of(node, module)
    if callable(cost_model):
        cost = float(cost_model(target, flop_count))
        if not cost >= 0:  # NaN too
            raise ValueError(f"the cost model gave {cost} for {node.name}; a cost is a number of at least 0")
        return cost
    if cost_model == "flops":
        return float(flop_count)
    # Kusumoto et al. 2019: 10 for a convolution, 1 for anything else (its Chainer class name starts with "Conv").
    is_conv = isinstance(target, _CONV_TYPES) and not isinstance(target, torch.nn.modules.conv._ConvTransposeNd)
    return 10.0 if is_conv or target in _CONV_FUNCTIONS else 1.0
