"""A plan in the user's own training loop: ``plan_training(model, example_input, *example_targets, loss_fn=...)``.

NOTE [a plan in the user's loop]
``plan_training`` traces the user's model on an example batch with the user's loss (on that batch's targets),
solves a strategy at a budget that counts the whole device, as a row's does (or loads a saved plan, NOTE [a plan
file] in ``harness/plans.py``), and returns a ``PlannedStep``. The model stays the user's object: the trace and
the compiled module share its parameters and buffers, so the user's optimizer, scheduler, ``state_dict`` and
checkpoints work unchanged.
- Eager: ``step(inputs, *targets)`` runs the forward and the backward under the plan (the executor, NOTE
  [executing a plan] in ``harness/execute/step.py``) and returns the detached loss. Gradients accumulate into ``.grad``
  as ``loss.backward()`` does, so several calls before ``optimizer.step()`` accumulate micro-batches.
- Compiled: ``step.module`` (the traced program with the plan's marks) under ``torch.compile(step.module,
  backend=step.backend)``, in the user's own compiled step: the partitioner is told the plan, op by op (NOTE
  [compiling a plan] in ``harness/execute/compiled.py``).
- Through PyTorch's own machinery: ``step.checkpointed()`` is a module that runs the plan as
  ``torch.utils.checkpoint`` regions (NOTE [a plan as checkpoint regions]), for a loop that calls
  ``loss.backward()`` itself.
A plan is made for one input shape: the trace fixes the sizes the model's Python reads (NOTE [sizes fixed at the
example's] in ``harness/tracing/trace.py``) and the plan's bytes follow them. A batch of other shapes or dtypes is
refused, naming the first difference, and the model is left as it was; make one step per shape.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import strategies
from harness.budget import parse_budget
from harness.execute import call_node, execute, stage_keys
from harness.execute.compiled import marked_module, plan_backend
from harness.plans import load_plan, save_plan
from harness.run import check_compilable, fixed_bytes, solve_on_device
from harness.tracing.state import generators_of, rng_state, set_rng_state
from harness.tracing.trace import meta_copy, trace
from harness.tracing.traced import describe


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
        """The ``torch.compile`` backend that runs the plan (``harness.execute.compiled.plan_backend``)."""
        check_compilable(self.plan)
        return plan_backend(self.example_input.device.type, self.plan.recomputed)

    def checkpointed(self) -> "CheckpointedStages":
        """The plan as ``torch.utils.checkpoint`` regions (NOTE [a plan as checkpoint regions]): a module that
        shares the model's parameters, whose forward the user's own loop calls and differentiates."""
        return CheckpointedStages(self.traced, self.plan, self.example_input)

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
        budget_bytes = saved["budget_bytes"] if budget is None else budget_bytes
    else:
        chosen = solve_on_device(strategy, traced.graph, budget_bytes, fixed_bytes(model, example_input), options)
    if chosen.runner is not None or chosen.schedule is not None:
        raise ValueError(f"{chosen.strategy}: its plan is not one the executor runs ("
                         + (f"PyTorch's own step, {chosen.runner}" if chosen.runner else "a Checkmate schedule")
                         + "); choose a stage plan such as approx_dp, exact_dp, chen_sqrt, chen_greedy or optimal")
    return PlannedStep(model, traced, chosen, loss_fn, example_input, example_targets, options, budget_bytes)


def _shown(value) -> str:
    return str(tuple(value)) if isinstance(value, torch.Size) else str(value).removeprefix("torch.")


class CheckpointedStages(torch.nn.Module):
    """A stage plan run by ``torch.utils.checkpoint``.

    NOTE [a plan as checkpoint regions]
    The traced program is run stage by stage, in the executor's forward order (``stage_keys`` in
    ``harness/execute/``: a chain of lower sets, so each stage reads only values of itself and of earlier
    stages; random draws and state writes in the program's order). A stage that discards a value runs as one
    non-reentrant ``checkpoint`` region, whose outputs are the values later stages read; its selective
    checkpointing policy (``context_fn``) saves every op of the calls of the stage's kept nodes (their outputs
    come back from the policy's cache in the recomputation) and recomputes the rest. The plan's IR counterpart is
    the same plan with those stages ``checkpointed`` and their kept nodes ``selective`` (``as_checkpoint_plan``):
    the replay predicts it as it predicts the PyTorch peers (NOTE [a checkpointed stage] in
    ``strategies/replay.py``), and the frame that holds a region's inputs through its backward is what it holds
    beyond the executor's plan. Exactness: the recomputation skips the cached calls, so a recomputed call that
    draws random numbers is given the generators' state its forward call found (recorded then), not the state
    after the calls before it; ``checkpoint`` puts the state back afterwards. A recomputed call that writes the
    model's state (BatchNorm's running statistics) would write it a second time: such a plan is refused, naming
    the layer (the executor replays state writes: ``PlannedStep``).
    """

    def __init__(self, traced, plan, example_input: torch.Tensor):
        super().__init__()
        self.program = traced.module
        # The executor's forward order (harness/execute/layout.py): stage by stage, draws and state writes in the
        # program's order, a call of no IR node with its latest input, a view that reads a shape made in a later
        # stage (U-Net's crops) with that stage; each call runs in the region of the stage it runs in there.
        keys = stage_keys(traced, plan, plan.stage_of(len(traced.graph)))
        nodes = sorted(keys, key=keys.get)
        stage = {node: keys[node][0][0] for node in nodes}
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        self.stages, writers = [], None
        for s in range(-1, len(plan.stages)):  # -1: calls that read no value (attributes), before every stage
            members = [n for n in nodes if stage[n] == s and n.op not in ("placeholder", "output")]
            produced = set(members)
            outputs = [n for n in members if any(stage[user] > s for user in n.users)]
            inputs = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in produced))
            kept = {n for n in members if traced.group_of.get(n.name) is not None
                    and plan.kept >> traced.group_of[n.name] & 1}
            recomputing = s >= 0 and any(n not in kept and n.name in traced.group_of for n in members)
            if recomputing:
                writers = _state_writers(traced, example_input) if writers is None else writers
                for n in members:
                    if n not in kept and n.name in writers:
                        raise ValueError(
                            f"{plan.strategy}: as checkpoint regions, stage {s} recomputes "
                            f"{describe(n, traced.module)}, which writes the model's state (running statistics): "
                            "torch.utils.checkpoint would write it a second time; train with the step (the executor "
                            "replays state writes)")
            self.stages.append((members, inputs, outputs, kept, recomputing))
        self.modules_by_name = dict(traced.module.named_modules())
        self.random = traced.random_nodes

    def forward(self, *args):
        env = dict(zip(self.placeholders, args))
        devices = {t.device for t in args if isinstance(t, torch.Tensor)}
        rng = (devices, generators_of(self.program))
        for members, inputs, outputs, kept, recomputing in self.stages:
            seen: dict = {}
            run = functools.partial(self._run_stage, members, inputs, outputs, kept, rng, seen)
            values = [env[n] for n in inputs]
            if recomputing:
                done = torch.utils.checkpoint.checkpoint(run, *values, use_reentrant=False,
                                                         context_fn=functools.partial(_saving_context, seen))
            else:
                done = run(*values)
            env.update(zip(outputs, done))
        return torch.fx.node.map_arg(self.output.args[0], lambda n: env[n])

    def _run_stage(self, members, inputs, outputs, kept, rng, seen, *values):
        """One stage's calls; ``seen`` (shared by the forward and the recomputations of one step) holds the
        random calls' generator states and, under ``saving``, whether the call running is a kept node's."""
        recompute = seen.setdefault("calls", 0) > 0
        seen["calls"] += 1
        found = rng_state(rng) if recompute else None  # checkpoint puts back the default generators, not a model's
        env = dict(zip(inputs, values))
        try:  # a recomputation stops early by raising, once it has what the backward reads
            for node in members:
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                if node.name in self.random and node not in kept:
                    if recompute:
                        set_rng_state(seen[node.name])
                    else:
                        seen[node.name] = rng_state(rng)
                seen["saving"] = node in kept
                env[node] = call_node(self.program, self.modules_by_name, node, args, kwargs)
        finally:
            seen["saving"] = False
            if found is not None:
                set_rng_state(found)
        return tuple(env[n] for n in outputs)


def _state_writers(traced, example_input: torch.Tensor) -> set[str]:
    """The fx nodes whose calls write a parameter or buffer in place (BatchNorm's running statistics), found by
    running a copy of the traced program on meta and watching the tensors' version counters."""
    module = meta_copy(traced.module)
    state = [*module.parameters(), *module.buffers()]
    modules, env, writers = dict(module.named_modules()), {}, set()
    with torch.device("meta"):
        for node in module.graph.nodes:
            if node.op == "placeholder":
                env[node] = example_input.to("meta")
            elif node.op != "output":
                versions = [t._version for t in state]
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = call_node(module, modules, node, args, kwargs)
                if any(t._version != v for t, v in zip(state, versions)):
                    writers.add(node.name)
    return writers


def _saving_context(seen: dict):
    """``checkpoint``'s ``context_fn``: every op of a kept node's calls is saved, every other recomputed."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if seen.get("saving") else CheckpointPolicy.PREFER_RECOMPUTE

    # A kept call may write in place what it made (dropout fills the mask it allocated): every op of the call is
    # cached, and a write into a node's storage is its node's own call (NOTE [nodes are storages] in
    # harness/tracing/probe.py), so no recomputed op reads a cached tensor before such a write.
    return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)


def as_checkpoint_plan(plan):
    """The IR plan ``CheckpointedStages`` runs: ``plan`` with its recomputing stages checkpointed and their kept
    nodes saved by the selective policy (NOTE [a plan as checkpoint regions]). Where the executor's order runs a
    call in a later stage than its IR node's (a view that waits for a shape, U-Net's crops), the regions follow
    the order and this form does not."""
    checkpointed, selective = 0, 0
    for s, nodes in enumerate(plan.stages):
        if nodes & ~plan.kept:
            checkpointed |= 1 << s
            selective |= nodes & plan.kept
    return dataclasses.replace(plan, checkpointed=checkpointed, selective=selective, policy="ops", runner=None)
