"""What a strategy decides: the stages of a canonical strategy and which forward values are kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable

from strategies.graph import Graph, bits, members


class Action(str, Enum):
    """What happens to a forward value between the forward and the backward pass."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    SWAP = "swap"


class Inapplicable(ValueError):
    """The strategy does not apply to this graph at all (the message says why); a result row records it as
    ``infeasible``, as it does a budget no plan fits."""


class SolverTimeout(RuntimeError):
    """A solver's time limit ran out before it found any plan; a result row records it as ``timeout``."""


class InfeasibleBudget(ValueError):
    """No plan of this strategy fits ``budget_bytes``; ``min_feasible_bytes`` is the least that does, if known."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int | None, strategy: str = ""):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        who = f"{strategy}: " if strategy else ""
        known = (f"the minimal feasible budget is {min_feasible_bytes} bytes"
                 if min_feasible_bytes is not None else "the minimal feasible budget is not known")
        super().__init__(f"{who}no plan fits a budget of {budget_bytes} bytes; {known}")


class Runner(str, Enum):
    """What runs a plan's step (``harness.run.STEPS``, one entry a runner): this project's executor, eager or
    compiled (a plan whose ``runner`` is None), or a PyTorch peer's own step (``harness/execute/peers.py``)."""

    EXECUTOR = "executor"  # the executor runs the plan's stages (compiled: under torch.compile)
    TORCH_CHECKPOINT = "torch_checkpoint"  # checkpoint around each block, with the plan's selective policy if any
    TORCH_CHECKPOINT_SEQUENTIAL = "torch_checkpoint_sequential"  # checkpoint_sequential, in ``segments`` segments
    TORCH_COMPILE = "torch_compile"  # torch.compile's activation_memory_budget, at ``budget_ratio``
    TORCH_CHECKPOINT_ATTENTION = "torch_checkpoint_attention"  # checkpoint around each attention core

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


RUNNERS = tuple(runner.value for runner in Runner)
# Selective checkpointing policies a ``torch_checkpoint`` runner applies in each block (harness/execute/peers.py):
# "ops" saves the outputs of matmuls and fused attention kernels, "ops_every_second_mm" skips every second matmul of a
# block.
POLICIES = ("ops", "ops_every_second_mm")


