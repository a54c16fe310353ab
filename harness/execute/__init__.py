"""Run one training step of a traced module under any ``Plan``: ``execute(traced, plan, *inputs, loss_fn=None)``.

One file a job: ``step`` (the forward pass and the stages' recomputations, NOTE [executing a plan]), ``store``
(what the saved-tensor hooks keep), ``side_effects`` (randomness and state replayed, NOTE [replaying side
effects]), ``swap`` (copies to host memory and back, NOTE [swapping]) and ``layout`` (what a plan's steps
share, made once)."""

from harness.execute.layout import stage_keys
from harness.execute.side_effects import call_node
from harness.execute.step import execute
from harness.execute.store import RECOMPUTE_EVENT, recorded_recomputations

__all__ = ["RECOMPUTE_EVENT", "call_node", "execute", "recorded_recomputations", "stage_keys"]
