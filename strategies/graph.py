"""The graph IR every strategy works on (Kusumoto et al. 2019, section 3).

Nodes are *values* (tensors), numbered ``0..n-1`` in a topological order: node ``v`` is the output of one
forward computation, with ``mem_bytes[v]`` the size of that output and ``cost[v]`` the cost of computing it.
An edge ``(u, v)`` means that the computation of ``v`` reads ``u``. Graph inputs and parameters are not
nodes (Kusumoto et al. 2019 leaves them out of V).

Sets of nodes are passed around as Python ints used as bitsets (bit ``v`` set means node ``v`` is in the
set): unions, differences and subset tests are then single integer operations, which is what makes the
dynamic programmes over lower sets fast. ``bits()`` and ``members()`` convert.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable

import numpy as np


def bits(nodes: Iterable[int]) -> int:
    """The bitset holding ``nodes``."""
    mask = 0
    for v in nodes:
        mask |= 1 << v
    return mask


SMALL = 24  # members of a bitset: a loop over its bits up to here, numpy beyond (on hundreds of nodes)


def members(mask: int) -> list[int]:
    """The nodes of a bitset, ascending."""
    if mask.bit_count() <= SMALL:
        nodes = []
        while mask:
            low = mask & -mask
            nodes.append(low.bit_length() - 1)
            mask ^= low
        return nodes
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def words_of(bitsets, n: int) -> np.ndarray:
    """Bitsets as rows of 64-bit words, the form numpy and the compiled DP kernels take."""
    width = max(1, (n + 63) // 64)
    raw = b"".join(s.to_bytes(8 * width, "little") for s in bitsets)
    return np.frombuffer(raw, dtype="<u8").reshape(-1, width).copy()


def bitset(row: np.ndarray) -> int:
    """A row of words back to a bitset."""
    return int.from_bytes(row.astype("<u8").tobytes(), "little")


def _union(masks: tuple[int, ...], rows: np.ndarray, nodes: int) -> int:
    """The union of the bitsets of ``nodes``, given as ints (``masks``) and as rows of words (``rows``)."""
    if nodes.bit_count() <= SMALL:
        union = 0
        for v in members(nodes):
            union |= masks[v]
        return union
    return bitset(np.bitwise_or.reduce(rows[members(nodes)], axis=0, initial=np.uint64(0)))


@dataclass(frozen=True, slots=True)
class Profile:
    """What a trace measured of a graph's backward pass and its loss; a hand-written graph's defaults are
    Kusumoto et al. 2019's model (every predecessor read, nothing held besides node values, no loss).

    ``backward_reads[v]`` lists the nodes whose forward values the backward of ``v``'s computation reads
    (its saved tensors); by default every predecessor, which is Kusumoto et al.'s model. A traced graph records
    what autograd really saves (a ReLU its output, an addition nothing). ``saved_extra_bytes[v]`` counts
    what that backward keeps besides node values (pooling indices, normalisation statistics), and
    ``param_bytes[v]`` the gradients of the parameters ``v`` is the last in the forward order to read,
    each parameter counted once; ``param_sharers[v]`` the other nodes that read them (a module applied
    several times, a tied embedding): the backward of whichever of them runs first makes those gradients.
    Both default to zero (and no sharers), as in Kusumoto et al. 2019, which leaves parameters out of the model.
    ``loss_bytes`` is what the loss's backward holds at its
    peak, besides the outputs, their gradients and what stays (a language model's log-softmax over
    the vocabulary), measured when the graph was traced with its loss; zero otherwise. ``loss_held_bytes``
    is what stays to the end of the step (the loss's value and the backward's seed).
    ``loss_unpack_bytes`` is what the loss's backward holds beside the outputs when it first unpacks one it
    saved (the loss's value, the seed, and the gradient a mean's backward made before a square's unpacks
    its input): a recomputation of that output's stage runs on top of it.
    ``loss_forward_bytes`` is what the loss's forward holds at its peak besides the outputs (a log-softmax
    over the vocabulary before the loss reduces it). ``loss_grad_bytes[v]`` is what the gradient the loss hands
    output ``v`` adds to the device, which may be far less than the output: a sum hands each output an expanded
    view of its backward's seed, which adds nothing (None, the default: each output's value's size; zero for every
    other node).
    ``loss_reads`` lists the outputs whose values the loss's backward reads (a mean squared error saves its
    input). They stay until the loss's backward is done, and if the plan discards one, that backward
    recomputes its stage (NOTE [the loss] in ``harness/tracing/backward_profile.py``).

    ``grad_shares[v]`` says which predecessors' gradients the backward of ``v`` hands over without a
    buffer of their own, as pairs ``(preds, nbytes)``: ``nbytes == -1``, they are ``v``'s own incoming
    gradient (an addition passes it on, a concatenation passes views of it); ``nbytes >= 0``, they share
    one new buffer of that size (an addition followed by an in-place ReLU). Every other predecessor gets
    a buffer of its own size, as Kusumoto et al. 2019 assumes. A traced graph records what autograd really hands over.
    ``backward_work_bytes[v]`` is the most the backward of ``v``'s layer holds in gradients it passes
    among its own autograd nodes (an in-place ReLU's gradient on its way to the convolution it follows),
    beside the gradient it received and those it hands on; zero on hand-written graphs.
    ``recompute_state_bytes[v]`` is the state ``v``'s layer calls may write (BatchNorm's running statistics),
    of which a recomputed ``v`` keeps a copy, as its forward found it, to the end of its recomputation
    (``harness/execute/side_effects.py``, NOTE [replaying side effects]); zero on hand-written graphs.
    ``backward_peak_bytes[v]`` is the most the backward of ``v``'s layer holds above what was live as it
    began: the gradients it makes less what it frees on the way (its saved extras, as each of its autograd
    nodes finishes, and the gradient it received), forward values aside; measured in a plain step on a
    traced graph, None on hand-written ones (NOTE [a layer's backward peak] in ``strategies/replay_steps.py``).
    ``backward_frees[v]`` is ``(values, peak)``: the nodes whose values the backward of ``v``'s layer freed
    as it ran, in that plain step (a parametrized layer's saved input goes when its convolution's backward
    is done, before the backward of the weight's normalisation), and the most it held above what was live
    as it began with them going as they went; None on hand-written graphs.
    ``forward_transient_bytes[v]`` is the most a call of ``v``'s layer holds, while it runs, above what it
    leaves (a ``Linear`` on a non-contiguous batch of sequences multiplies, then adds its bias into a new
    buffer); measured in the forward of a plain step, None on hand-written graphs.
    ``extras_after_reads[v]``: the layer's calls save all its extras after the last of them that reads
    another node's value, so the values that go at ``v`` go before its extras come (a copy's ``clamp_``
    saves its input after the ``clone`` read the value it copies: NOTE [a write after a read] in
    ``harness/tracing/trace.py``); measured by the trace, None (no such layer) on hand-written graphs.
    ``unpack_held_bytes[v]`` lists, in the order the backward of ``v``'s layer first unpacks them, pairs
    ``(u, bytes)``: the node whose value it unpacks (``u == v``: its own value, or what it saved besides)
    and what it holds then above what was live as it began (a weight-normalised layer's product has made
    its weight's gradient before the normalisation's backward unpacks its norms); a recomputation that
    unpack calls for runs on top of that. Measured in a plain step, None on hand-written graphs.
    ``attribute_bytes[v]`` is what ``v``'s layer call leaves on a module as an attribute (the weight the
    pre-hook ``spectral_norm`` computes): made by its first call and held to the step's end whatever the
    plan, and made again by a recomputation's pre-hook, a moment before its layer runs (NOTE [tensors a module keeps] in
    ``harness/tracing/probe.py``); zero on hand-written graphs. ``attribute_saved[v]``: the layer saves it for its
    backward too, which then calls for ``v``'s recomputation where a plan discards it.
    ``early_grads[v]`` are the predecessors whose gradient ``v``'s in-place members make, before the rest
    of its layer's backward runs (torchvision's ``out += identity`` after a batch norm: the addition hands
    the identity its gradient, then the batch norm's backward runs); empty on hand-written graphs.
    ``unreached`` are the nodes no gradient reaches, whose layers' backward never runs: an auxiliary head
    the loss leaves out, a mask made from the input. They get no gradient and hand none on, their
    parameters get none, and what their layers saved (``backward_reads``, ``saved_extra_bytes``) goes at the
    loss's forward, with the outputs (NOTE [what no gradient reaches] in ``harness/tracing/backward_profile.py``);
    measured when the graph was traced with its loss, empty on hand-written graphs.
    ``preds_without_grad[v]`` are the predecessors the backward of ``v`` hands no gradient, though it runs
    and they take one from elsewhere: a value ``v`` reads through ``.detach()`` (a straight-through
    estimator's ``z + (q - z).detach()``, a stop-gradient), or one it only follows (NOTE [state the forward
    writes] in ``harness/tracing/tracer.py``); measured when the graph was traced with its loss, empty on hand-written
    graphs, where every predecessor takes a gradient of its value's size, as Kusumoto et al. 2019 has it.
    ``param_grads_released``: each parameter gradient goes as soon as the backward that makes it is done, as
    under sharded data parallelism, which reduce-scatters it to its rank's shard and frees it (the shards
    are counted apart: ``harness/execute/sharding.py``); False, the default: they stay to the step's end, for the
    optimizer.
    ``shared_state[v]`` names the state ``v``'s layers use that other nodes use too, and that the forward
    pass uses in the program's order whatever the stages (the random generators, a buffer: a BatchNorm
    called on two views updates its running statistics in order): a node runs after every earlier one
    that uses the same state (``forward_order`` in ``strategies/replay.py``); empty on hand-written graphs.
    """

    backward_reads: tuple[tuple[int, ...], ...]
    saved_extra_bytes: tuple[int, ...]
    param_bytes: tuple[int, ...]
    param_sharers: tuple[tuple[int, ...], ...]
    loss_bytes: int
    loss_held_bytes: int
    loss_unpack_bytes: int
    grad_shares: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    backward_work_bytes: tuple[int, ...]
    recompute_state_bytes: tuple[int, ...]
    backward_peak_bytes: tuple[int, ...] | None
    early_grads: tuple[tuple[int, ...], ...]
    loss_forward_bytes: int
    loss_grad_bytes: tuple[int, ...]
    loss_reads: tuple[int, ...]
    backward_frees: tuple[tuple[tuple[int, ...], int], ...] | None
    forward_transient_bytes: tuple[int, ...] | None
    unpack_held_bytes: tuple[tuple[tuple[int, int], ...], ...] | None
    attribute_bytes: tuple[int, ...]
    attribute_saved: tuple[bool, ...]
    unreached: tuple[int, ...]
    preds_without_grad: tuple[tuple[int, ...], ...]
    shared_state: tuple[tuple[str, ...], ...]
    extras_after_reads: tuple[bool, ...] | None
    param_grads_released: bool
    reached: tuple[bool, ...] = field(init=False, repr=False, compare=False)  # not unreached, per node

    def __post_init__(self):
        unreached = set(self.unreached)
        object.__setattr__(self, "reached", tuple(v not in unreached for v in range(len(self.backward_reads))))


@dataclass(frozen=True, slots=True)
class Graph:
    """A computational graph of values: its topology and each value's size and cost (Checkmate's ``DFGraph``
    holds as much), and ``profile``, what a trace measured of its backward and its loss (``Profile``).

    ``scopes[v]`` is the path of the module that computed ``v`` (``"layer1.0.conv1"``), when the graph was
    traced; strategies that follow a net's own blocks read it. ``flops[v]`` counts the floating-point operations
    of ``v``'s forward computation (traced graphs; hand-written ones default to ``cost``), for strategies that
    need times rather than cost units (``swap``). ``outputs`` are the nodes whose values the model returns
    (None, the default: every sink, as Kusumoto et al. 2019 has it); they stay until the loss has read them.
    The constructor takes the profile's fields as keywords too (``Graph(mem_bytes=..., cost=..., edges=...,
    backward_reads=...)``); the strategies that plan by topology and sizes alone (the DPs' lower sets, Chen
    et al.'s segments) read ``mem_bytes``, ``cost`` and the edges, the replay reads the profile too.
    """

    mem_bytes: tuple[int, ...]
    cost: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    names: tuple[str, ...] | None = None
    kinds: tuple[str, ...] | None = None
    scopes: tuple[str, ...] | None = None
    flops: tuple[float, ...] | None = None
    profile: Profile = field(init=False)  # made by the constructor from its keywords
    outputs: tuple[int, ...] | None = None
    preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    pred_mask: tuple[int, ...] = field(init=False, repr=False, compare=False)
    succ_mask: tuple[int, ...] = field(init=False, repr=False, compare=False)
    ancestor_mask: tuple[int, ...] = field(init=False, repr=False, compare=False)
    pred_words: np.ndarray = field(init=False, repr=False, compare=False)  # pred_mask as rows of words
    succ_words: np.ndarray = field(init=False, repr=False, compare=False)

    def __init__(self, mem_bytes, cost, edges, names=None, kinds=None, scopes=None, flops=None, outputs=None,
                 **profile):
        """``profile``: the ``Profile``'s fields, as ``profile_of`` takes them (each defaults to Kusumoto et al.'s
        model)."""
        n = len(mem_bytes)
        put = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731 (frozen dataclass)
        put("mem_bytes", tuple(int(m) for m in mem_bytes))
        put("cost", tuple(float(c) for c in cost))
        put("edges", tuple(sorted({(int(u), int(v)) for u, v in edges})))
        put("names", tuple(names) if names is not None else tuple(f"v{i}" for i in range(n)))
        put("kinds", tuple(kinds) if kinds is not None else tuple("op" for _ in range(n)))
        _validate(self)
        _put_adjacency(self)
        put("scopes", tuple(str(x) for x in scopes) if scopes is not None else tuple("" for _ in range(n)))
        put("flops", tuple(float(f) for f in flops) if flops is not None else self.cost)
        sinks = [v for v in range(n) if not self.succs[v]]
        put("outputs", tuple(sinks if outputs is None else sorted({int(v) for v in outputs})))
        put("profile", profile_of(self, **profile))
        _validate_backward(self)

    def __len__(self) -> int:
        return len(self.mem_bytes)

    @property
    def all_nodes(self) -> int:
        """The bitset of V."""
        return (1 << len(self)) - 1

    def is_lower_set(self, nodes: int | Iterable[int]) -> bool:
        """True when no edge enters ``nodes`` from outside (closed under predecessors)."""
        mask = nodes if isinstance(nodes, int) else bits(nodes)
        return self.in_neighbours(mask) & ~mask == 0

    def boundary(self, lower: int) -> int:
        """``∂(L)``: the nodes of ``lower`` with an edge leaving it (those feeding a node just outside)."""
        return lower & self.in_neighbours(self.out_neighbours(lower) & ~lower)

    def out_neighbours(self, nodes: int) -> int:
        """``δ⁺(S)``: the nodes some node of ``nodes`` feeds."""
        return _union(self.succ_mask, self.succ_words, nodes)

    def in_neighbours(self, nodes: int) -> int:
        """``δ⁻(S)``: the nodes that feed some node of ``nodes``."""
        return _union(self.pred_mask, self.pred_words, nodes)

    def frontiers(self, stages: Iterable[int]):
        """Per stage ``V_i`` of a chain, ``(L_i, δ⁺(L_i) \\ L_i)``, stage by stage (a stage is a few nodes,
        where ``L_i`` can be hundreds)."""
        lower, fed = 0, 0
        for stage in stages:
            lower |= stage
            fed |= self.out_neighbours(stage)
            yield lower, fed & ~lower

    def reaches(self, u: int, v: int) -> bool:
        """True when there is a path ``u -> ... -> v`` (or ``u == v``)."""
        return bool(self.ancestor_mask[v] >> u & 1)

    def read_by_backward(self) -> set[int]:
        """The nodes whose values a backward that runs reads (the loss's aside; ``unreached``)."""
        return {u for v, reads in enumerate(self.profile.backward_reads) if self.profile.reached[v] for u in reads}

    def replace(self, **changes) -> Graph:
        """A copy with some fields changed (the constructor's arguments, the profile's among them)."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        given.update((f.name, getattr(self.profile, f.name)) for f in fields(self.profile) if f.init)
        return Graph(**{**given, **changes})

    def saves_more(self, v: int) -> bool:
        """``v``'s layer saves for its backward a tensor that is no node's value (an extra, or what its module
        keeps), so a plan that discards ``v`` recomputes it for that backward."""
        return bool(self.profile.saved_extra_bytes[v] or self.profile.attribute_saved[v])

    def mem(self, nodes: int) -> int:
        return sum(map(self.mem_bytes.__getitem__, members(nodes)))

    def time(self, nodes: int) -> float:
        return sum(map(self.cost.__getitem__, members(nodes)))

    def never_recomputed(self) -> int:
        """The values no recomputation makes, whatever the plan: those no gradient reaches (an auxiliary
        head's) that no value a gradient reaches is made from (NOTE [what a recomputation makes] in
        ``strategies/replay.py``)."""
        reached = sum(1 << v for v in range(len(self)) if self.profile.reached[v])
        return self.all_nodes & ~self.with_inputs_within(reached, self.all_nodes)

    def with_inputs_within(self, nodes: int, within: int) -> int:
        """``nodes`` and the nodes of ``within`` they read, directly or through other nodes of ``within``:
        what a recomputation of ``within`` runs to make ``nodes`` (NOTE [what a recomputation makes] in
        ``strategies/replay.py``)."""
        for v in reversed(members(within)):  # a node's inputs come before it
            if nodes >> v & 1:
                nodes |= self.pred_mask[v] & within
        return nodes


def profile_of(graph: Graph, backward_reads=None, saved_extra_bytes=None, param_bytes=None, param_sharers=None,
               loss_bytes=0, loss_held_bytes=0, loss_unpack_bytes=0, grad_shares=None, backward_work_bytes=None,
               recompute_state_bytes=None, backward_peak_bytes=None, early_grads=None, loss_forward_bytes=0,
               loss_grad_bytes=None, loss_reads=(), backward_frees=None, forward_transient_bytes=None,
               unpack_held_bytes=None, attribute_bytes=None, attribute_saved=None, unreached=(),
               preds_without_grad=None, shared_state=None, extras_after_reads=None,
               param_grads_released=False) -> Profile:
    """``graph``'s profile from these fields, each None (or zero, or empty) as Kusumoto et al.'s model has it."""
    n = len(graph)

    def per_node(values, default, convert):
        return tuple(convert(x) for x in (values if values is not None else [default] * n))

    def sorted_nodes(nodes):
        return tuple(sorted({int(u) for u in nodes}))

    if min(loss_bytes, loss_held_bytes, loss_forward_bytes, loss_unpack_bytes) < 0:
        raise ValueError(f"Graph: loss_bytes, loss_held_bytes, loss_forward_bytes and loss_unpack_bytes must "
                         f"not be negative, got {loss_bytes}, {loss_held_bytes}, {loss_forward_bytes} and "
                         f"{loss_unpack_bytes}")
    if shared_state is not None and len(shared_state) != n:
        raise ValueError("Graph: shared_state needs one entry per node")
    if loss_grad_bytes is None:
        loss_grad_bytes = [graph.mem_bytes[v] if v in graph.outputs else 0 for v in range(n)]
    attribute_bytes = per_node(attribute_bytes, 0, int)
    return Profile(
        backward_reads=tuple(tuple(sorted(set(r))) for r in (backward_reads if backward_reads is not None
                                                              else graph.preds)),
        saved_extra_bytes=per_node(saved_extra_bytes, 0, int), param_bytes=per_node(param_bytes, 0, int),
        param_sharers=per_node(param_sharers, (), sorted_nodes),
        loss_bytes=int(loss_bytes), loss_held_bytes=int(loss_held_bytes), loss_unpack_bytes=int(loss_unpack_bytes),
        grad_shares=per_node(grad_shares, (), lambda shares: tuple(
            (tuple(sorted(int(u) for u in preds)), int(size)) for preds, size in shares)),
        backward_work_bytes=per_node(backward_work_bytes, 0, int),
        recompute_state_bytes=per_node(recompute_state_bytes, 0, int),
        backward_peak_bytes=None if backward_peak_bytes is None else tuple(int(b) for b in backward_peak_bytes),
        early_grads=per_node(early_grads, (), lambda preds: tuple(sorted(int(u) for u in preds))),
        loss_forward_bytes=int(loss_forward_bytes), loss_grad_bytes=tuple(int(b) for b in loss_grad_bytes),
        loss_reads=sorted_nodes(loss_reads),
        backward_frees=None if backward_frees is None else tuple(
            (tuple(sorted(int(u) for u in freed)), int(peak)) for freed, peak in backward_frees),
        forward_transient_bytes=None if forward_transient_bytes is None else tuple(
            int(b) for b in forward_transient_bytes),
        unpack_held_bytes=None if unpack_held_bytes is None else tuple(
            tuple((int(u), int(b)) for u, b in firsts) for firsts in unpack_held_bytes),
        attribute_bytes=attribute_bytes,
        attribute_saved=tuple(bool(b) for b in (attribute_saved if attribute_saved is not None
                                                else [b > 0 for b in attribute_bytes])),
        unreached=sorted_nodes(unreached),
        preds_without_grad=per_node(preds_without_grad, (), sorted_nodes),
        shared_state=per_node(shared_state, (), lambda names: tuple(sorted({str(name) for name in names}))),
        extras_after_reads=None if extras_after_reads is None else tuple(bool(b) for b in extras_after_reads),
        param_grads_released=bool(param_grads_released))


def _put_adjacency(graph: Graph) -> None:
    """The fields a ``Graph`` derives from its edges: each node's predecessors and successors, as tuples, bitsets
    and rows of words, and its ancestors."""
    n = len(graph)
    put = lambda key, value: object.__setattr__(graph, key, value)  # noqa: E731 (frozen dataclass)
    preds = [[] for _ in range(n)]
    succs = [[] for _ in range(n)]
    for u, v in graph.edges:
        preds[v].append(u)
        succs[u].append(v)
    put("preds", tuple(tuple(p) for p in preds))
    put("succs", tuple(tuple(s) for s in succs))
    put("pred_mask", tuple(bits(p) for p in preds))
    put("succ_mask", tuple(bits(s) for s in succs))
    put("pred_words", words_of(graph.pred_mask, n))
    put("succ_words", words_of(graph.succ_mask, n))
    ancestors = []
    for v in range(n):  # topological order: every predecessor's ancestors are known already
        mask = 1 << v
        for u in preds[v]:
            mask |= ancestors[u]
        ancestors.append(mask)
    put("ancestor_mask", tuple(ancestors))


def _validate(graph: Graph) -> None:
    n = len(graph.mem_bytes)
    if len(graph.cost) != n or len(graph.names) != n or len(graph.kinds) != n:
        raise ValueError(f"Graph: mem_bytes has {n} entries but cost has {len(graph.cost)}, names "
                         f"{len(graph.names)} and kinds {len(graph.kinds)}; give one per node")
    for v in range(n):
        if graph.mem_bytes[v] < 0:
            raise ValueError(f"Graph: node {v} ({graph.names[v]}) has negative mem_bytes {graph.mem_bytes[v]}")
        if graph.cost[v] < 0:
            raise ValueError(f"Graph: node {v} ({graph.names[v]}) has negative cost {graph.cost[v]}")
    for u, v in graph.edges:
        for end in (u, v):
            if not 0 <= end < n:
                raise ValueError(f"Graph: edge ({u}, {v}) names node {end}, outside 0..{n - 1}")
    cycle_node = _node_on_cycle(n, graph.edges)
    if cycle_node is not None:
        raise ValueError(f"Graph: the edges form a cycle through node {cycle_node} "
                         f"({graph.names[cycle_node]}); a computational graph must be acyclic")
    for u, v in graph.edges:
        if u >= v:
            raise ValueError(f"Graph: edge ({u}, {v}) goes from node {u} to the earlier node {v}; number the "
                             "nodes in a topological order (every edge from a lower id to a higher one)")


def _validate_backward(graph: Graph) -> None:
    n = len(graph)
    profile = graph.profile
    if (len(profile.backward_reads) != n or len(profile.saved_extra_bytes) != n or len(profile.param_bytes) != n
            or len(profile.param_sharers) != n or len(graph.scopes) != n or len(graph.flops) != n):
        raise ValueError("Graph: backward_reads, saved_extra_bytes, param_bytes, param_sharers, scopes and flops "
                         "need one entry per node")
    for v, sharers in enumerate(graph.profile.param_sharers):
        if sharers and not graph.profile.param_bytes[v]:
            raise ValueError(f"Graph: node {v} ({graph.names[v]}) has param_sharers {list(sharers)} but no "
                             "param_bytes; sharers read the parameters whose gradients param_bytes counts")
        if any(not 0 <= u < n or u == v for u in sharers):
            raise ValueError(f"Graph: param_sharers of node {v} ({graph.names[v]}) must be other nodes, got "
                             f"{list(sharers)}")
    if (len(profile.grad_shares) != n or len(profile.backward_work_bytes) != n
            or len(profile.recompute_state_bytes) != n or len(profile.attribute_bytes) != n
            or len(profile.attribute_saved) != n):
        raise ValueError("Graph: grad_shares, backward_work_bytes, recompute_state_bytes, attribute_bytes and "
                         "attribute_saved need one entry per node")
    if not all(0 <= v < n for v in graph.profile.unreached):
        raise ValueError(f"Graph: unreached {graph.profile.unreached} must be nodes 0..{n - 1}")
    for v in graph.profile.unreached:
        if graph.profile.param_bytes[v] or any(v in sharers for sharers in graph.profile.param_sharers):
            raise ValueError(f"Graph: node {v} ({graph.names[v]}) is unreached but counts parameter gradients; "
                             "only a backward that runs makes them")
    if graph.profile.backward_peak_bytes is not None and len(graph.profile.backward_peak_bytes) != n:
        raise ValueError("Graph: backward_peak_bytes needs one entry per node (or None: not measured)")
    if graph.profile.backward_frees is not None and len(graph.profile.backward_frees) != n:
        raise ValueError("Graph: backward_frees needs one entry per node (or None: not measured)")
    if graph.profile.forward_transient_bytes is not None and len(graph.profile.forward_transient_bytes) != n:
        raise ValueError("Graph: forward_transient_bytes needs one entry per node (or None: not measured)")
    if graph.profile.unpack_held_bytes is not None and len(graph.profile.unpack_held_bytes) != n:
        raise ValueError("Graph: unpack_held_bytes needs one entry per node (or None: not measured)")
    for v, shares in enumerate(graph.profile.grad_shares):
        shared = [u for preds, _ in shares for u in preds]
        if len(set(shared)) != len(shared) or not set(shared) <= set(graph.preds[v]):
            raise ValueError(f"Graph: grad_shares[{v}] must name predecessors of node {v} ({graph.names[v]}), "
                             f"each at most once; got {shares}")
    if not all(0 <= v < n for v in graph.outputs):
        raise ValueError(f"Graph: outputs {graph.outputs} must be nodes 0..{n - 1}")
    if len(graph.profile.loss_grad_bytes) != n or min(graph.profile.loss_grad_bytes, default=0) < 0:
        raise ValueError("Graph: loss_grad_bytes needs one entry per node, none negative")
    if not set(graph.profile.loss_reads) <= set(graph.outputs):
        raise ValueError(f"Graph: loss_reads {graph.profile.loss_reads} must name outputs of the model {graph.outputs}")
    for field_name in ("early_grads", "preds_without_grad"):
        listed = getattr(graph.profile, field_name)
        if len(listed) != n or any(not set(e) <= set(graph.preds[v]) for v, e in enumerate(listed)):
            raise ValueError(f"Graph: {field_name} needs one entry per node, each naming predecessors of the node")
    for v, reads in enumerate(graph.profile.backward_reads):
        for u in reads:
            if u != v and u not in graph.preds[v]:
                raise ValueError(f"Graph: the backward of node {v} ({graph.names[v]}) reads node {u}, which "
                                 "is neither the node itself nor one of its predecessors")


def _node_on_cycle(n: int, edges: Iterable[tuple[int, int]]) -> int | None:
    """A node on some cycle, or None (Kahn's algorithm: whatever is never freed lies on or after a cycle)."""
    indegree = [0] * n
    succs = [[] for _ in range(n)]
    for u, v in edges:
        indegree[v] += 1
        succs[u].append(v)
    ready = [v for v in range(n) if indegree[v] == 0]
    while ready:
        u = ready.pop()
        for v in succs[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    stuck = [v for v in range(n) if indegree[v] > 0]
    if not stuck:
        return None
    # Walk backwards along stuck predecessors until a node repeats: that node lies on a cycle.
    stuck_set = set(stuck)
    preds = {v: [u for u, w in edges if w == v and u in stuck_set] for v in stuck}
    seen, v = set(), stuck[0]
    while v not in seen:
        seen.add(v)
        v = preds[v][0]
    return v
