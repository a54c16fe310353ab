"""A plan in the user's own training loop: ``plan_training(model, example_input, *example_targets, loss_fn=...)``.

NOTE [a plan in the user's loop]
``plan_training`` traces the user's model on an example batch with the user's loss (on that batch's targets),
solves a strategy at a budget that counts the whole device, as a row's does (or loads a saved plan, NOTE [a plan
file] in ``harness/plans.py``), and returns a ``PlannedStep``. The model stays the user's object: the trace and
the compiled module share its parameters and buffers, so the user's optimizer, scheduler, ``state_dict`` and
checkpoints work unchanged.
- Eager: ``step(inputs, *targets)`` runs the forward and the backward under the plan (the executor, NOTE
  [executing a plan] in ``harness/execute.py``) and returns the detached loss. Gradients accumulate into ``.grad``
  as ``loss.backward()`` does, so several calls before ``optimizer.step()`` accumulate micro-batches.
- Compiled: ``step.module`` (the traced program with the plan's marks) under ``torch.compile(step.module,
  backend=step.backend)``, in the user's own compiled step: the partitioner is told the plan, op by op (NOTE
  [compiling a plan] in ``harness/compiled.py``).
A plan is made for one input shape: the trace fixes the sizes the model's Python reads (NOTE [sizes fixed at the
example's] in ``harness/trace.py``) and the plan's bytes follow them. A batch of other shapes or dtypes is refused,
naming the first difference, and the model is left as it was; make one step per shape.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import strategies
from harness.budget import parse_budget
from harness.compiled import marked_module, plan_backend
from harness.execute import execute
from harness.plans import load_plan, save_plan
from harness.run import fixed_bytes, solve_on_device
from harness.trace import trace


class PlannedStep:
    """One training step of the user's model under a plan (NOTE [a plan in the user's loop])."""

    def __init__(self, model, traced, plan, loss_fn, example_input, example_targets, options, budget_bytes):
        self.model, self.traced, self.plan, self.loss_fn = model, traced, plan, loss_fn
        self.example_input, self.example_targets = example_input, tuple(example_targets)
        self.options, self.budget_bytes = options, budget_bytes
        self.static_bytes = fixed_bytes(model, example_input)
        prediction = strategies.simulate(traced.graph, plan)
        self.predicted_peak_bytes = prediction.peak_bytes + self.static_bytes

    def __call__(self, inputs: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of ``loss_fn(model(inputs), *targets)`` under the plan; the loss, detached."""
        self.check(inputs, *targets)
        return execute(self.traced, self.plan, inputs, loss_fn=lambda output: self.loss_fn(output, *targets))

    def check(self, inputs: torch.Tensor, *targets: torch.Tensor) -> None:
        """Refuse a batch whose shapes, dtypes or devices are not the plan's, naming the first that differs."""
        given, made = (inputs, *targets), (self.example_input, *self.example_targets)
        if len(given) != len(made):
            raise ValueError(f"the step takes an input and {len(made) - 1} targets, as its example; got "
                             f"{len(given) - 1} targets")
        for index, (tensor, example) in enumerate(zip(given, made)):
            what = "the input" if index == 0 else f"target {index - 1}"
            for name in ("shape", "dtype", "device"):
                if getattr(tensor, name) != getattr(example, name):
                    raise ValueError(
                        f"{what} has {name} {_shown(getattr(tensor, name))}, but the plan was made for "
                        f"{_shown(getattr(example, name))}: a plan holds for the shape it was traced on; make a "
                        "step for this batch with plan_training (one per shape)")

    @functools.cached_property
    def module(self) -> torch.fx.GraphModule:
        """The traced program with the plan's marks, to compile with ``backend``; it shares the model's
        parameters and buffers."""
        return marked_module(self.traced)

    @functools.cached_property
    def backend(self):
        """The ``torch.compile`` backend that runs the plan (``harness.compiled.plan_backend``)."""
        if self.plan.swapped:
            raise ValueError(f"{self.plan.strategy}: its copies to host memory are made by saved-tensor hooks, "
                             "which compiled code never runs; use the eager step")
        return plan_backend(self.example_input.device.type, self.plan.recomputed)

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` (NOTE [a plan file] in ``harness/plans.py``); ``plan_training(...,
        plan=path)`` loads it."""
        return save_plan(path, self.plan, self.traced, self.example_input, options=self.options,
                         budget_bytes=self.budget_bytes, predicted_peak_bytes=self.predicted_peak_bytes)


def plan_training(model: torch.nn.Module, example_input: torch.Tensor, *example_targets: torch.Tensor, loss_fn,
                  strategy: str = "approx_dp", budget=None, options: dict | None = None,
                  plan: str | Path | None = None, cost_model: str = "paper") -> PlannedStep:
    """A ``PlannedStep`` for ``model`` on batches shaped as ``example_input`` and ``example_targets``, with the
    loss ``loss_fn(output, *targets)``: ``strategy`` (with ``options``) solved at ``budget`` (bytes, ``"6GB"``,
    ``"device"`` or None for the strategy's least), or the plan saved at ``plan``."""
    options = dict(options or {})
    on_meta = [t.to("meta") for t in example_targets]
    traced = trace(model, example_input, cost_model=cost_model, loss_fn=lambda output: loss_fn(output, *on_meta))
    budget_bytes = parse_budget(budget, example_input.device.type)
    if plan is not None:
        chosen, saved = load_plan(plan, traced, example_input)
        options = saved["options"]
    else:
        chosen = solve_on_device(strategy, traced.graph, budget_bytes, fixed_bytes(model, example_input), options)
    if chosen.runner is not None or chosen.schedule is not None:
        raise ValueError(f"{chosen.strategy}: its plan is not one the executor runs ("
                         + (f"PyTorch's own step, {chosen.runner}" if chosen.runner else "a Checkmate schedule")
                         + "); choose a stage plan such as approx_dp, exact_dp, chen_sqrt, chen_greedy or optimal")
    return PlannedStep(model, traced, chosen, loss_fn, example_input, example_targets, options, budget_bytes)


def _shown(value) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value).removeprefix("torch.")
