"""The one simulator every strategy is judged by: a plan's peak memory and recomputation overhead.

The replay itself is ``strategies/replay.py`` (a step as allocations and frees), equation (2)
``strategies/equation2.py``.

NOTE [two memory models]
``liveness=False`` is Kusumoto et al.'s model as written (their equation (2)): the peak of
equation (2) over the stages, with term (ii) counted twice (forward values and gradients of the whole
stage) and terms (iii) and (iv) taken at the new lower set. For plans that keep more than the canonical
cache (``vanilla`` keeps everything) term (i) is the kept memory of the earlier stages, which is
``m(U_{i-1})`` for a canonical plan. We depart from the paper in one place: parameter gradients (zero on
hand-written graphs) are added as a constant, so the two models count the same things; what layers save
besides node values (``saved_extra_bytes``) is not in the paper's model and not in this one.

``liveness=True`` replays the step the executor (``harness.execute``) really runs, value by value, and
frees every value and gradient right after its last use (Kusumoto et al.'s liveness pass, which is also what
PyTorch's reference-counted autograd does):
- forward, stage by stage (``V_1`` first, node order within a stage): a value lives until its last
  forward reader (an output, ``Graph.outputs``, until the loss's forward), and then on into the backward
  pass only if it is kept and something needs it there (a backward that saved it, the loss's backward,
  or the recomputation of a discarded successor);
- what a layer's backward saves besides node values (``saved_extra_bytes``: pooling indices) lives from
  the layer's forward to its backward, or, for a recomputed layer, from its recomputation (made after the
  values that go at the layer have gone where its calls save them after reading those: ``_call``); what a
  layer's call holds only while it runs (``forward_transient_bytes``: a ``Linear`` on a non-contiguous batch of
  sequences makes its product, then a new buffer for the bias's sum) comes and goes with the call, in the
  forward and in a recomputation alike;
- the loss (NOTE [the loss] in ``harness/tracing/backward_profile.py``): its forward holds ``loss_forward_bytes`` beside
  the outputs, which then go unless a backward reads them; at the turn from forward to backward its
  backward makes the outputs' gradients (``loss_grad_bytes`` each: none for a sum's) while it holds
  ``loss_bytes``, first recomputing the stage of an output it reads that the plan discarded (on top of
  what it holds when it unpacks that output, ``loss_unpack_bytes``); its value and seed
  (``loss_held_bytes``) stay to the step's end;
- backward, in the reverse of that order (the autograd engine's): the first backward of a stage that
  needs a discarded value recomputes the discarded values of that stage the rest of the backward reads,
  and those they are made from (NOTE [what a recomputation makes]), from the kept ones (a
  recomputed layer that may write state holds a copy of it, as its forward call found it, from that call
  to the end of its recomputation, ``Profile.recompute_state_bytes``; to the end of the forward pass if its
  stage is not recomputed; a checkpointed stage's, ``batchnorm_once``'s, only while it reruns); each
  backward allocates the gradients of its inputs and its parameters, then frees its output's gradient,
  its saved extras and every value no later backward reads. Gradients are buffers as autograd hands
  them on (``_Gradients``): an input may get the layer's own gradient or one buffer shared with another
  input (``Profile.grad_shares``: an addition, a concatenation's views), a second gradient for a value is
  summed in place where the engine can, and a buffer goes when no value's gradient is in it. A layer
  with in-place members (a ReLU after its convolution) first reads its own value and turns the gradient
  it received into working ones (``Profile.backward_work_bytes``); both may go before its inputs are read,
  and so before a recomputation that reading calls for (a ReLU after an addition makes no working
  gradient: it reads its value while it makes the one it hands on); in-place members that hand a
  gradient on (``out += identity`` written in place after a batch norm, ``Profile.early_grads``) make it
  in that first step. A stage none of whose discarded values is read by a backward is not recomputed at
  all; ``overhead_cost`` is the cost of what the replay recomputes (equation (1), which charges every
  discarded value, under ``liveness=False``: an upper bound on it).
- swapped values (``plan.swapped``) leave the device after their last forward use, as if the copy to host
  kept up (``swap_step_time`` says whether it can), and come back when the backward of their
  ``prefetch`` node starts (or when the backward pass starts); from then on they are like kept values.
A plan with a general ``schedule`` (R, S) is replayed by ``schedule_timeline`` (``liveness=True``) or
counted by Checkmate's accounting (``liveness=False``, ``strategies/schedule.py``). Both return the same
``Prediction``; ``timeline`` exposes the event list so that other
analyses (the static memory plan of ``liveness_only``) read the very schedule the peak came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies import schedule
from strategies.equation2 import dp_view, equation_2_peak
from strategies.graph import Graph
from strategies.plan import InfeasibleBudget, Plan
from strategies.replay import Step, peak_of, timeline
from strategies.schedule_replay import schedule_timeline


@dataclass(frozen=True, slots=True)
class Prediction:
    peak_bytes: int  # on the device
    overhead_cost: float
    liveness: bool
    host_bytes: int = 0  # swapped values, all on the host at the turn from forward to backward; each is


def simulate(graph: Graph, plan: Plan, liveness: bool = True) -> Prediction:
    """Predict ``plan``'s peak bytes and its overhead in cost units (Kusumoto et al. 2019, equations (1) and (2))."""
    if plan.schedule is not None:
        training = schedule.training_graph(graph)
        computed, held = plan.schedule
        peak = (peak_of(schedule_timeline(graph, computed, held)) if liveness
                else schedule.peak(training, computed, held) + sum(graph.profile.param_bytes))
        return Prediction(peak_bytes=peak, overhead_cost=schedule.cost(training, computed), liveness=liveness)
    if liveness:
        return simulated_steps(graph, plan)[0]
    peak = equation_2_peak(dp_view(graph, "paper"), plan) + sum(graph.profile.param_bytes)
    overhead = graph.time(plan.recomputed)  # Eq. (1): everything not kept is computed twice
    return Prediction(peak_bytes=peak, overhead_cost=overhead, liveness=False, host_bytes=graph.mem(plan.swapped))


