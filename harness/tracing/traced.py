"""The traced record: the fx module the executor runs and the IR strategies plan on, and an fx node named as a
person finds it in the model's code.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.fx as fx

from strategies import Graph


@dataclass(frozen=True)
class Traced:
    """A traced module: the fx module the executor runs and the IR strategies plan on."""

    module: fx.GraphModule
    graph: Graph
    members: tuple[tuple[str, ...], ...]  # fx node names of each IR node, in execution order
    group_of: dict[str, int]  # fx node name -> IR node, for the fx nodes that belong to one
    fx_node_count: int  # layer calls (fx nodes other than inputs, attributes and the output)
    written_in_place: frozenset[str] = frozenset()  # fx nodes that write their IR node's storage in place
    # The members before an IR node's last writer that return the tensor it returns (a layer's output that a
    # write in place such as ``x[i] = y`` or ``h.relu_()`` then wrote, read by name after the write) -> the IR node
    same_tensor: dict[str, int] = dataclasses.field(default_factory=dict)
    writes_state: frozenset[str] = frozenset()  # fx nodes that write an input, parameter or buffer in place
    state_order: frozenset[tuple[str, str]] = frozenset()  # (reader, writer): a buffer read before a write
    written_buffers: frozenset[str] = frozenset()  # buffers such a write writes
    # fx node -> the state it uses in the program's order: "generators" (it draws), buffers it can reach
    shared_state: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def layouts(self) -> dict:
        """What the executor derives from this trace and a plan, by plan, made at the plan's first step
        (``_layout`` in ``harness/execute/layout.py``); it goes with the trace."""
        return {}

    @property
    def random_nodes(self) -> frozenset[str]:
        """The fx nodes that draw random numbers."""
        return frozenset(name for name, state in self.shared_state.items() if "generators" in state)


class TraceFailure(RuntimeError):
    pass


def describe(node: fx.Node, module: torch.nn.Module) -> str:
    """An fx node as a person finds it in the model's code: the call and the module it sits in."""
    target = target_of(node, module)
    call = type(target).__name__ if isinstance(target, torch.nn.Module) else getattr(target, "__name__", str(target))
    scope = scope_of(node) or (node.target if node.op == "call_module" else "")
    return f"{call} ({node.name}" + (f" in module {scope!r})" if scope else ")")


def scope_of(node: fx.Node) -> str:
    """The path of the innermost module whose forward made ``node`` (fx records the module stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def target_of(node: fx.Node, module: torch.nn.Module):
    return module.get_submodule(node.target) if node.op == "call_module" else node.target
