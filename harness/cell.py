"""A cell: one measurement's settings, typed and checked once, at the edge (the command line's config, a driver's
flags, a script's call), before anything is built. The stages (``harness.run``) read nothing else.

NOTE [a cell's budget]
A cell's budget is bytes of the whole device (parameters, buffers and the input batch included), or None for
none: ``make_cell`` parses what a user wrote (``harness.budget``) there, and nothing parses it again. A
budget no plan of the strategy fits raises ``InfeasibleBudget`` carrying the least that does
(``harness.run.least_budget`` asks for it directly), so no budget stands for anything but its bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import strategies
from harness.budget import parse_budget
from harness.execute import sharding
from harness.measure import check_device
from harness.results import SCHEMA_VERSION, cell_name
from harness.tracing.cost_models import check_cost_model
from harness.zoo import nets


@dataclass(frozen=True)
class Cell:
    """What one measurement runs: a net (a zoo name or ``SOURCE:NAME`` with ``net_options``, ``harness.zoo.models``),
    a strategy and its ``options``, the sizes, the device and dtype, the budget in bytes, whether the step is
    compiled, the cost model the strategies optimise, the steps measured, and for one rank of sharded data
    parallelism its ``world_size``, ``shard`` and ``optimizer`` (NOTE [a rank under FSDP2] in
    ``harness/execute/sharding.py``). Made by ``make_cell``, which checks every field; its dicts are never changed."""

    net: str
    strategy: str
    batch_size: int
    image_size: int
    device: str = "meta"
    dtype: str = "float32"
    budget_bytes: int | None = None
    cost_model: str = "paper"
    options: dict = field(default_factory=dict)
    net_options: dict = field(default_factory=dict)
    compiled: bool = False
    warmup_steps: int = 2
    timed_steps: int = 5
    world_size: int = 1
    shard: str = "none"
    optimizer: str = "none"

    @property
    def sharded(self) -> bool:
        return self.shard != "none"

    @property
    def tokens(self) -> bool:
        """Whether the input is a sequence of ``image_size`` token ids."""
        return nets.spec(self.net, **self.net_options).input == "tokens"

    def settings(self) -> dict:
        """The row's fields that say what was run (``cell_name`` names its file from them)."""
        return {
            "schema_version": SCHEMA_VERSION, "net": self.net, "strategy": self.strategy,
            "batch_size": self.batch_size, "image_size": self.image_size, "device": self.device,
            "cost_model": self.cost_model, "budget_bytes": self.budget_bytes, "options": dict(self.options),
            "net_options": dict(self.net_options), "warmup_steps": self.warmup_steps,
            "timed_steps": self.timed_steps, "compiled": self.compiled, "dtype": self.dtype,
            "paper_node_count": nets.spec(self.net, **self.net_options).paper_nodes,
            **({"world_size": self.world_size, "shard": self.shard, "optimizer": self.optimizer}
               if self.sharded else {}),
        }

    @property
    def name(self) -> str:
        """The file name of the cell's row."""
        return cell_name(self.settings())

    def but(self, **changes) -> "Cell":
        """This cell with ``changes`` (already checked values: another budget, other options)."""
        return dataclasses.replace(self, **changes)


def make_cell(net: str, strategy: str, *, batch_size: int | None = None, image_size: int | None = None,
              device: str = "meta", budget=None, cost_model: str = "paper", options: dict | None = None,
              net_options: dict | None = None, compile: bool = False, dtype: str | None = None,
              warmup_steps: int = 2, timed_steps: int = 5, world_size: int = 1, shard: str = "none",
              optimizer: str = "none") -> Cell:
    """The cell these settings name, each checked: bad input raises here (``ValueError``, or ``KeyError`` for an
    unknown net or strategy), naming what is valid, before anything is built. ``budget``: bytes, or a size as
    users write it (``6GB``, ``device``: NOTE [a cell's budget]); ``batch_size``, ``image_size`` and ``dtype``
    None are the net's own (``NetSpec``)."""
    net_options = dict(net_options or {})
    spec = nets.spec(net, **net_options)
    strategies.module(strategy)
    check_device(device)
    dtype = spec.dtype if dtype is None else dtype
    nets.check_dtype(dtype)
    check_cost_model(cost_model, device)
    sharding.check(world_size, shard, optimizer)
    if shard != "none" and (device != "meta" or compile):
        raise ValueError(f"shard={shard} is measured on device=meta, eager (NOTE [a rank under FSDP2] in "
                         f"harness/execute/sharding.py); got device={device}{', compile=true' if compile else ''}")
    cell = Cell(net=net, strategy=strategy, batch_size=spec.batch_size if batch_size is None else batch_size,
                image_size=spec.image_size if image_size is None else image_size, device=device, dtype=dtype,
                budget_bytes=parse_budget(budget, device), cost_model=cost_model, options=dict(options or {}),
                net_options=net_options, compiled=bool(compile), warmup_steps=warmup_steps,
                timed_steps=timed_steps, world_size=world_size, shard=shard, optimizer=optimizer)
    nets.check_sizes(net, cell.batch_size, cell.image_size, **net_options)
    return cell
