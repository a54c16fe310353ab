"""Memory-saving strategies on one graph IR; pure Python (this package never imports torch).

``solve(name, graph, budget_bytes=None, **options) -> Plan`` runs the strategy ``name``; ``available()``
lists the names. Each strategy is one module here with one public function,
``solve(graph, budget_bytes, *, options=None) -> Plan``, and a frozen ``Options`` dataclass; adding one is
a new module, a line in ``_MODULES`` and a config under ``configs/strategy/``. Each module also says, in
``BUDGET_LIVENESS``, which of the simulator's two memory models its budget is judged by: every strategy
uses the liveness replay, which is how the real step frees (the DPs optimise equation (2), the ILP
Checkmate's accounting, and each searches its own count's budget for the loosest plan whose replay fits;
with ``memory_model=paper`` they are judged by their papers' counts, as Kusumoto et al. 2019 and Checkmate ran them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import importlib
import time
from types import ModuleType

from strategies.graph import Graph, Profile, bits, members
from strategies.plan import Action, Inapplicable, InfeasibleBudget, Plan, SolverTimeout
from strategies.simulate import Prediction, simulate

# name -> module; imported on first use so that a strategy's optional dependencies stay optional.
_MODULES = {
    "vanilla": "strategies.vanilla",
    "optimal": "strategies.optimal",
    "brute_force": "strategies.brute_force",
    "liveness_only": "strategies.liveness_only",
    "exact_dp": "strategies.exact_dp",
    "approx_dp": "strategies.approx_dp",
    "chen_sqrt": "strategies.chen_sqrt",
    "chen_greedy": "strategies.chen_greedy",
    "torch_checkpoint_blocks": "strategies.torch_checkpoint_blocks",
    "torch_checkpoint_sequential": "strategies.torch_checkpoint_sequential",
    "ilp_optimal": "strategies.ilp_optimal",
    "torch_compile_budget": "strategies.torch_compile_budget",
    "sac_ops": "strategies.sac_ops",
    "megatron_selective": "strategies.megatron_selective",
    "swap": "strategies.swap",
}

__all__ = ["Action", "Graph", "Inapplicable", "InfeasibleBudget", "Plan", "Prediction", "Profile", "SolverTimeout",
           "available", "bits", "cycle_collector_off", "least_budget", "members", "module", "simulate", "solve"]


# The strategies with a ``mode`` option, tc (time-centric) or mc (memory-centric).
WITH_MEMORY_MODE = ("approx_dp", "brute_force", "exact_dp", "optimal")


def available() -> list[str]:
    return sorted(_MODULES)


def no_memory_mode(name: str) -> str:
    return (f"{name} has no memory-centric mode; strategies with one: {', '.join(WITH_MEMORY_MODE)} "
            "(option mode=mc)")


def module(name: str) -> ModuleType:
    """The module of strategy ``name``; an unknown name raises ``KeyError`` listing the valid ones."""
    if name not in _MODULES:
        close = difflib.get_close_matches(name, _MODULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown strategy {name!r}; valid strategies: {', '.join(available())}.{hint}")
    return importlib.import_module(_MODULES[name])


def solve(name: str, graph: Graph, budget_bytes: int | None = None, **options) -> Plan:
    """Run strategy ``name`` on ``graph``; the returned plan records the solver's wall time."""
    strategy = module(name)
    valid = [f.name for f in dataclasses.fields(strategy.Options)]
    unknown = sorted(set(options) - set(valid))
    if "mode" in unknown:
        raise TypeError(no_memory_mode(name))
    if unknown:
        raise TypeError(f"strategy {name!r} has no option {', '.join(unknown)}; "
                        f"its options: {', '.join(valid) or 'none'}")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    start = time.perf_counter()
    with cycle_collector_off():
        plan = strategy.solve(graph, budget_bytes, options=strategy.Options(**options))
    return dataclasses.replace(plan, solve_time_s=time.perf_counter() - start)


def least_budget(name: str, graph: Graph, **options) -> int | None:
    """The least budget any plan of strategy ``name`` fits on ``graph`` (None where the strategy does not know it).
    Every strategy, given a budget below its least, raises ``InfeasibleBudget`` carrying that least; a budget of one
    byte is below every plan's."""
    try:
        solve(name, graph, 1, **options)
    except InfeasibleBudget as error:
        return error.min_feasible_bytes
    return 1


@contextlib.contextmanager
def cycle_collector_off():
    """Python's cycle collector off while the block runs. A solve makes many small objects and no cycles; the
    collector, set off by their number, would walk every object the process holds (a traced model's) again and
    again. ``harness.measure`` holds it off over a timed step too."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
