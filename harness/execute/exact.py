"""Exactness against plain PyTorch: one step under a plan beside ``loss_fn(model(x)).backward()`` from the
same state and the same seed. The tests, the coverage benchmark and anyone bringing a model use it.

``compare(model, example_input, loss_fn, run_plan)`` returns a ``Difference``: the loss's difference
relative to plain PyTorch's loss, the worst gradient difference relative to that gradient's scale (``max|g - g_ref| /
max|g_ref|`` per parameter, worst over parameters; a gradient present on one side only counts as inf),
and the buffers that differ (BatchNorm statistics must be updated exactly once). The model is left as it
was; plain PyTorch's step runs on a deep copy, which takes the tensors autograd made that a module keeps
as attributes detached (``non_leaf_attributes``: the pre-hook ``spectral_norm``'s weight after a step,
which ``copy.deepcopy`` refuses). A gradient that is zero in exact arithmetic (a BatchNorm bias feeding
another normalisation) is float32 rounding, ~1e-9, that a stage order reshuffles: scales are floored at
``SCALE_FLOOR`` of the model's largest gradient, so such noise does not read as a wrong gradient while
any error at the scale of a real gradient still does.

The tolerance is ``tolerance(dtype)`` of the parameters' narrowest dtype, for the loss and every gradient
alike: in float64 1e-10 (a reshuffled sum moves a gradient by ~1e-15 of its scale; a wrong mask or a
statistic updated twice moves it by whole percents), in float32 1e-4 (~1e-6 observed), in half precision
units in the last place of the dtype (NOTE [half precision]).

NOTE [half precision]
A plan runs the program's own ops on the same values (the loss comes out the same to the bit), but not in
the program's order: a node the DP puts in a later stage is made later, so autograd, which runs its
backward in reverse creation order, adds that node's gradient contribution to a value's in another order
(GPT-2's tanh GELU reads its input three times). Floating-point addition is not associative: in float32 a
gradient moves by ~1e-6 of its scale, in bfloat16 (8 bits of precision) by units in its last place. (A
``transformers`` model's traced program rounds differently from its eager code to begin with: it branches
on ``is_tracing``.) Over the 20 models of ``results/coverage_bf16.md``, plain PyTorch against every plan,
the worst is 2.3 units (1.8%). So a half-precision step is exact within ``HALF_PRECISION_ULPS`` units of
its dtype's last place (bfloat16: 6%; float16: 0.8%), far below what a wrong gradient does: a
recomputation that drew its dropout masks afresh was off by 86% and more (``tests/test_any_model.py``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torchvision.ops import StochasticDepth

from harness.measure import clear_grads
from harness.tracing.probe import non_leaf_attributes

# Above these, a loss or a gradient is wrong, not rounded: a stage order changes only the order in which
# autograd sums a value's gradient contributions (rounding at ~1e-15 of the gradient's scale in float64,
# ~1e-6 in float32).
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4}
TOLERANCE = TOLERANCES[torch.float32]
SCALE_FLOOR = 1e-3  # of the model's largest gradient (see the module note)
HALF_PRECISION_ULPS = 8  # NOTE [half precision]: observed up to 2.3 in bfloat16


def tolerance(dtype: torch.dtype) -> float:
    """The worst relative difference of the loss or a gradient that is rounding in ``dtype`` (NOTE [half
    precision])."""
    return TOLERANCES.get(dtype, HALF_PRECISION_ULPS * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Difference:
    loss: float  # relative to plain PyTorch's loss
    worst_gradient: float  # relative to the gradient's scale
    worst_parameter: str
    buffers: tuple[str, ...]  # buffers (running statistics) that differ at all
    tolerance: float = TOLERANCE  # of the parameters' dtype: ``tolerance(dtype)``

    @property
    def exact(self) -> bool:
        return self.loss <= self.tolerance and self.worst_gradient <= self.tolerance and not self.buffers


def compare(model: nn.Module, example_input: torch.Tensor, loss_fn, run_plan: Callable[[], torch.Tensor],
            seed: int = 0) -> Difference:
    """Plain PyTorch's step on a copy of ``model``, then ``run_plan()`` (one step of ``model`` under a plan,
    returning the loss) from the same state and seed; ``model`` is put back as it was."""
    state = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model, {id(t): t.detach().clone() for t in non_leaf_attributes(model)})
    clear_grads(model)
    clear_grads(reference)
    torch.manual_seed(seed)
    reference_loss = loss_fn(reference(example_input))
    reference_loss.backward()
    torch.manual_seed(seed)
    loss = run_plan()
    worst, worst_name = 0.0, ""
    floor = SCALE_FLOOR * max((q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None),
                              default=0.0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None and q.grad is None:
            continue
        if p.grad is None or q.grad is None:
            difference = math.inf
        else:
            scale = max(q.grad.abs().max().item(), floor)
            difference = (p.grad - q.grad).abs().max().item() / (scale if scale > 0 else 1.0)
        if difference > worst or not worst_name:
            worst, worst_name = difference, name
    buffers = tuple(name for (name, b), r in zip(model.named_buffers(), reference.buffers()) if not torch.equal(b, r))
    model.load_state_dict(state)
    clear_grads(model)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    loss_scale = max(abs(reference_loss.item()), torch.finfo(reference_loss.dtype).tiny)
    return Difference(loss=abs(loss.item() - reference_loss.item()) / loss_scale, worst_gradient=worst,
                      worst_parameter=worst_name, buffers=buffers,
                      tolerance=max((tolerance(d) for d in dtypes), default=TOLERANCE))


def switch_on_randomness(model: nn.Module, p: float = 0.1) -> nn.Module:
    """Dropout, attention dropout and stochastic depth at ``p`` wherever a model has them switched off, so
    that an exactness check sees random ops in every place they can be (timm's ``DropPath`` included)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0:
            module.p = p
        elif isinstance(module, StochasticDepth) and module.p == 0:
            module.p = p
        elif isinstance(module, nn.MultiheadAttention) and module.dropout == 0:
            module.dropout = p
        elif type(module).__name__ == "DropPath" and getattr(module, "drop_prob", None) == 0:
            module.drop_prob = p
    return model
