"""One measurement, end to end, as stages: ``build(cell)`` (the net, traced), ``plan(cell, built)`` (the strategy's
plan), ``step(cell, built, plan)`` (the training step that runs it), ``measure(cell, built, plan, step)`` (its
measured and predicted fields) and ``run(cell)``, which adds the row's status and circumstances and writes it.
A ``Cell`` (``harness.cell``) is made once, at the edge; ``run_cell`` makes one from keywords and runs it.
The Hydra entry point (``__main__``) and every driver in ``harness.bench`` go through these stages.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import multiprocessing
import os
import platform
import subprocess
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

import strategies
from harness.cell import Cell, make_cell
from harness.execute import execute, peers, sharding
from harness.execute.compiled import plan_step as compiled_plan_step
from harness.measure import measure as measure_step
from harness.plans import save_plan
from harness.results import FINAL, SCHEMA_VERSION, Status, read_row, write_row
from harness.tracing.trace import trace
from harness.tracing.traced import Traced
from harness.zoo import nets
from harness.zoo.models import NotAModel
from strategies.plan import Plan, Runner
from strategies.simulate import step_flops

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_cell(net: str, strategy: str, *, results_dir: str | Path | None = None, resume: bool = False,
             isolate: bool | None = None, plan_out: str | Path | None = None, **settings) -> dict:
    """``run(make_cell(net, strategy, **settings), ...)``: a cell from keywords (``harness.cell.make_cell``), run."""
    return run(make_cell(net, strategy, **settings), results_dir=results_dir, resume=resume, isolate=isolate,
               plan_out=plan_out)


def run(cell: Cell, *, results_dir: str | Path | None = None, resume: bool = False, isolate: bool | None = None,
        plan_out: str | Path | None = None) -> dict:
    """Measure ``cell`` and return its row (also written under ``results_dir``; ``resume``: a row already there of
    this schema and a final status is returned as it is).

    ``isolate`` (default: on ``cuda``) measures in a fresh process: PyTorch does not free what a backward
    that ran out of CUDA memory held (pytorch/pytorch#82218), so one ``oom`` cell would leave every later
    cell of a sweep on a nearly full device. ``plan_out`` names a file to write the cell's plan to (NOTE [a
    plan file] in ``harness/plans.py``), for ``harness.train``."""
    if resume and results_dir is not None and (Path(results_dir) / cell.name).exists():
        done = read_row(Path(results_dir) / cell.name)
        if done.get("status") in FINAL and done.get("schema_version") == SCHEMA_VERSION:
            log.info("%s: already measured (%s), skipped", cell.name, done["status"])
            return done
    if cell.device == "cuda" if isolate is None else isolate:
        spawn = multiprocessing.get_context("spawn")  # a fresh CUDA context, and nothing of this process's
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
            return child.submit(run, cell, results_dir=results_dir, isolate=False, plan_out=plan_out).result()
    row = {**cell.settings(), **_environment()}
    start = time.perf_counter()
    try:
        row.update(_measure_cell(cell, plan_out))
        row["status"] = Status.OK
    except strategies.InfeasibleBudget as error:
        row.update(status=Status.INFEASIBLE, error=str(error), min_feasible_bytes=error.min_feasible_bytes)
    except strategies.Inapplicable as error:
        row.update(status=Status.INFEASIBLE, error=str(error))
    except strategies.SolverTimeout as error:
        row.update(status=Status.TIMEOUT, error=str(error))
    except torch.cuda.OutOfMemoryError as error:
        row.update(status=Status.OOM, error=str(error).splitlines()[0])
    except NotAModel:  # bad input, found only once the factory has run: no row
        raise
    except Exception as error:  # recorded as an error row, so that a sweep goes on
        row.update(status=Status.ERROR, error=f"{type(error).__name__}: {error}")
        log.error("%s", traceback.format_exc())
    row["wall_time_s"] = time.perf_counter() - start
    if results_dir is not None:
        row["row_path"] = str(write_row(row, results_dir))
    log.info("%s", summary(row, tokens=cell.tokens))
    return row


def traced_net(net: str, batch_size: int | None = None, image_size: int | None = None, device: str = "meta",
               dtype: str | None = None, cost_model: str = "paper", **net_options) -> SimpleNamespace:
    """A zoo net built and traced with its loss, as every cell traces it: ``model``, ``example_input``,
    ``loss_fn`` and ``traced`` (sizes default to the net's paper sizes)."""
    model, example_input, loss_fn = nets.build(net, batch_size, image_size, device, dtype, **net_options)
    traced = trace(model, example_input, cost_model, loss_fn=loss_fn)
    return SimpleNamespace(model=model, example_input=example_input, loss_fn=loss_fn, traced=traced)


# NOTE [traces kept between cells]
# A model on meta holds no values, and its trace depends only on the net, the sizes, the dtype and the cost
# model: the cells of a sweep on one net and size (each strategy, each budget; Hydra's multirun runs them in one
# process) share one trace, where tracing took most of each cell (PSPNet at batch 8: 4.8 s of 7.2). What a
# step leaves on the model is its gradients, which ``measure`` clears before and after every step, and the
# per-plan layouts the executor keeps with the trace. A cell that compiles (``compile=true``, the compile
# peer) traces afresh and keeps nothing: dynamo keeps its compiled code with the model's code. On any other
# device a step changes the weights and their statistics, and each cell starts from a model of its own.
_KEPT_TRACES: dict[tuple, SimpleNamespace] = {}
_KEPT_AT_MOST = 4


def _traced_for(cell: Cell) -> SimpleNamespace:
    """``traced_net`` of ``cell``'s net, kept between meta cells that do not compile (NOTE [traces kept between
    cells])."""
    args = (cell.net, cell.batch_size, cell.image_size, cell.device, cell.dtype, cell.cost_model)
    compiles = cell.compiled or getattr(strategies.module(cell.strategy), "RUNNER", None) == Runner.TORCH_COMPILE
    if cell.device != "meta" or compiles:
        return traced_net(*args, **cell.net_options)
    key = (*args, json.dumps(cell.net_options, sort_keys=True, default=repr))
    if key not in _KEPT_TRACES:
        if len(_KEPT_TRACES) == _KEPT_AT_MOST:
            del _KEPT_TRACES[next(iter(_KEPT_TRACES))]  # the oldest
        _KEPT_TRACES[key] = traced_net(*args, **cell.net_options)
    return _KEPT_TRACES[key]


@dataclass(frozen=True)
class Built:
    """What ``build`` makes of a cell: the model, its input and loss, the trace, the graph the strategies solve
    on (the trace's, or one rank's under sharding), what every plan holds besides the graph's values
    (``static_bytes``), and the net's own blocks or sequence (``structure``, for the PyTorch peers)."""

    model: torch.nn.Module
    example_input: torch.Tensor
    loss_fn: Callable
    traced: Traced
    graph: strategies.Graph
    static_bytes: int
    structure: dict


def build(cell: Cell) -> Built:
    """The cell's net, built and traced (kept between cells where that is safe: NOTE [traces kept between cells])."""
    made = _traced_for(cell)
    static_bytes, graph = fixed_bytes(made.model, made.example_input), made.traced.graph
    if cell.sharded:  # NOTE [a rank under FSDP2] in harness/execute/sharding.py
        static_bytes = sharding.fsdp2_static(cell.net, cell.world_size, cell.optimizer, cell.dtype,
                                             cell.net_options)["static_bytes"]
        graph = graph.replace(param_grads_released=True)
    return Built(model=made.model, example_input=made.example_input, loss_fn=made.loss_fn, traced=made.traced,
                 graph=graph, static_bytes=static_bytes,
                 structure=nets.structure(cell.net, made.model, **cell.net_options))


def plan(cell: Cell, built: Built) -> Plan:
    """The cell's strategy's plan within its budget (``InfeasibleBudget``, carrying the least, where none fits).
    A strategy that follows the net's own layout (a PyTorch peer) gets the zoo's blocks or sequence; they stay
    out of the cell's options, which name the row's file (options the cell gives win)."""
    return solve_on_device(cell.strategy, built.graph, cell.budget_bytes, built.static_bytes,
                           _strategy_options(cell, built))


def least_budget(cell: Cell, built: Built | None = None) -> int | None:
    """The least budget (bytes of the whole device) any plan of the cell's strategy fits, by the strategy's own
    search (None where it does not know it); the cell's budget is not read."""
    built = built or build(cell)
    least = strategies.least_budget(cell.strategy, built.graph, **_strategy_options(cell, built))
    return None if least is None else least + built.static_bytes


def _strategy_options(cell: Cell, built: Built) -> dict:
    """The cell's options over the zoo's blocks or sequence, for a strategy that follows the net's own layout."""
    return {**peers.zoo_options(cell.strategy, built.structure), **cell.options}


def step(cell: Cell, built: Built, plan: Plan) -> Callable[[], object] | None:
    """The training step that runs ``plan``, by its runner (``STEPS``): the executor's, eager or compiled, or a
    PyTorch peer's own (None for a general schedule, which the executor cannot run: see ``measure``)."""
    if plan.schedule is not None:
        return None
    training_step = STEPS[plan.runner or Runner.EXECUTOR](cell, built, plan)
    if cell.sharded:
        training_step = partial(_released, built.model, training_step)
    return training_step


def _executor_step(cell: Cell, built: Built, plan: Plan) -> Callable[[], object]:
    if cell.compiled:
        check_compilable(plan)
        return compiled_plan_step(built.traced, plan, built.example_input, built.loss_fn)
    return partial(execute, built.traced, plan, built.example_input, loss_fn=built.loss_fn)


def _peer_step(cell: Cell, built: Built, plan: Plan) -> Callable[[], object]:
    return peers.step(plan, built.model, built.structure, built.example_input, built.loss_fn, compile=cell.compiled)


# How a plan's step runs, by its runner: the executor's (compiled where the cell is), or a PyTorch peer's own.
STEPS = {runner: _executor_step if runner == Runner.EXECUTOR else _peer_step for runner in Runner}


def _released(model, training_step):
    with sharding.gradients_released(model):
        return training_step()


def _measure_cell(cell: Cell, plan_out=None) -> dict:
    """The measured and predicted fields of ``cell``. NOTE [what the compiler holds besides the plan]:
    a compiled step may hold more than the plan's replay predicts (PSPNet at batch 8 on meta: 0.71 to 0.83 GB
    at every budget, its partitioner saving what the plan does not know of). A compiled cell with a budget
    that measures over it is solved again with that excess taken off the budget, and compiled and measured
    again; the row says so (``compile_excess_bytes``, ``plan_budget_bytes``). Where no plan fits the smaller
    budget the row is ``infeasible``, naming the excess. The excess is the compiled step's peak less the
    same plan's run eager: on meta and cpu that is the replay's prediction (the tracker's count, to the
    byte); on cuda the eager step is measured too, since the device adds its reserve (cuDNN's and cuBLAS's
    workspaces, the allocator's rounding) to both, and that reserve, which every eager row carries over its
    budget as well (``device_reserve_bytes``), is no plan's doing: solving again for it would compile
    ResNet-152 twice for nothing. ``plan_out``: a file the measured plan is written to (``harness.plans``)."""
    built = build(cell)
    chosen = plan(cell, built)
    measured = measure(cell, built, chosen, step(cell, built, chosen))
    budget, peak, predicted = cell.budget_bytes, measured["measured_peak_bytes"], measured["predicted_peak_bytes"]
    if cell.compiled and None not in (budget, peak, predicted) and peak > budget:
        eager = _eager_peak(cell, built, chosen, predicted)
        excess = peak - eager
        if excess <= 0:
            measured = {**measured, "device_reserve_bytes": eager - predicted}
        else:
            chosen = _solved_again(cell, built, excess)
            built = build(cell)  # a compiled cell's model is built afresh (NOTE [traces kept between cells])
            measured = {**measure(cell, built, chosen, step(cell, built, chosen)), "compile_excess_bytes": excess,
                        "plan_budget_bytes": budget - excess}
    if plan_out is not None:
        save_plan(plan_out, chosen, built.traced, built.example_input, options=cell.options,
                  budget_bytes=cell.budget_bytes, predicted_peak_bytes=measured["predicted_peak_bytes"])
    return measured


def _solved_again(cell: Cell, built: Built, excess: int) -> Plan:
    """The compiled cell's plan for its budget less what the compiler held besides the first plan."""
    try:
        return plan(cell.but(budget_bytes=cell.budget_bytes - excess), built)
    except strategies.InfeasibleBudget as error:
        raise strategies.InfeasibleBudget(cell.budget_bytes, error.min_feasible_bytes and error.min_feasible_bytes
                                          + excess, f"{cell.strategy} (compiled, which holds {excess} bytes "
                                          "besides the plan's eager run)") from error


def _eager_peak(cell: Cell, built: Built, chosen: Plan, predicted: int) -> int:
    """What ``chosen`` holds at its peak run eager on the cell's device (NOTE [what the compiler holds besides
    the plan])."""
    if cell.device != "cuda" or chosen.runner is not None:
        return predicted
    eager = measure_step(partial(execute, built.traced, chosen, built.example_input, loss_fn=built.loss_fn),
                         built.model, (built.example_input,), "cuda", warmup_steps=0, timed_steps=0)
    return eager.peak_bytes


def measure(cell: Cell, built: Built, chosen: Plan, training_step: Callable[[], object] | None) -> dict:
    """The row's measured fields of ``training_step`` (``step``'s) and the simulator's prediction beside them."""
    graph, static_bytes = built.graph, built.static_bytes
    predicted = strategies.simulate(graph, chosen, liveness=True)
    predicted_no_liveness = strategies.simulate(graph, chosen, liveness=False)
    if training_step is None:
        # A Checkmate schedule may recompute a node several times, out of the autograd engine's order: the
        # executor cannot run it, so the row holds the prediction only and says so.
        measured = {**dict.fromkeys(_MEASURED),
                    "method": "not run: the executor runs stage plans, not general (R, S) schedules"}
    else:
        compiled = cell.compiled or chosen.runner == Runner.TORCH_COMPILE
        measured = _measured(measure_step(training_step, built.model, (built.example_input,), cell.device,
                                          cell.warmup_steps, cell.timed_steps, compiled=compiled))
        measured["compile_time_s"] = getattr(training_step, "compile_time_s", None)
        if cell.sharded and measured["measured_peak_bytes"] is not None:
            # One rank: FSDP2's static part, and the step's peak less the whole model it ran with
            whole = fixed_bytes(built.model, built.example_input)
            measured["rank_activations_bytes"] = measured["measured_peak_bytes"] - whole
            measured["rank_static_bytes"] = static_bytes
            for key in ("measured_peak_bytes", "tracker_peak_bytes"):
                measured[key] += static_bytes - whole
        if cell.device == "cuda" and measured["tracker_peak_bytes"] is not None:
            # What the device adds beyond the one accounting: cuDNN's and cuBLAS's workspaces, allocator rounding.
            measured["device_reserve_bytes"] = measured["measured_peak_bytes"] - measured["tracker_peak_bytes"]
    predicts = chosen.predicted  # torch.compile's partitioner decides out of the IR's sight
    return {
        **measured,
        "predicted_peak_bytes": predicted.peak_bytes + static_bytes if predicts else None,
        "predicted_peak_no_liveness_bytes": predicted_no_liveness.peak_bytes + static_bytes if predicts else None,
        "predicted_overhead_cost": predicted.overhead_cost if predicts else None, "total_cost": sum(graph.cost),
        "predicted_step_flops": step_flops(graph, chosen) if predicts and chosen.schedule is None else None,
        "static_bytes": static_bytes, "node_count": len(graph), "layer_count": len(built.traced.group_of),
        "stage_count": len(chosen.stages), "recomputed_node_count": bin(chosen.recomputed).count("1"),
        "solve_time_s": chosen.solve_time_s, **{f"plan_{key}": value for key, value in chosen.info.items()},
        # the rows' fields as they were when these lived in ``info``: data for the tables, not control flow
        **({"plan_runner": chosen.runner} if chosen.runner else {}),
        **({} if chosen.predicted else {"plan_prediction": chosen.info.get("prediction", "none")}),
    }


# Row field -> Measurement attribute.
_MEASURED = {"method": "method", "device_name": "device_name", "measured_peak_bytes": "peak_bytes",
             "tracker_peak_bytes": "tracker_peak_bytes", "measured_params_bytes": "params_bytes",
             "measured_grads_bytes": "grads_bytes", "measured_activations_bytes": "activations_bytes",
             "measured_host_peak_bytes": "host_peak_bytes",
             "reserved_bytes": "reserved_bytes", "nvml_used_bytes": "nvml_used_bytes",
             "step_time_ms": "step_time_ms", "step_time_iqr_ms": "step_time_iqr_ms",
             "measured_step_flops": "step_flops", "gpu_kernel_ms": "gpu_kernel_ms"}


def check_compilable(plan) -> None:
    """Raise ``Inapplicable`` for a plan that cannot run under ``torch.compile``."""
    if plan.swapped:
        raise strategies.Inapplicable(
            f"{plan.strategy} under compile=true: its copies to host memory are made by saved-tensor hooks "
            "(NOTE [swapping] in harness/execute/swap.py), which compiled code never runs; run it with compile=false")


def _measured(measured) -> dict:
    return {field: getattr(measured, attribute) for field, attribute in _MEASURED.items()}


def fixed_bytes(model, example_input) -> int:
    """What every plan holds besides the graph's values: parameters, buffers and the input batch."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), example_input])


def solve_on_device(strategy: str, graph, budget: int | None, static_bytes: int, options: dict):
    """The strategy's plan; ``budget`` counts the whole device, the strategy's leaves out what every plan holds
    anyway (``static_bytes``: parameters, buffers, the input batch). Where none fits, ``InfeasibleBudget``
    carries the least whole-device budget that does."""
    if budget is not None and budget <= static_bytes:  # the fixed part alone does not fit: say what would
        least = strategies.least_budget(strategy, graph, **options)
        raise strategies.InfeasibleBudget(budget, None if least is None else least + static_bytes, strategy)
    try:
        return strategies.solve(strategy, graph, None if budget is None else budget - static_bytes, **options)
    except strategies.InfeasibleBudget as error:
        minimum = None if error.min_feasible_bytes is None else error.min_feasible_bytes + static_bytes
        raise strategies.InfeasibleBudget(budget, minimum, strategy) from error


def _environment() -> dict:
    # A copy of the tree whose .git is not its own (a GPU node sent the working tree, with a stale .git) is
    # told its commit: HARNESS_GIT_COMMIT="<hash>" or "<hash> dirty" (results/gpu_checks.sh reads .whl/COMMIT).
    told = os.environ.get("HARNESS_GIT_COMMIT", "").split()
    commit, dirty = (told[0], told[1:] == ["dirty"]) if told else (
        _git("rev-parse", "HEAD"), bool(_git("status", "--porcelain", "--untracked-files=no")))
    return {"torch_version": torch.__version__, "git_commit": commit, "git_dirty": dirty,
            "hostname": platform.node(), "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _gb(value) -> str:
    return "n/a" if value is None else f"{value / 1e9:.2f} GB"


def summary(row: dict, tokens: bool = False) -> str:
    """A few lines a person can read (``tokens``: the input is a sequence of ``image_size`` token ids)."""
    size = f"{row['image_size']} tokens" if tokens else f"{row['image_size']}x{row['image_size']}"
    if row.get("dtype", "float32") != "float32":
        size += f", {row['dtype']}"
    head = (f"{row['net']} / {row['strategy']}: batch {row['batch_size']}, {size}, device {row['device']} -> "
            f"{row['status']}")
    if row["status"] != Status.OK:
        return f"{head}\n  {row.get('error', '')}"
    if row.get("measured_peak_bytes") is None:
        measured_part = f"  measured: {row['method']}"
    elif row.get("rank_static_bytes") is not None:
        measured_part = (
            f"  one rank of {row['world_size']} ({row['shard']}, optimizer {row['optimizer']}): peak "
            f"{_gb(row['measured_peak_bytes'])} ({row['method']}): static {_gb(row['rank_static_bytes'])} (measured "
            f"with fully_shard), the plan's step {_gb(row['rank_activations_bytes'])}")
    else:
        measured_part = (
            f"  measured peak {_gb(row['measured_peak_bytes'])} ({row['method']}): params "
            f"{_gb(row['measured_params_bytes'])}, grads {_gb(row['measured_grads_bytes'])}, activations "
            f"{_gb(row['measured_activations_bytes'])}")
    time_part = (f"; step {row['step_time_ms']:.1f} ms (IQR {row['step_time_iqr_ms']:.1f})"
                 if row.get("step_time_ms") is not None else "")
    if row.get("compile_time_s") is not None:
        time_part += f"; compile {row['compile_time_s']:.1f} s"
    if row.get("plan_host_bytes") is not None:
        time_part += (f"\n  swap: {row['plan_swapped_count']} values, {_gb(row['plan_host_bytes'])} each way "
                      f"(host peak measured {_gb(row.get('measured_host_peak_bytes'))}); step time at least "
                      f"{row['plan_step_time_bound_s'] * 1e3:.1f} ms (compute {row['plan_compute_s'] * 1e3:.1f} ms), "
                      f"prefetch {row['plan_prefetch']}")
    return "\n".join([
        head,
        measured_part + time_part,
        (f"  predicted peak {_gb(row['predicted_peak_bytes'])} (without liveness "
         f"{_gb(row['predicted_peak_no_liveness_bytes'])}); overhead {row['predicted_overhead_cost']:g} of "
         f"{row['total_cost']:g} {'forward ms' if row.get('cost_model') == 'measured' else 'cost units'}; "
         f"{row['stage_count']} stage(s), {row['recomputed_node_count']} recomputed"
         if row.get("predicted_peak_bytes") is not None
         else "  predicted: none (the plan is made out of the IR's sight)"),
        f"  graph: {row['node_count']} IR nodes from {row['layer_count']} layers (paper #V {row['paper_node_count']}); "
        f"solve {row['solve_time_s'] * 1e3:.1f} ms; run {row['wall_time_s']:.1f} s",
    ] + ([f"  row: {row['row_path']}"] if "row_path" in row else []))