@dataclass(frozen=True, slots=True)
class Plan:
    """A recomputation plan on a ``Graph``.

    ``stages`` are the sets ``V_1..V_k`` (bitsets), the differences of an increasing chain of lower sets
    ``L_1 ⊊ ... ⊊ L_k = V`` (Kusumoto et al. 2019, section 3). ``kept`` holds the nodes whose forward value survives
    from the forward pass to the backward pass; every other node is freed after its last forward use and
    recomputed, stage by stage, in the backward pass. ``swapped`` (a subset of ``kept``) holds the kept
    values copied to host memory after their last forward use and copied back for the backward pass;
    ``prefetch`` pairs each with the node whose backward starts its copy back (-1: when the backward pass
    starts). ``info`` carries figures a strategy reports besides its plan (for ``liveness_only``, the
    static memory plan's size). ``checkpointed`` (a bitset of stage indices) marks the stages that run as
    ``torch.utils.checkpoint`` runs a block (the PyTorch peers' plans): nothing the stage's layers save
    outlives its forward, its kept values serve the later stages alone, and its recomputation rebuilds
    every value its own backward reads, kept ones too (NOTE [a checkpointed stage] in
    ``strategies/replay.py``). ``selective`` (a subset of ``kept`` within the checkpointed stages) holds the
    values a selective checkpointing ``policy`` (``POLICIES``) saves: held from the forward, handed back to
    the stage's recomputation instead of being computed again, and with them what their layers saved (NOTE
    [selective checkpointing] in ``strategies/replay.py``). ``runner`` names what runs the step where it is not
    this project's executor (``Runner``: a PyTorch peer runs the model itself; ``segments`` and ``budget_ratio`` are
    its settings), and ``predicted`` is False
    where the plan's memory is decided out of the IR's sight (``torch.compile``'s own partitioner), so the
    simulator has nothing to predict.
    """

    strategy: str
    stages: tuple[int, ...]
    kept: int
    swapped: int = 0
    budget_bytes: int | None = None
    solve_time_s: float = 0.0
    info: dict[str, float | str] = field(default_factory=dict)  # figures and notes for the row, never control flow
    schedule: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    prefetch: tuple[tuple[int, int], ...] = ()
    checkpointed: int = 0
    runner: Runner | None = None  # None: the executor (eager, or compiled with compile=true)
    predicted: bool = True
    selective: int = 0
    policy: str | None = None  # the runner's selective checkpointing policy (POLICIES), with ``selective``
    segments: int | None = None  # Runner.TORCH_CHECKPOINT_SEQUENTIAL's
    budget_ratio: float | None = None  # Runner.TORCH_COMPILE's activation_memory_budget

    @classmethod
    def from_stages(cls, graph: Graph, stages: Iterable[Iterable[int] | int], *, strategy: str = "manual",
                    kept: Iterable[int] | int | None = None, budget_bytes: int | None = None,
                    solve_time_s: float = 0.0, info: dict[str, float] | None = None,
                    checkpointed: int = 0, runner: Runner | str | None = None, predicted: bool = True,
                    selective: Iterable[int] | int = 0, policy: str | None = None, segments: int | None = None,
                    budget_ratio: float | None = None) -> "Plan":
        """A plan from its stages; ``kept`` defaults to the canonical cache ``U_k`` (Kusumoto et al. 2019)."""
        masks = tuple(s if isinstance(s, int) else bits(s) for s in stages)
        if kept is None:
            kept_mask = canonical_cache(graph, masks)
        else:
            kept_mask = kept if isinstance(kept, int) else bits(kept)
        if runner is not None and runner not in RUNNERS:
            raise ValueError(f"Plan: unknown runner {runner!r}; valid: {', '.join(RUNNERS)}")
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"Plan: unknown selective checkpointing policy {policy!r}; valid: {', '.join(POLICIES)}")
        plan = cls(strategy=strategy, stages=masks, kept=kept_mask, budget_bytes=budget_bytes,
                   solve_time_s=solve_time_s, info=dict(info or {}), checkpointed=checkpointed,
                   runner=None if runner in (None, Runner.EXECUTOR) else Runner(runner), predicted=predicted,
                   selective=selective if isinstance(selective, int) else bits(selective), policy=policy,
                   segments=segments, budget_ratio=budget_ratio)
        plan.validate(graph)
        return plan

    @classmethod
    def from_chain(cls, graph: Graph, chain: Iterable[int], **kwargs) -> "Plan":
        """A plan from its chain of lower sets ``L_1 ⊊ ... ⊊ L_k = V`` (bitsets); a repeated set is skipped.
        Keyword arguments as for ``from_stages``."""
        stages, previous = [], 0
        for lower in chain:
            if lower != previous:
                stages.append(lower & ~previous)
                previous = lower
        return cls.from_stages(graph, stages, **kwargs)

    @property
    def recomputed(self) -> int:
        """Bitset of the nodes recomputed in the backward pass (given the graph's size through ``stages``)."""
        everything = 0
        for stage in self.stages:
            everything |= stage
        return everything & ~self.kept

    def lower_sets(self) -> list[int]:
        """The chain ``L_1 ⊊ ... ⊊ L_k``."""
        chain, lower = [], 0
        for stage in self.stages:
            lower |= stage
            chain.append(lower)
        return chain

    def stage_of(self, n: int) -> list[int]:
        """``stage_of[v]``: the index of the stage holding node ``v``."""
        out = [-1] * n
        for i, stage in enumerate(self.stages):
            for v in members(stage):
                out[v] = i
        return out

    def action(self, v: int) -> Action:
        if self.swapped >> v & 1:
            return Action.SWAP
        return Action.SAVE if self.kept >> v & 1 else Action.RECOMPUTE

    def validate(self, graph: Graph) -> None:
        """Raise ``ValueError`` naming the node when the plan does not describe a runnable strategy."""
        seen = 0
        for i, stage in enumerate(self.stages):
            if stage == 0:
                raise ValueError(f"Plan: stage {i} is empty; every stage V_i must hold a node")
            if stage & seen:
                v = members(stage & seen)[0]
                raise ValueError(f"Plan: node {v} ({graph.names[v]}) lies in more than one stage")
            seen |= stage
            if graph.in_neighbours(stage) & ~seen:  # ``seen`` less this stage is a lower set; is ``seen``?
                v = next(v for v in members(stage) if graph.pred_mask[v] & ~seen)
                u = members(graph.pred_mask[v] & ~seen)[0]
                raise ValueError(f"Plan: stage {i} holds node {v} ({graph.names[v]}) but its input {u} "
                                 f"({graph.names[u]}) comes in a later stage; stages must follow the edges")
        if seen != graph.all_nodes:
            v = members(graph.all_nodes & ~seen)[0]
            raise ValueError(f"Plan: node {v} ({graph.names[v]}) is in no stage; the stages must cover V")
        if self.checkpointed >> len(self.stages):
            raise ValueError(f"Plan: checkpointed names stage {self.checkpointed.bit_length() - 1}, but the plan has "
                             f"{len(self.stages)} stages")
        inside = 0
        for i in members(self.checkpointed):
            inside |= self.stages[i]
        if self.selective & ~(self.kept & inside):
            v = members(self.selective & ~(self.kept & inside))[0]
            raise ValueError(f"Plan: node {v} ({graph.names[v]}) is saved by a selective policy but is not a kept "
                             "node of a checkpointed stage")
        if self.swapped & ~self.kept:
            v = members(self.swapped & ~self.kept)[0]
            raise ValueError(f"Plan: node {v} ({graph.names[v]}) is swapped but not kept; only a kept value can "
                             "go to host memory and come back")
        if {u for u, _ in self.prefetch} != set(members(self.swapped)):
            raise ValueError("Plan: prefetch must name each swapped node once, with the node whose backward "
                             "starts its copy back")
        stage_of = self.stage_of(len(graph))
        for u in members(self.recomputed):
            for w in graph.succs[u]:
                if stage_of[w] != stage_of[u]:
                    raise ValueError(f"Plan: node {u} ({graph.names[u]}) is recomputed in stage {stage_of[u]} "
                                     f"but node {w} ({graph.names[w]}) of stage {stage_of[w]} reads it; keep "
                                     "it or move the two into one stage")


def canonical_cache(graph: Graph, stages: tuple[int, ...]) -> int:
    """``U_k``: the union of the boundaries ``∂(L_i)`` of the chain (Kusumoto et al.'s canonical strategy)."""
    cache = 0
    for lower, later in graph.frontiers(stages):
        cache |= lower & graph.in_neighbours(later)  # ∂(L_i)
    return cache
