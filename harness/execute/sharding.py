"""A rank's memory under sharded data parallelism: ``fsdp2_static`` measures what PyTorch's FSDP2
(``fully_shard``) holds on one rank besides activations, and ``gradients_released`` runs a step as a rank does.

NOTE [a rank under FSDP2]
A cell with ``shard=fsdp2``, ``world_size=N`` (and ``optimizer=adamw``) counts one rank of N. What FSDP2
holds there is not computed by hand: the net is built, each of its zoo blocks and then the whole model
wrapped with ``fully_shard`` on a mesh of N ranks over torch's fake process group (its collectives move
nothing), all under ``FakeTensorMode`` on the CPU (no tensor holds data, so an 8B model takes seconds), and
one training step is measured by PyTorch's ``FSDPMemTracker`` at a batch of one sample of 16 tokens (or
one image), after a first step has made the optimizer's states. At the tracker's peak it holds: the
sharded parameters (float32 master weights; a bfloat16 run computes in bfloat16 through FSDP2's
``MixedPrecisionPolicy``, reducing in float32), their sharded gradients, AdamW's two states a parameter,
and the units gathered at that moment (the unit at work and the one prefetched) with their unsharded
gradients and the buffers of the reduce-scatter. That peak less its activations and inputs is the rank's
static part (``Row.rank_static_bytes``).
The rest is the plan's: the cell's step runs the unsharded model on meta with every parameter gradient
released as soon as it is accumulated (FSDP2 reduce-scatters it to the shard and frees it), and the graph
says so (``Profile.param_grads_released``), so the replay predicts that step to the byte as it does any
other. A rank's peak is the static part plus that step's peak less the whole model's parameters, buffers
and input. Every strategy plans in what the budget leaves after the static part.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json

import torch
from torch import nn

SHARDS = ("none", "fsdp2")
OPTIMIZERS = ("none", "adamw")


def check(world_size: int, shard: str, optimizer: str) -> None:
    """Raise ``ValueError`` naming the valid choices for a bad combination."""
    if shard not in SHARDS:
        raise ValueError(f"unknown shard {shard!r}; valid: {', '.join(SHARDS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number of ranks, at least 1, got {world_size!r}")
    if shard == "none" and world_size != 1:
        raise ValueError(f"world_size={world_size} needs shard=fsdp2: without sharding every rank holds what one "
                         "device does (world_size=1)")
    if shard == "none" and optimizer != "none":
        raise ValueError(f"optimizer={optimizer} is measured with shard=fsdp2 (world_size=1 for one device); "
                         "valid optimizers without sharding: none")


@contextlib.contextmanager
def gradients_released(model: nn.Module):
    """Within the context, each parameter's gradient goes as soon as it is accumulated, as FSDP2 frees an
    unsharded gradient once it is reduce-scattered (NOTE [a rank under FSDP2])."""
    def release(parameter):
        parameter.grad = None

    handles = [p.register_post_accumulate_grad_hook(release) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fsdp2_static(net: str, world_size: int, optimizer: str, dtype: str, net_options: dict | None = None) -> dict:
    """What FSDP2 holds on one rank of ``world_size`` besides activations (NOTE [a rank under FSDP2]): the
    tracker's figures at its peak, by its own categories, and ``static_bytes``, their sum less activations
    and inputs. A net with no blocks to shard fails, naming it."""
    return dict(_fsdp2_static(net, world_size, optimizer, dtype, json.dumps(net_options or {}, sort_keys=True)))


@functools.cache
def _fsdp2_static(net: str, world_size: int, optimizer: str, dtype: str, net_options: str) -> tuple:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.zoo import nets

    spec = nets.spec(net, **json.loads(net_options))
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is already running; "
                           f"measure world_size={world_size} in a fresh process")
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode():
            builds_in = "dtype" in inspect.signature(spec.build_model).parameters
            with torch.device("cpu"):
                model = spec.build_model(dtype=torch.float32) if builds_in else spec.build_model()
            model.train()
            units = spec.blocks(model)
            if not units:
                raise ValueError(f"{net} has no units to shard: the zoo lists no blocks for it (shard=fsdp2 wraps "
                                 "each block with fully_shard)")
            if any("[" in unit for unit in units):
                raise ValueError(f"{net}: shard=fsdp2 wraps modules, and its blocks are slices of a sequence "
                                 f"({units[0]})")
            policy = MixedPrecisionPolicy(param_dtype=nets.check_dtype(dtype), reduce_dtype=torch.float32)
            for unit in units:
                fully_shard(model.get_submodule(unit), mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            optim = torch.optim.AdamW(model.parameters(), foreach=True) if optimizer == "adamw" else None
            if spec.input == "tokens":
                batch = torch.randint(0, spec.vocab_size, (1, 16))
            else:
                batch = torch.randn(1, spec.channels, spec.image_size, spec.image_size)
            loss = _float_sum
            loss(model(batch)).backward()
            if optim is not None:
                optim.step()
            model.zero_grad(set_to_none=True)
            tracker = FSDPMemTracker(model, optim)
            tracker.track_inputs((batch,))
            with tracker:
                loss(model(batch)).backward()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        if started:
            dist.destroy_process_group()
    figures = {str(getattr(key, "value", key)): int(value) for device in peak.values() for key, value in device.items()}
    static = figures["Total"] - figures.get("Activation", 0) - figures.get("Inputs", 0)
    return tuple(sorted({**figures, "static_bytes": static}.items()))


def _float_sum(output) -> torch.Tensor:
    output = output[0] if isinstance(output, tuple) else output
    return output.float().sum()