def simulated_steps(graph: Graph, plan: Plan) -> tuple[Prediction, list[Step]]:
    """``simulate`` of a stage plan by the liveness replay, with the replayed steps (for a caller that also asks
    where the step peaks)."""
    steps = timeline(graph, plan)
    # what the executor recomputes (NOTE [what a recomputation makes])
    overhead = sum(graph.cost[s.node] for s in steps if s.phase == "recompute" and s.call and s.node >= 0)
    return Prediction(peak_bytes=peak_of(steps), overhead_cost=overhead, liveness=True,
                      host_bytes=graph.mem(plan.swapped)), steps


def step_seconds(graph: Graph, step: Step, flops_per_s: float) -> float:
    """A step's compute time by the roofline of FLOPs alone: a backward costs twice its forward. A layer's
    call may take several steps (what its in-place members do first, what it holds while it unpacks, its
    extras after its reads); one of them carries its FLOPs (``Step.call``)."""
    if step.node < 0 or step.phase == "swap_in" or not step.call:
        return 0.0
    return graph.flops[step.node] / flops_per_s * (2.0 if step.phase == "backward" else 1.0)


def step_flops(graph: Graph, plan: Plan) -> float:
    """The FLOPs of one training step under ``plan``: the forward, every recomputation, and the backward at
    twice its forward (the cost model behind predicted step times)."""
    return sum(step_seconds(graph, s, 1.0) for s in timeline(graph, plan))


def swap_step_time(graph: Graph, plan: Plan, bandwidth_bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
    """The step-time lower bound of a plan that swaps: max(compute, bytes out / bandwidth, bytes in /
    bandwidth), with its three terms, in seconds (Meng et al. 2017's overlap of copies and compute)."""
    compute = step_flops(graph, plan) / flops_per_s
    moved = graph.mem(plan.swapped) / bandwidth_bytes_per_s
    return {"compute_s": compute, "swap_out_s": moved, "swap_in_s": moved, "step_time_bound_s": max(compute, moved)}


def check_budget(graph: Graph, plan: Plan, budget_bytes: int | None) -> None:
    """Raise ``InfeasibleBudget`` when a plan with no choices left exceeds the budget (liveness replay)."""
    if budget_bytes is None:
        return
    peak = simulate(graph, plan).peak_bytes
    if peak > budget_bytes:
        raise InfeasibleBudget(budget_bytes, peak, plan.strategy)
