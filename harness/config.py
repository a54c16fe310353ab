"""The command line's configuration, typed: ``configs/config.yaml`` extends ``Config``, so Hydra refuses a value of
the wrong type or outside its choices before anything runs (``compile=maybe``, ``dtype=float8``,
``batch_size=big``), naming the key and what it takes. The groups (``+net=``, ``+strategy=``, ``device=``) keep
their own files; ``run_cell`` checks their values (an unknown net, strategy or device names the valid ones)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from harness.execute.sharding import OPTIMIZERS, SHARDS
from harness.tracing.cost_models import COST_MODELS

DType = enum.Enum("DType", {name: name for name in ("float32", "bfloat16", "float16", "float64")})
CostModel = enum.Enum("CostModel", {name: name for name in COST_MODELS})
Shard = enum.Enum("Shard", {name: name for name in SHARDS})
Optimizer = enum.Enum("Optimizer", {name: name for name in OPTIMIZERS})


@dataclass
class Device:
    name: str = MISSING  # meta, cpu or cuda (configs/device/)
    warmup_steps: int = 0
    timed_steps: int = 0


@dataclass
class Config:
    net: Any = None  # +net=NAME: configs/net/
    strategy: Any = None  # +strategy=NAME: configs/strategy/
    device: Device = MISSING
    batch_size: Optional[int] = None
    image_size: Optional[int] = None
    compile: bool = False
    dtype: Optional[DType] = None  # None: the net's own (float32; the Llamas bfloat16)
    budget: Any = None  # null, a byte count or a size such as 6GB (harness.budget.parse_budget)
    cost_model: CostModel = CostModel.paper
    world_size: int = 1  # ranks of sharded data parallelism (shard=fsdp2); one rank is measured
    shard: Shard = Shard.none
    optimizer: Optimizer = Optimizer.none
    results_dir: str = MISSING
    resume: bool = False
    plan_out: Optional[str] = None  # a file to write the cell's plan to (harness/plans.py), for harness.train


ConfigStore.instance().store(name="config_schema", node=Config)
