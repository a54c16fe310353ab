"""One measurement, end to end: net -> trace -> Graph -> strategy -> Plan -> executor -> measurement -> row.

``run_cell`` is a plain function (the Hydra entry point in ``__main__`` is a thin wrapper around it), so
tests and scripts call it directly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import multiprocessing
import os
import platform
import subprocess
import time
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

import strategies
from harness import nets, peers, sharding
from harness.budget import parse_budget
from harness.compiled import plan_step as compiled_plan_step
from harness.execute import execute
from harness.measure import check_device, measure
from harness.models import NotAModel
from harness.plans import save_plan
from harness.results import FINAL, SCHEMA_VERSION, Status, cell_name, read_row, write_row
from harness.cost_models import check_cost_model
from harness.trace import trace
from strategies.plan import Runner
from strategies.simulate import step_flops

log = logging.getLogger(__name__)
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_cell(net: str, strategy: str, *, batch_size: int | None = None, image_size: int | None = None,
             device: str = "meta", budget=None, cost_model: str = "paper", options: dict | None = None,
             warmup_steps: int = 2, timed_steps: int = 5, results_dir: str | Path | None = None,
             resume: bool = False, isolate: bool | None = None, net_options: dict | None = None,
             compile: bool = False, dtype: str | None = None, world_size: int = 1, shard: str = "none",
             optimizer: str = "none", plan_out: str | Path | None = None) -> dict:
    """Measure ``strategy`` on ``net`` (a zoo net or ``SOURCE:NAME`` with ``net_options``, ``harness.models``)
    and return the result row (also written under ``results_dir``).

    ``isolate`` (default: on ``cuda``) measures in a fresh process: PyTorch does not free what a backward
    that ran out of CUDA memory held (pytorch/pytorch#82218), so one ``oom`` cell would leave every later
    cell of a sweep on a nearly full device. ``world_size``, ``shard`` and ``optimizer`` measure one rank
    of sharded data parallelism (NOTE [a rank under FSDP2] in ``harness/sharding.py``). ``plan_out`` names a
    file to write the cell's plan to (NOTE [a plan file] in ``harness/plans.py``), for ``harness.train``."""
    row = cell_row(net, strategy, batch_size=batch_size, image_size=image_size, device=device, budget=budget,
                   cost_model=cost_model, options=options, net_options=net_options, compile=compile, dtype=dtype,
                   warmup_steps=warmup_steps, timed_steps=timed_steps, world_size=world_size, shard=shard,
                   optimizer=optimizer)
    if resume and results_dir is not None and (Path(results_dir) / cell_name(row)).exists():
        done = read_row(Path(results_dir) / cell_name(row))
        final = done.get("status") in FINAL
        if final and done.get("schema_version") == SCHEMA_VERSION:
            log.info("%s: already measured (%s), skipped", cell_name(row), done["status"])
            return done
    if device == "cuda" if isolate is None else isolate:
        spawn = multiprocessing.get_context("spawn")  # a fresh CUDA context, and nothing of this process's
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
            return child.submit(run_cell, net, strategy, batch_size=batch_size, image_size=image_size,
                                device=device, budget=budget, cost_model=cost_model, options=options,
                                warmup_steps=warmup_steps, timed_steps=timed_steps, results_dir=results_dir,
                                isolate=False, net_options=net_options, compile=compile, dtype=dtype,
                                world_size=world_size, shard=shard, optimizer=optimizer,
                                plan_out=plan_out).result()
    start = time.perf_counter()
    try:
        row.update(_measure_cell(row, plan_out))
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
    log.info("%s", summary(row, tokens=nets.spec(net, **row["net_options"]).input == "tokens"))
    return row


def cell_row(net: str, strategy: str, *, batch_size: int | None = None, image_size: int | None = None,
             device: str = "meta", budget=None, cost_model: str = "paper", options: dict | None = None,
             net_options: dict | None = None, compile: bool = False, dtype: str | None = None, warmup_steps: int = 2,
             timed_steps: int = 5, world_size: int = 1, shard: str = "none", optimizer: str = "none") -> dict:
    """A cell's row before it is measured (``run_cell``'s arguments); bad input fails here, naming what is
    valid, before anything is built. ``dtype`` None is the net's own (``NetSpec.dtype``)."""
    net_options = dict(net_options or {})
    spec = nets.spec(net, **net_options)  # bad input fails here, before anything is built
    strategies.module(strategy)
    check_device(device)
    dtype = spec.dtype if dtype is None else dtype
    nets.check_dtype(dtype)
    check_cost_model(cost_model, device)
    sharding.check(world_size, shard, optimizer)
    if shard != "none" and (device != "meta" or compile):
        raise ValueError(f"shard={shard} is measured on device=meta, eager (NOTE [a rank under FSDP2] in "
                         f"harness/sharding.py); got device={device}{', compile=true' if compile else ''}")
    row = {
        "schema_version": SCHEMA_VERSION, "net": net, "strategy": strategy,
        "batch_size": spec.batch_size if batch_size is None else batch_size,
        "image_size": spec.image_size if image_size is None else image_size,
        "device": device, "cost_model": cost_model, "budget_bytes": parse_budget(budget, device),
        "options": dict(options or {}), "net_options": net_options, "warmup_steps": warmup_steps,
        "timed_steps": timed_steps, "compiled": bool(compile), "dtype": dtype,
        "paper_node_count": spec.paper_nodes, **_environment(),
        **({"world_size": world_size, "shard": shard, "optimizer": optimizer} if shard != "none" else {}),
    }
    nets.check_sizes(net, row["batch_size"], row["image_size"], **net_options)
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


def _traced_for(row: dict) -> SimpleNamespace:
    """``traced_net`` of ``row``'s net, kept between meta cells that do not compile (NOTE [traces kept between
    cells])."""
    args = (row["net"], row["batch_size"], row["image_size"], row["device"], row["dtype"], row["cost_model"])
    compiles = row["compiled"] or getattr(strategies.module(row["strategy"]), "RUNNER", None) == Runner.TORCH_COMPILE
    if row["device"] != "meta" or compiles:
        return traced_net(*args, **row["net_options"])
    key = (*args, json.dumps(row["net_options"], sort_keys=True, default=repr))
    if key not in _KEPT_TRACES:
        if len(_KEPT_TRACES) == _KEPT_AT_MOST:
            del _KEPT_TRACES[next(iter(_KEPT_TRACES))]  # the oldest
        _KEPT_TRACES[key] = traced_net(*args, **row["net_options"])
    return _KEPT_TRACES[key]


def build_cell(row: dict) -> SimpleNamespace:
    """What a cell runs, from its row (``net``, ``strategy``, sizes, ``device``, ``dtype``, ``budget_bytes``,
    ``options``, ``compiled``...): the model, its input and loss, the trace, the plan, what every plan holds
    (``static_bytes``) and ``step``, the training step that runs the plan (None for a general schedule)."""
    built = _traced_for(row)
    model, example_input, loss_fn, traced = built.model, built.example_input, built.loss_fn, built.traced
    static_bytes, graph = fixed_bytes(model, example_input), traced.graph
    sharded = row.get("shard", "none") != "none"
    if sharded:  # NOTE [a rank under FSDP2] in harness/sharding.py
        static_bytes = sharding.fsdp2_static(row["net"], row["world_size"], row["optimizer"], row["dtype"],
                                             row["net_options"])["static_bytes"]
        graph = dataclasses.replace(graph, param_grads_released=True)
    # A strategy that follows the net's own layout (a PyTorch peer) gets the zoo's blocks or sequence; they
    # stay out of the row's options, which name the result file (options given in the row win in _solve).
    structure = nets.structure(row["net"], model, **row["net_options"])
    plan = _solve(row, graph, static_bytes, peers.zoo_options(row["strategy"], structure))
    step = None
    if plan.schedule is None:  # a Checkmate schedule: see _measure_cell
        if plan.runner is not None:
            step = peers.step(plan, model, structure, example_input, loss_fn, compile=row["compiled"])
        elif row["compiled"]:
            check_compilable(plan)
            step = compiled_plan_step(traced, plan, example_input, loss_fn)
        else:
            step = lambda: execute(traced, plan, example_input, loss_fn=loss_fn)  # noqa: E731
        if sharded:
            step = partial(_released, model, step)
    return SimpleNamespace(model=model, example_input=example_input, loss_fn=loss_fn, traced=traced, plan=plan,
                           static_bytes=static_bytes, step=step, graph=graph)


def _released(model, step):
    with sharding.gradients_released(model):
        return step()


def _measure_cell(row: dict, plan_out=None) -> dict:
    """The measured and predicted fields of ``row``'s cell. NOTE [what the compiler holds besides the plan]:
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
    measured, cell = _measured_cell(row)
    if plan_out is not None:
        save_plan(plan_out, cell.plan, cell.traced, cell.example_input, options=row["options"],
                  budget_bytes=row["budget_bytes"], predicted_peak_bytes=measured["predicted_peak_bytes"])
    return measured


def _measured_cell(row: dict) -> tuple[dict, SimpleNamespace]:
    """``_measure_cell``'s fields, and the cell whose plan they measured."""
    cell = build_cell(row)
    measured = _measure_built(row, cell)
    budget, peak, predicted = row["budget_bytes"], measured["measured_peak_bytes"], measured["predicted_peak_bytes"]
    if not row["compiled"] or budget is None or peak is None or predicted is None or peak <= budget:
        return measured, cell
    eager = _eager_peak(row, cell, predicted)
    excess = peak - eager
    if excess <= 0:
        return {**measured, "device_reserve_bytes": eager - predicted}, cell
    try:
        cell = build_cell({**row, "budget_bytes": budget - excess})
    except strategies.InfeasibleBudget as error:
        raise strategies.InfeasibleBudget(budget, error.min_feasible_bytes and error.min_feasible_bytes + excess,
                                          f"{row['strategy']} (compiled, which holds {excess} bytes besides the "
                                          "plan's eager run)") from error
    return {**_measure_built(row, cell), "compile_excess_bytes": excess, "plan_budget_bytes": budget - excess}, cell


def _eager_peak(row: dict, cell: SimpleNamespace, predicted: int) -> int:
    """What ``cell``'s plan holds at its peak run eager on the row's device (NOTE [what the compiler holds
    besides the plan])."""
    if row["device"] != "cuda" or cell.plan.runner is not None:
        return predicted
    eager = measure(lambda: execute(cell.traced, cell.plan, cell.example_input, loss_fn=cell.loss_fn), cell.model,
                    (cell.example_input,), "cuda", warmup_steps=0, timed_steps=0)
    return eager.peak_bytes


def _measure_built(row: dict, cell: SimpleNamespace) -> dict:
    traced, plan, static_bytes, graph = cell.traced, cell.plan, cell.static_bytes, cell.graph
    predicted = strategies.simulate(graph, plan, liveness=True)
    predicted_no_liveness = strategies.simulate(graph, plan, liveness=False)
    if plan.schedule is not None:
        # A Checkmate schedule may recompute a node several times, out of the autograd engine's order: the
        # executor cannot run it, so the row holds the prediction only and says so.
        measured = {**dict.fromkeys(_MEASURED),
                    "method": "not run: the executor runs stage plans, not general (R, S) schedules"}
    else:
        compiled = row["compiled"] or plan.runner == Runner.TORCH_COMPILE
        measured = _measured(measure(cell.step, cell.model, (cell.example_input,), row["device"],
                                     row["warmup_steps"], row["timed_steps"], compiled=compiled))
        measured["compile_time_s"] = getattr(cell.step, "compile_time_s", None)
        if row.get("shard", "none") != "none" and measured["measured_peak_bytes"] is not None:
            # One rank: FSDP2's static part, and the step's peak less the whole model it ran with
            whole = fixed_bytes(cell.model, cell.example_input)
            measured["rank_activations_bytes"] = measured["measured_peak_bytes"] - whole
            measured["rank_static_bytes"] = static_bytes
            for key in ("measured_peak_bytes", "tracker_peak_bytes"):
                measured[key] += static_bytes - whole
        if row["device"] == "cuda" and measured["tracker_peak_bytes"] is not None:
            # What the device adds beyond the one accounting: cuDNN's and cuBLAS's workspaces, allocator rounding.
            measured["device_reserve_bytes"] = measured["measured_peak_bytes"] - measured["tracker_peak_bytes"]
    predicts = plan.predicted  # torch.compile's partitioner decides out of the IR's sight
    return {
        **measured,
        "predicted_peak_bytes": predicted.peak_bytes + static_bytes if predicts else None,
        "predicted_peak_no_liveness_bytes": predicted_no_liveness.peak_bytes + static_bytes if predicts else None,
        "predicted_overhead_cost": predicted.overhead_cost if predicts else None, "total_cost": sum(graph.cost),
        "predicted_step_flops": step_flops(graph, plan) if predicts and plan.schedule is None else None,
        "static_bytes": static_bytes, "node_count": len(graph), "layer_count": len(traced.group_of),
        "stage_count": len(plan.stages), "recomputed_node_count": bin(plan.recomputed).count("1"),
        "solve_time_s": plan.solve_time_s, **{f"plan_{key}": value for key, value in plan.info.items()},
        # the rows' fields as they were when these lived in ``info``: data for the tables, not control flow
        **({"plan_runner": plan.runner} if plan.runner else {}),
        **({} if plan.predicted else {"plan_prediction": plan.info.get("prediction", "none")}),
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


def _solve(row: dict, graph, static_bytes: int, zoo_options: dict):
    return solve_on_device(row["strategy"], graph, row["budget_bytes"], static_bytes, {**zoo_options, **row["options"]})


def solve_on_device(strategy: str, graph, budget: int | None, static_bytes: int, options: dict):
    """The strategy's plan; ``budget`` counts the whole device, the strategy's leaves out what every plan holds
    anyway (``static_bytes``: parameters, buffers, the input batch)."""
    try:
        if budget is not None and budget <= static_bytes:  # the fixed part alone does not fit: say what would
            strategies.solve(strategy, graph, 1, **options)  # raises, with the least by its own count
            raise strategies.InfeasibleBudget(budget, None)
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
