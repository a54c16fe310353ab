"""A plan saved to a JSON file and loaded back against a traced model (``save_plan``, ``load_plan``).

NOTE [a plan file]
A plan names nodes by their index in the traced graph, so it means something only for the graph it was made
on. The file holds that graph's fingerprint (the input's shape and dtype; each IR node's name, shape and dtype,
found by running a copy of the traced program on meta), the strategy, its options, the budget and the predicted
peak, and a SHA-256 of all of it. Loading checks the digest (a truncated or edited file is refused, not
half-read), then the fingerprint against the model it is loaded for, and names the first difference: another
model, another batch or sequence shape, another dtype. ``Plan.validate`` then checks the stages on the graph.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from harness.results import write_atomically
from harness.tracing.trace import meta_copy, on_meta
from harness.tracing.traced import Traced
from strategies import Plan, bits, members
from strategies.plan import Runner

FORMAT = 1


class PlanFileError(ValueError):
    """A plan file that cannot be used here: unreadable, edited, or made for another graph (the message says
    which, naming the first difference)."""


def fingerprint(traced: Traced, example_input: torch.Tensor) -> dict:
    """The input's and every IR node's shape and dtype (``[name, shape, dtype]``), computed on meta."""
    final = {names[-1]: g for g, names in enumerate(traced.members)}
    described: dict[int, list] = {}

    class Shapes(fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node.name in final:
                tensor = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
                described[final[node.name]] = ([list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]
                                               if tensor is not None else [None, None])
            return out

    module = traced.module if on_meta(traced.module) else meta_copy(traced.module)  # the model's state untouched
    with torch.device("meta"):
        Shapes(module).run(example_input.to("meta"))
    return {"input": [list(example_input.shape), str(example_input.dtype).removeprefix("torch.")],
            "nodes": [[traced.graph.names[g], *described.get(g, [None, None])] for g in range(len(traced.graph))]}


def save_plan(path: str | Path, plan: Plan, traced: Traced, example_input: torch.Tensor, *,
              options: dict | None = None, budget_bytes: int | None = None,
              predicted_peak_bytes: int | None = None) -> Path:
    """Write ``plan`` for ``traced`` to ``path`` (JSON, NOTE [a plan file]); ``budget_bytes`` and the predicted
    peak count the whole device, as a row's do."""
    if plan.schedule is not None:
        raise ValueError(f"{plan.strategy}: a Checkmate schedule is predicted, not run; only stage plans are saved")
    body = {
        "format": FORMAT, "strategy": plan.strategy, "options": options or {}, "budget_bytes": budget_bytes,
        "predicted_peak_bytes": predicted_peak_bytes,
        "plan": {"stages": [members(stage) for stage in plan.stages], "kept": members(plan.kept),
                 "swapped": members(plan.swapped), "prefetch": [list(p) for p in plan.prefetch],
                 "checkpointed": members(plan.checkpointed), "selective": members(plan.selective),
                 "runner": plan.runner, "policy": plan.policy, "predicted": plan.predicted,
                 **{key: getattr(plan, key) for key in ("segments", "budget_ratio") if getattr(plan, key) is not None}},
        "graph": fingerprint(traced, example_input),
    }
    text = json.dumps(body, sort_keys=True)
    path = Path(path)
    whole = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}
    write_atomically(path, lambda out: out.write(json.dumps(whole, sort_keys=True, indent=1) + "\n"))
    return path


def load_plan(path: str | Path, traced: Traced, example_input: torch.Tensor) -> tuple[Plan, dict]:
    """The plan saved at ``path``, checked against ``traced`` on ``example_input`` (NOTE [a plan file]), and the
    file's other fields (strategy, options, budget, predicted peak)."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text())
        body, digest = saved["body"], saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PlanFileError(f"{path}: not a whole plan file ({type(error).__name__}: {error}); save it again") from None
    if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != digest:
        raise PlanFileError(f"{path}: the file was edited or damaged after it was saved (its SHA-256 differs); "
                            "save the plan again")
    if body.get("format") != FORMAT:
        raise PlanFileError(f"{path}: plan file format {body.get('format')!r}; this harness reads format {FORMAT}")
    difference = first_difference(body["graph"], fingerprint(traced, example_input))
    if difference:
        raise PlanFileError(f"{path}: the plan was made for another graph: {difference}")
    fields = body["plan"]
    plan = Plan(strategy=body["strategy"], stages=tuple(bits(stage) for stage in fields["stages"]),
                kept=bits(fields["kept"]), swapped=bits(fields["swapped"]),
                prefetch=tuple(tuple(p) for p in fields["prefetch"]), checkpointed=bits(fields["checkpointed"]),
                selective=bits(fields["selective"]), runner=fields["runner"] and Runner(fields["runner"]),
                policy=fields["policy"], predicted=fields["predicted"], budget_bytes=body["budget_bytes"],
                segments=fields.get("segments"), budget_ratio=fields.get("budget_ratio"))
    plan.validate(traced.graph)
    return plan, {key: body[key] for key in ("strategy", "options", "budget_bytes", "predicted_peak_bytes")}


def first_difference(saved: dict, here: dict) -> str | None:
    """The first way the graph fingerprint ``saved`` differs from ``here``, in words; None if they agree."""
    if saved["input"] != here["input"]:
        return (f"input of shape {tuple(saved['input'][0])} and dtype {saved['input'][1]} in the file, "
                f"{tuple(here['input'][0])} and {here['input'][1]} here")
    for index, (was, now) in enumerate(zip(saved["nodes"], here["nodes"])):
        if was != now:
            return (f"node {index} is {was[0]} {tuple(was[1] or ())} {was[2]} in the file, "
                    f"{now[0]} {tuple(now[1] or ())} {now[2]} here")
    if len(saved["nodes"]) != len(here["nodes"]):
        return f"{len(saved['nodes'])} nodes in the file, {len(here['nodes'])} here"
    return None
