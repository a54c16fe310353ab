"""What the saved-tensor hooks keep during a step: a tensor, or a token where the plan recomputes or swaps it (NOTE
[executing a plan] in ``harness/execute/step.py``)."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harness.execute.swap import _HostCopy

if TYPE_CHECKING:
    from harness.execute.swap import _Swap


RECOMPUTE_EVENT = "harness::recompute"  # what a profile calls a stage's recomputation (bench.profile_step)


_RECORDERS: list[list[list[str]]] = []  # recorded_recomputations()'s lists


@contextlib.contextmanager
def recorded_recomputations():
    """A list that gets, for each recomputation the steps run inside make, the fx nodes it reruns in the
    order it runs them (the overhead benchmark runs the same calls plainly, as the cost a recomputation
    cannot avoid; tests ask what the last recomputation of a step ran)."""
    stages: list[list[str]] = []
    _RECORDERS.append(stages)
    try:
        yield stages
    finally:
        _RECORDERS.remove(stages)


@dataclass(eq=False)
class _Saved:
    """What a saved-tensor hook keeps: the tensor, or for a recomputed or swapped value only its place."""

    tensor: torch.Tensor | None
    rank: int  # among what its call saved, parameters too: a rerun's saves are ranked alike
    group: int = -1
    geometry: tuple = ()  # (rank of the storage in its IR node, size, stride, offset, dtype)
    extra: tuple[str, int] | None = None  # (fx node, rank among what it saved): not a node's value
    swapped: _HostCopy | None = None


class _Store:
    """What the saved-tensor hooks keep (``pack``, ``unpack``): the tensor itself, or a token where the plan
    recomputes the value (or what its layer saved besides, NOTE [executing a plan]) or swaps it; the counts of
    tokens still to be unpacked, and the recomputed tensors they will read."""

    def __init__(self, group_of: dict[str, int], discarded: set[int], unreached: set[int], swap: _Swap,
                 recompute):
        self.group_of, self.discarded, self.unreached, self.swap = group_of, discarded, unreached, swap
        self.recompute = recompute  # group -> None: recompute the stage of that group
        self.static: set[int] = set()  # storages of parameters, buffers and inputs (set as the forward starts)
        self.storage_group: dict[int, tuple[weakref.ref, int, int]] = {}  # storage id -> (it, group, rank)
        self.storage_ranks: dict[int, dict[int, int]] = {}  # group -> storage id -> rank
        self.pending: list[_Saved] = []  # packed since the last resolve
        self.saves = 0  # tensors the call running saved so far
        self.packed: list[weakref.ref] = []  # to what the graph may still hold, to drop on failure
        self.unreached_saves: list[_Saved] = []  # what the layers no gradient reaches saved, until the loss
        self.tokens_left: dict[int, int] = {}  # group -> tokens not yet unpacked
        self.value_tokens: dict[int, int] = {}  # group -> those of them that read its value
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}  # group -> rank -> a tensor
        self.extra_nodes: set[str] = set()  # recomputed fx nodes that saved extras
        self.extras: dict[tuple[str, int], torch.Tensor] = {}  # recomputed extras, until unpacked
        self.extra_keys: set[tuple[str, int]] = set()  # (fx node, rank) of every extra token

    def drop_packed(self):
        for ref in self.packed:
            if (saved := ref()) is not None:
                saved.tensor = saved.swapped = None
        self.packed.clear()

    def drop_unreached(self):
        """Let go of what the layers no gradient reaches saved, at the loss, where plain PyTorch lets go of
        their autograd graph with the outputs (NOTE [what no gradient reaches] in
        ``harness/tracing/backward_profile.py``): a tensor held here would live to the step's end, and a token would
        hold a stage's kept values."""
        for saved in self.unreached_saves:
            if saved.swapped is not None:
                saved.swapped.tokens -= 1
            elif saved.group >= 0:
                self.tokens_left[saved.group] -= 1
                if saved.extra is None:
                    self.value_tokens[saved.group] -= 1
                else:
                    self.extra_keys.discard(saved.extra)
                    self.extra_nodes.discard(saved.extra[0])
            saved.tensor, saved.swapped, saved.group = None, None, -1
        self.unreached_saves.clear()

    def note_value(self, g: int, tensors: list[torch.Tensor]) -> None:
        """The tensors of a value the forward made for group ``g``: each of their storages not seen yet, with its
        rank among the group's, so that what a layer saves of it is known as ``g``'s."""
        ranks = self.storage_ranks.setdefault(g, {})
        for sid, t in _ranked(tensors, ranks).items():
            self.storage_group[sid] = (weakref.ref(t.untyped_storage()), g, ranks[sid])

    def begin_call(self):
        """Before a call inside the hooks: what is pending was saved by an earlier node and is left as it is."""
        self.pending.clear()
        self.saves = 0

    def pack(self, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        rank, self.saves = self.saves, self.saves + 1
        if id(tensor.untyped_storage()) in self.static:
            return tensor  # a parameter, buffer or input: never a token, and it holds no grad_fn to make a cycle
        saved = _Saved(tensor, rank)
        self.pending.append(saved)
        self.packed.append(weakref.ref(saved))
        return saved

    def resolve(self, node_name: str | None = None):
        """Turn what ``node_name`` saved into tokens where the plan recomputes it: a recomputed node's
        value, or anything else a recomputed node's layer saved (pooling indices), which the
        recomputation saves again (NOTE [executing a plan])."""
        group = self.group_of.get(node_name) if node_name else None
        if group in self.unreached:
            self.unreached_saves += self.pending
        for saved in self.pending:
            storage = saved.tensor.untyped_storage()
            entry = self.storage_group.get(id(storage))
            g, storage_rank = entry[1:] if entry and entry[0]() is storage else (-1, -1)
            t = saved.tensor
            if g in self.discarded or g in self.swap.groups:
                saved.group, saved.geometry = g, (storage_rank, t.size(), t.stride(), t.storage_offset(), t.dtype)
                if g in self.swap.groups:
                    saved.swapped = self.swap.copy_out(g, storage)
                    saved.swapped.tokens += 1
                    saved.tensor = None
                    continue
            elif g == -1 and group in self.discarded and id(storage) not in self.static and storage.nbytes():
                saved.group, saved.extra = group, (node_name, saved.rank)
                self.extra_nodes.add(node_name)
                self.extra_keys.add(saved.extra)
            else:
                continue
            saved.tensor = None
            self.tokens_left[saved.group] = self.tokens_left.get(saved.group, 0) + 1
            if saved.extra is None:
                self.value_tokens[saved.group] = self.value_tokens.get(saved.group, 0) + 1
        self.pending.clear()

    def unpack(self, saved: _Saved | torch.Tensor) -> torch.Tensor:
        if type(saved) is not _Saved:
            return saved
        if saved.tensor is not None:
            return saved.tensor
        if saved.swapped is None and saved.group < 0:
            raise RuntimeError("a backward reads what a layer saved that no gradient reached when the model was "
                               "traced: the step's loss uses an output the traced loss left out; trace with the "
                               "loss the step runs (trace(..., loss_fn=...))")
        if saved.swapped is not None:
            return self.swap.swapped_in(saved)
        g = saved.group
        if g not in self.recomputed:
            # marked only under a profiler: the mark costs tens of microseconds even with none running
            with torch.profiler.record_function(RECOMPUTE_EVENT) if torch.autograd._profiler_enabled() \
                    else contextlib.nullcontext():
                self.recompute(g)
        if saved.extra is not None:
            value = self.extras.pop(saved.extra)
        else:
            storage_rank, size, stride, offset, dtype = saved.geometry
            base = self.recomputed[g][storage_rank]
            assert base.dtype == dtype, "executor bug: a token's dtype differs from its recomputed storage's"
            whole = base.size() == size and base.stride() == stride and base.storage_offset() == offset
            value = base if whole else base.as_strided(size, stride, offset)
            self.value_tokens[g] -= 1
            if self.value_tokens[g] == 0:
                self.recomputed[g] = _EXTRAS_ONLY  # the value goes; what its layer saved may still be read
        self.tokens_left[g] -= 1
        if self.tokens_left[g] == 0:
            del self.recomputed[g]
        return value


_EXTRAS_ONLY = object()  # a recomputed group whose value no token reads any more (its extras may be)


def _ranked(tensors: list[torch.Tensor], ranks: dict[int, int]) -> dict[int, torch.Tensor]:
    """The storages of a value's ``tensors`` that ``ranks`` had not seen, by id, each with a tensor on it; each
    is given the next rank, so a value's storages are ranked alike in its forward call and its recomputation."""
    new = {}
    for t in tensors:
        sid = id(t.untyped_storage())
        if sid not in ranks:
            ranks[sid] = len(ranks)
            new[sid] = t
    return new
