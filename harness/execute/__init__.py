"""Running a plan: one training step of a traced module under any ``Plan``, ``execute(traced, plan, *inputs,
loss_fn=None)``, and the other ways a plan's step runs.

The executor, one file a job: ``step`` (the forward pass and the stages' recomputations, NOTE [executing a plan]),
``store`` (what the saved-tensor hooks keep), ``side_effects`` (randomness and state replayed, NOTE [replaying side
effects]), ``swap`` (copies to host memory and back, NOTE [swapping]) and ``layout`` (what a plan's steps share,
made once). Beside it: ``compiled`` (a plan's step under ``torch.compile``), ``peers`` (PyTorch's own
checkpointing and compile budget, one entry a runner), ``exact`` (a step's loss and gradients against plain
PyTorch's) and ``sharding`` (one rank under FSDP2)."""

from harness.execute.layout import stage_keys
from harness.execute.side_effects import call_node
from harness.execute.step import execute
from harness.execute.store import RECOMPUTE_EVENT, recorded_recomputations

__all__ = ["RECOMPUTE_EVENT", "call_node", "execute", "recorded_recomputations", "stage_keys"]
