"""The CP-SAT model behind ``optimal``: a relaxation of the replay over every plan the executor runs (NOTE [a
proven optimum in the replay's accounting]), and the solver every search of it uses.

NOTE [a proven optimum in the replay's accounting]
The space is the executor's: a chain of lower sets (node ``v`` in stage ``s_v``, ``s_u <= s_v`` along each edge)
and a kept set (``k_v``; a value read by a later stage is kept). The memory is the replay's (``simulate``), the
one every budget in this project means. The replay is a program, not a formula, so the model holds a
relaxation of it, quantities the replay never comes in under:
- cost: a discarded value that a backward which runs reads (the loss's too), or whose layer saved an extra,
  is recomputed, and so is each discarded value it is made from (they share its stage);
- memory, at moments every plan's step passes through, besides the loss's value and seed:
  - as the backward begins: every kept value a backward reads, what the loss's backward reads, every kept
    layer's extras, and the loss's gradients and working buffers (GPT-2's logits' gradient); and, where the
    loss's backward reads no discarded value (so no stage is recomputed yet), every kept value that a value to
    be recomputed is made from (GPT-2's attention projections, their q, k and v discarded);
  - before each layer's backward, whatever the stages: what its backward reads and its layer's extras, kept or
    recomputed, the kept values an ancestor's backward still reads, those layers' kept extras, the parameter
    gradients its descendants' backwards made (held to the step's end), and the gradients they made, in
    buffers of their own, for it and its ancestors;
  - as that backward runs, the same and what the layer holds on top of it (``replay.backward_holds``): where
    its in-place members' backward comes first (a ReLU's, after its convolution), their working gradients,
    before the layer's recomputation, so with only what it keeps of the rest it reads; then, as it makes its
    gradients, the least peak the replay may bring it to, less its own value where those members read it last
    (without this moment U-Net at 75% of the way to vanilla was bounded at 1 cost unit, its optimum 2);
  - as stage ``i``'s backward begins: the kept values a backward of stage ``i`` or earlier reads, or that the
    recomputation of such a stage reads (as at the turn), the kept extras of those stages, the parameter
    gradients of later stages, and the gradients later stages' backwards made, in buffers of their own, for
    values of stage ``i`` or earlier (U-Net's skip connections);
  - once stage ``i``'s recomputation is done (all at once, by the first backward that needs one: NOTE [what a
    recomputation makes] in ``replay.py``): the stage's discarded values a backward reads, the kept values a
    backward of an earlier stage reads or one of this stage's still to come, or an earlier stage's
    recomputation reads, the extras still wanted, the parameter gradients of later stages and of the stage's
    layers whose backward came first, and the gradients those backwards made, in buffers of their own, for
    values whose backward has not ended (where each stage runs in node order: no state is shared between
    layers, ``replay.forward_order``).
No plan costs less than the relaxed cost of the cheapest plan whose relaxed memory fits, so that cost is a lower
bound. Each plan the solver proposes is then replayed and cut off (its exact stages and kept set; stages are
numbered 0, 1, ... without a gap and a value nothing reads is kept, so a plan has one assignment); one that fits
and costs less becomes the best plan, and the search goes on for a cheaper one. It ends proven
(``optimal_status=optimal``, gap 0) when no plan the model still holds is cheaper than the best; at the time limit
it returns the best plan, the least cost the solver proved no plan beats (``lower_bound``) and the gap. The search
starts from the better of ``approx_dp``'s and ``exact_dp``'s plans at the budget (``exact_dp`` given a quarter of
the time), so it is never worse than those it found. Stages are numbered up to ``n - 1`` (a plan has at most one
per node): a bound over fewer stages would not bound every plan. Tests hold the relaxation below the replay on the
zoo nets' plans, and the optimum equal to brute force over every plan of small graphs.

NOTE [a recomputation's inputs, where the replay peaks]
The moments at a layer's backward count a discarded value only where that backward reads it. But a value ``d``
that an ancestor's backward reads, discarded, is at that moment either recomputed already (held until that
backward) or not yet, and then the kept values its recomputation reads are held for it: one or the other is
live, whatever the stages. Written for every layer and every such value, that is a disjunction per pair, too
many for the nets of hundreds of nodes; so it is added lazily, where it is wanted: for the layer in whose
backward a plan the search tried peaks over the budget, every such value gets one at each of that layer's
moments. Valid for every plan, such a cut may take a kept set out of the model without stages with no stage
searched (U-Net, whose concatenations are discarded and whose upsamplings, which nothing else reads, are held for
them). In the model with stages the same layer also gets, for each stage ``i`` it may be in, a moment with its
stage's discarded values that an ancestor's backward reads, where a later layer of that stage, whose backward
runs first, recomputed them (they are live: U-Net at its least budget, where without it the plans proposed went
20% over).
"""

from __future__ import annotations

import math
import time

from strategies.graph import Graph, bits
from strategies.graph import members as members_of
from strategies.plan import Plan
from strategies.replay import backward_holds, peak_layer, timeline
from strategies.simulate import simulate


class _Relaxation:
    """The CP-SAT model of NOTE [a proven optimum in the replay's accounting]; ``cut`` removes one plan."""

    def __init__(self, cp_model, graph: Graph, budget_bytes: int, stages: bool = True, holding=(),
                 deadline: float = math.inf, least_memory: bool = False):
        # least_memory: the budget is a variable, the peak, at most ``budget_bytes`` and minimised (NOTE [the least
        # memory]); ``budget_bytes`` is then what a proposed plan's replay must stay within, lowered by ``under``
        self.cp_model, self.graph, self.budget_bytes = cp_model, graph, budget_bytes
        self.least_memory, self.deadline = least_memory, deadline
        self.K = len(graph) if stages else 1
        self.model = cp_model.CpModel()
        self._stage_order()
        self._recomputations(least_memory, budget_bytes)
        self._backward_calls()
        self._as_the_backward_begins()
        self.bound = 0.0
        self.earlier = {}  # kept value -> it is kept and a backward of an earlier stage reads it
        for i in range(self.K if stages else 0):
            self._stage(i)
        for v in holding:
            self._on_time()
            self.hold_for_recomputation(v)

    def _on_time(self) -> None:
        """The build looks at the clock as it goes (the model with stages has n clauses an edge)."""
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def _stage_order(self) -> None:
        """Each node's stage and whether its value is kept, and the clauses that make the stages a chain of lower
        sets with no gap."""
        graph, K, model, clause = self.graph, self.K, self.model, self._clause
        n = len(graph)
        # ge[v][i]: s_v >= i, the order encoding of each node's stage (ge[v][0] is True, ge[v][K] False). Every
        # stage before v's holds a node that is neither v nor one of its descendants (those are in v's stage or
        # later), so s_v is at most the count of those: above it ge[v][i] is False, and the clauses it is in are
        # settled as they are written (a chain's node i may be in stages 0 to i, not n of them: on ResNet-152 and
        # DenseNet-161, 28-31% fewer constraints).
        self.below = below = [0] * n  # each node's descendants, itself left out
        for x in range(n):
            for v in members_of(graph.ancestor_mask[x] & ~(1 << x)):
                below[v] |= 1 << x
        top = [min(K - 1, n - 1 - below[v].bit_count()) for v in range(n)]
        self.ge = ge = [[True] + [model.new_bool_var("") for _ in range(top[v])] + [False] * (K - top[v])
                        for v in range(n)]
        self.kept = kept = [model.new_bool_var("") for _ in range(n)]
        for v in range(n):
            if v % 64 == 0:
                self._on_time()
            for i in range(2, K):
                clause([_not(ge[v][i]), ge[v][i - 1]])
        for e, (u, v) in enumerate(graph.edges):
            if e % 16 == 0:
                self._on_time()
            for i in range(1, K):
                clause([_not(ge[u][i]), ge[v][i]])  # s_u <= s_v
                clause([_not(ge[v][i]), ge[u][i], kept[u]])  # s_v > s_u only if u is kept
        # No gap between stages: where a node is at stage i or later, some node is at stage i - 1.
        for i in range(1, K):
            if i % 16 == 0:
                self._on_time()
            later = model.new_bool_var("")
            for v in range(n):
                clause([_not(ge[v][i]), later])
            model.Add(sum(ge[v][i - 1] - ge[v][i] for v in range(n)) >= 1).OnlyEnforceIf(later)

    def _recomputations(self, least_memory: bool, budget_bytes: int) -> None:
        """Which values are recomputed, what that costs, and the objective: that cost, or the peak."""
        graph, model, clause, kept = self.graph, self.model, self._clause, self.kept
        n = len(graph)
        self.readers = readers = [[] for _ in range(n)]  # the backwards that run and read each value
        for w in range(n):
            if graph.profile.reached[w]:
                for u in graph.profile.backward_reads[w]:
                    readers[u].append(w)
        self.read = [u for u in range(n) if (readers[u] or u in graph.profile.loss_reads) and graph.mem_bytes[u]]
        wanted = set(self.read) | {u for u in range(n) if graph.profile.reached[u] and graph.saves_more(u)}
        self.recomputed = recomputed = [model.new_bool_var("") for _ in range(n)]
        for u in wanted:
            clause([recomputed[u], kept[u]])
        for p, u in graph.edges:
            clause([recomputed[p], _not(recomputed[u]), kept[p]])  # made from a discarded input
        cost_scale = _cost_scale(graph.cost)
        self.cost = sum(math.floor(c * cost_scale) * r for c, r in zip(graph.cost, recomputed) if c)
        if least_memory:
            self.budget = self.objective = model.new_int_var(0, budget_bytes, "peak")
            self.scale = 1.0
        else:
            self.budget, self.objective, self.scale = budget_bytes, self.cost, cost_scale
        model.Minimize(self.objective)

    def _backward_calls(self) -> None:
        """Which backwards recompute their stage, what each holds, and each layer's moments (``_moments``)."""
        graph, model, clause, kept = self.graph, self.model, self._clause, self.kept
        n = len(graph)
        profile = graph.profile
        self.params = [(v, profile.param_bytes[v]) for v in range(n)  # released ones count for nothing (``_moments``)
                       if profile.reached[v] and profile.param_bytes[v] and not profile.param_grads_released]
        self.extras = [u for u in range(n) if graph.profile.reached[u] and graph.profile.saved_extra_bytes[u]]
        # calls[w]: w's backward recomputes its stage (it reads a discarded value, or its layer's extras are).
        users = [name for names in graph.profile.shared_state for name in names]
        self.in_order = len(users) == len(set(users))  # each stage runs in node order (replay.forward_order)
        self.calls = calls = [model.new_bool_var("") for _ in range(n)]
        for w in range(n):
            reads = list(graph.profile.backward_reads[w]) if graph.profile.reached[w] else []
            if graph.profile.reached[w] and graph.saves_more(w):
                reads.append(w)
            for u in reads:
                clause([calls[w], kept[u]])
            clause([_not(calls[w])] + [_not(kept[u]) for u in reads])  # and only then
        for u in members_of(nothing_reads(graph)):
            model.Add(kept[u] == 1)  # kept or not, the same step
        self.own_gradient = own_gradient = [
            {u: graph.profile.reached[u] and u not in graph.profile.preds_without_grad[x]
             and not any(u in shared for shared, _ in graph.profile.grad_shares[x]) for u in graph.preds[x]}
            for x in range(n)]
        # per value, the layers whose backward gives it a gradient buffer of its own; per node, the later layers
        # whose backward runs and reaches it (its reached descendants): bitsets, for ``_moments``
        self.givers = [0] * n
        for x in range(n):
            for u, own in own_gradient[x].items():
                if own:
                    self.givers[u] |= 1 << x
        reached = sum(1 << x for x in range(n) if graph.profile.reached[x])
        self.ran = [mask & reached for mask in self.below]
        self.holding: set[int] = set()  # layers whose moments also count what a recomputation will read
        self.to_come: dict[int, list] = {}  # stage -> its ``to_come`` literals (``_stage``), in the model with stages
        for v in range(n):
            if graph.profile.reached[v]:
                if v % 64 == 0:
                    self._on_time()
                for moment in self._moments(v)[0]:
                    self._at_most(moment)

    def _as_the_backward_begins(self) -> None:
        """What is held as the backward begins: every kept value a backward reads, what the loss's backward reads
        (recomputed first where discarded), every kept layer's extras, and the loss's gradients and working
        buffers."""
        graph, model, clause, kept = self.graph, self.model, self._clause, self.kept
        size, extra = graph.mem_bytes, graph.profile.saved_extra_bytes
        turn = [size[u] if u in graph.profile.loss_reads else size[u] * kept[u] for u in self.read]
        turn += [extra[u] * kept[u] for u in self.extras]
        # Where the loss's backward reads no discarded value, no stage is recomputed yet: a kept value that no
        # backward reads is held for the recomputation that reads it (GPT-2's attention inputs, their q, k, v
        # discarded).
        self.loss_discards = [_not(kept[u]) for u in graph.profile.loss_reads]
        # each may be held for a recomputation
        self.waiting = [u for u in range(len(graph)) if size[u] and graph.succs[u]]
        for u in set(self.waiting) - set(self.read):
            waits = model.new_bool_var("")
            for s in graph.succs[u]:
                clause([waits, _not(kept[u]), _not(self.recomputed[s])] + self.loss_discards)
            turn.append(size[u] * waits)
        profile = graph.profile
        made = sum(profile.loss_grad_bytes[v] for v in graph.outputs if profile.reached[v]) + profile.loss_bytes
        self._at_most(sum(turn) + made + graph.profile.loss_held_bytes)
        self.value_grads = [(u, x) for x in range(len(graph)) if graph.profile.reached[x]
                            for u, own in self.own_gradient[x].items() if own and size[u]]

    def _stage(self, i: int) -> None:
        """The moments of stage ``i``'s backward: as its recomputation ends, and as its last backward is done."""
        graph, model, clause, kept, ge = self.graph, self.model, self._clause, self.kept, self.ge
        n, size = len(graph), graph.mem_bytes
        extra, held = graph.profile.saved_extra_bytes, graph.profile.loss_held_bytes
        readers, in_order, calls = self.readers, self.in_order, self.calls
        self._on_time()
        grads = sum(p * ge[v][i + 1] for v, p in self.params)  # parameter gradients of later stages
        # to_come[w]: a node of stage i from w on recomputes the stage, so the backward of a node of stage i
        # before w comes after that recomputation.
        to_come = [False] * (n + 1)
        for w in reversed(range(n)) if in_order else ():
            to_come[w], here = model.new_bool_var(""), model.new_bool_var("")
            clause([to_come[w], _not(to_come[w + 1])])
            clause([to_come[w], _not(ge[w][i]), ge[w][i + 1], _not(calls[w])])
            clause([_not(to_come[w]), to_come[w + 1], here])  # and only then
            for literal in (ge[w][i], _not(ge[w][i + 1]), calls[w]):
                clause([_not(here), literal])
        made = []  # the stage's discarded values a backward reads
        for u in self.read:
            d = model.new_bool_var("")
            clause([d, kept[u], _not(ge[u][i]), ge[u][i + 1]])
            made.append(size[u] * d)
        # kept values a backward of an earlier stage, or of this one still to come, reads, or that an earlier
        # stage's recomputation will read
        held_kept = {}
        for u in self.read:
            if not readers[u]:
                continue
            held_kept[u] = d = model.new_bool_var("")
            for w in readers[u] if in_order else ():
                clause([d, _not(kept[u]), _not(ge[w][i]), ge[w][i + 1], _not(to_come[w + 1])])
        for u in self.waiting if i else ():
            d = self._literal(held_kept, u)
            for s in graph.succs[u]:
                clause([d, _not(kept[u]), _not(self.recomputed[s]), ge[s][i]] + self.loss_discards)
        for u, d in held_kept.items():
            if u in self.earlier:
                clause([d, _not(self.earlier[u])])
        wanted_extras = []  # extras of kept layers of earlier stages, and of this one's still to come
        for u in self.extras:
            d = model.new_bool_var("")
            clause([d, _not(kept[u]), ge[u][i]])
            if in_order:
                clause([d, _not(ge[u][i]), ge[u][i + 1], _not(to_come[u + 1])])
            wanted_extras.append(extra[u] * d)
        done = []  # parameter gradients of the stage's layers whose backward came before its recomputation
        for v, p in self.params if in_order else ():
            d = model.new_bool_var("")
            clause([d, _not(ge[v][i]), ge[v][i + 1], to_come[v]])
            done.append(p * d)
        to_receive, to_receive_first = self._gradients_to_receive(i, to_come)
        self._at_most(sum(made) + sum(size[u] * d for u, d in held_kept.items()) + sum(wanted_extras) + sum(done)
                      + grads + held + sum(size[u] * g for u, g in to_receive.items()))
        # kept values a backward of stage i or earlier reads, or their recomputations, and kept extras
        now, kept_extras = {}, []
        for u in self.read:
            if readers[u]:
                now[u] = y = model.new_bool_var("")
                for w in readers[u]:
                    clause([y, _not(kept[u]), ge[w][i + 1]])
        for u in self.waiting:
            y = self._literal(now, u)
            for s in graph.succs[u]:
                clause([y, _not(kept[u]), _not(self.recomputed[s]), ge[s][i + 1]] + self.loss_discards)
        for u in self.extras:
            d = model.new_bool_var("")
            clause([d, _not(kept[u]), ge[u][i + 1]])
            kept_extras.append(extra[u] * d)
        self._at_most(sum(size[u] * y for u, y in now.items()) + sum(kept_extras) + grads + held
                      + sum(size[u] * g for u, g in to_receive_first.items()))
        self.earlier = now
        if in_order:
            self.to_come[i] = to_come

    def _gradients_to_receive(self, i: int, to_come: list) -> tuple[dict, dict]:
        """Gradients that the backwards run so far made, in buffers of their own, for values whose backward has
        not ended (U-Net's skip connections; the stage's own, from the backwards before its recomputation): as
        stage ``i``'s recomputation ends, and as the stage begins."""
        clause, ge = self._clause, self.ge
        to_receive, to_receive_first = {}, {}
        for u, x in self.value_grads:
            g = self._literal(to_receive, u)
            clause([g, ge[u][i], _not(ge[x][i + 1])])
            if self.in_order:
                in_stage, x_in_stage_before = [_not(ge[u][i]), ge[u][i + 1], _not(to_come[u])], \
                    [_not(ge[x][i]), ge[x][i + 1], to_come[x]]
                clause([g] + in_stage + [_not(ge[x][i + 1])])
                clause([g, ge[u][i]] + x_in_stage_before)
                clause([g] + in_stage + x_in_stage_before)
            g = self._literal(to_receive_first, u)
            clause([g, ge[u][i + 1], _not(ge[x][i + 1])])
        return to_receive, to_receive_first

    def _moments(self, v: int) -> tuple[list, set[int]]:
        """The memory at v's backward, whatever the stages, as linear expressions, and the values they count.

        Before it: what its backward reads, kept or recomputed, the kept values a backward of an ancestor still
        reads, the kept extras of those layers, the parameter gradients its descendants made (held to the step's
        end), and the gradients they made, in buffers of their own, for v and its ancestors (a buffer handed on as
        another value's gradient is counted once). And on top, what the layer's backward holds as it runs: where
        its in-place members run theirs first, their working gradients, before the layer's recomputation (what it
        reads is there only if kept, its own value aside); then, as it makes its gradients, its measured peak,
        v's value gone if they read it last."""
        graph, kept, readers = self.graph, self.kept, self.readers
        size, extra, held = graph.mem_bytes, graph.profile.saved_extra_bytes, graph.profile.loss_held_bytes
        before = graph.ancestor_mask[v]  # v and its ancestors
        values = {u: size[u] if v in readers[u] else size[u] * kept[u]
                  for u in self.read if any(before >> w & 1 for w in readers[u])}
        counted = set(values)
        live = [extra[u] if u == v else extra[u] * kept[u] for u in self.extras if before >> u & 1]
        ran = self.ran[v]
        # parameter gradients released as their backward ends (``Profile.param_grads_released``) count for nothing:
        # the relaxation stays below the replay
        made = 0 if graph.profile.param_grads_released else sum(graph.profile.param_bytes[x] for x in members_of(ran))
        made += sum(size[u] for u in members_of(before) if self.givers[u] & ran)
        moments = [sum(values.values()) + sum(live) + made + held]
        during, members_first = backward_holds(graph, v)
        if members_first is not None:
            early = [size[u] if u == v else size[u] * kept[u] for u in values]
            early += [extra[u] * kept[u] for u in self.extras if before >> u & 1]
            moments.append(sum(early) + made + held + members_first)
            values.pop(v, None)
        if during:
            moments.append(sum(values.values()) + sum(live) + made + held + during)
        return moments, counted

    def hold_for_recomputation(self, v: int) -> bool:
        """Count at v's backward, besides ``_moments``, what the recomputation of a value an ancestor's backward
        reads needs (NOTE [a recomputation's inputs, where the replay peaks]); False where v's moments already do,
        or there is nothing to count."""
        if v in self.holding:
            return False
        self.holding.add(v)
        graph, kept, model, budget, ge = self.graph, self.kept, self.model, self.budget, self.ge
        size, before = graph.mem_bytes, graph.ancestor_mask[v]
        moments, counted = self._moments(v)
        added = False
        for d in self.read:
            if v in self.readers[d] or not any(w != v and before >> w & 1 for w in self.readers[d]):
                continue
            inputs = [u for u in graph.preds[d] if u not in counted and size[u]]
            if not inputs:
                continue
            sources = sum(size[u] * kept[u] for u in inputs)
            for moment in moments:  # d recomputed already, or its kept inputs still held for it
                recomputed = model.new_bool_var("")
                model.Add(moment + size[d] - size[d] * kept[d] <= budget).OnlyEnforceIf(recomputed)
                model.Add(moment + sources <= budget).OnlyEnforceIf(recomputed.Not())
            added = True
        for i, to_come in self.to_come.items():  # the model with stages: what v's stage recomputed before it
            ancestors_read = [d for d in counted if v not in self.readers[d] and d != v]
            when = [x for x in (ge[v][i], _not(ge[v][i + 1]), to_come[v + 1]) if x is not True]
            if not ancestors_read or any(x is False for x in when):
                continue
            made = 0  # those of them discarded in stage i: recomputed before v's backward
            for d in ancestors_read:
                z = model.new_bool_var("")
                self._clause([z, kept[d], _not(ge[d][i]), ge[d][i + 1]])
                made += size[d] * z
            for moment in moments:
                model.Add(moment + made <= budget).OnlyEnforceIf(when)
            added = True
        return added

    def _literal(self, literals: dict, key):
        """``literals[key]``, a new Boolean variable where there is none yet."""
        if key not in literals:
            literals[key] = self.model.new_bool_var("")
        return literals[key]

    def _clause(self, literals) -> None:
        """At least one of ``literals`` (CP-SAT literals, or Python bools for the fixed ends of the encoding)."""
        for x in literals:  # a loop, not any(): millions of clauses on the larger nets
            if x is True:
                return
        self.model.add_bool_or([x for x in literals if x is not False])

    def _at_most(self, bytes_live) -> None:
        if not isinstance(bytes_live, int) or self.least_memory:
            self.model.Add(bytes_live <= self.budget)
        elif bytes_live > self.budget:
            self.model.AddBoolOr([])  # nothing fits

    def _assignment(self, plan: Plan) -> list[tuple[object, bool]]:
        """``plan`` as the values of the model's variables."""
        stage_of, out = plan.stage_of(len(self.graph)), []
        for v, s in enumerate(stage_of):
            out += [(self.ge[v][i], i <= s) for i in range(1, self.K) if not isinstance(self.ge[v][i], bool)]
            out.append((self.kept[v], bool(plan.kept >> v & 1)))
        return out

    def hint(self, plan: Plan) -> None:
        for var, value in self._assignment(plan):
            self.model.AddHint(var, value)

    def cut(self, plan: Plan) -> None:
        """Remove ``plan`` from the model (no other plan has its assignment)."""
        self.model.AddBoolOr([var.Not() if value else var for var, value in self._assignment(plan)])

    def stages_for(self, kept: int, until: float, workers: int):
        """A plan with the kept set ``kept`` that the replay fits in the budget, and how many plans were
        replayed: (plan, count); (None, count) where the model holds none, ``core`` then naming kept flags
        that no plan has together; ("timeout", count) at ``until``. Plans replayed over the budget are cut."""
        literals = [k if kept >> v & 1 else k.Not() for v, k in enumerate(self.kept)]
        replayed = 0
        self.model.ClearAssumptions()
        self.model.AddAssumptions(literals)
        try:
            while True:
                if time.perf_counter() >= until:  # a solve of a large model takes seconds even with no time left
                    return "timeout", replayed
                solver = self._solver(until - time.perf_counter(), workers)
                status = solver.Solve(self.model)
                if status == self.cp_model.INFEASIBLE:
                    core = set(solver.SufficientAssumptionsForInfeasibility())
                    self.core = [(v, bool(kept >> v & 1)) for v, x in enumerate(literals) if x.Index() in core]
                    if not core <= {x.Index() for x in literals}:  # not a core of these flags: all of them go
                        self.core = [(v, bool(kept >> v & 1)) for v in range(len(literals))]
                    return None, replayed
                if status not in (self.cp_model.OPTIMAL, self.cp_model.FEASIBLE) or time.perf_counter() >= until:
                    return "timeout", replayed
                plan = self._plan(solver)
                replayed += 1
                if simulate(self.graph, plan).peak_bytes <= self.budget_bytes:
                    return plan, replayed
                _held_at_peak(self, plan)
                self.cut(plan)
        finally:
            self.model.ClearAssumptions()

    def exclude(self, flags: list[tuple[int, bool]]) -> None:
        """No plan has all these (node, kept) flags."""
        self.model.AddBoolOr([self.kept[v].Not() if value else self.kept[v] for v, value in flags])

    def at_least(self, cost: float) -> None:
        """No plan costs less than ``cost`` (a bound proven by another model)."""
        self.model.Add(self.objective >= math.ceil(cost * self.scale - 1e-9))
        self.bound = cost

    def _solver(self, time_limit_s: float, workers: int):
        return solver_of(self.cp_model, time_limit_s, workers)

    def under(self, below: float) -> None:
        """Only plans whose objective (cost, or with ``least_memory`` the peak) may be under ``below``."""
        if math.isfinite(below):  # floor(x * scale) < ceil(below * scale) for every cost x < below
            self.model.Add(self.objective <= math.ceil(below * self.scale) - 1)
            if self.least_memory:
                self.budget_bytes = min(self.budget_bytes, int(below) - 1)

    def cheapest(self, below: float, time_limit_s: float, workers: int):
        """The stages and kept set of a plan of least relaxed objective among those the model holds whose objective
        may be under ``below`` (None: there is none; "timeout": none found in the time, ``bound`` then holds what
        the solver proved)."""
        cp_model = self.cp_model
        self.under(below)
        solver = self._solver(time_limit_s, workers)
        status = solver.Solve(self.model)
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"optimal: CP-SAT refused the model: {self.model.Validate()}")
        if status == cp_model.INFEASIBLE:
            return None
        self.bound = max(self.bound, solver.BestObjectiveBound() / self.scale)
        self.proposed = solver.ObjectiveValue() / self.scale
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return "timeout"
        plan = self._plan(solver)
        return plan.stages, plan.kept

    def _plan(self, solver) -> Plan:
        n = len(self.graph)
        stage = [sum(solver.BooleanValue(x) for x in self.ge[v][1:self.K] if not isinstance(x, bool))
                 for v in range(n)]
        stages = [bits(v for v in range(n) if stage[v] == s) for s in range(max(stage) + 1)]
        kept = bits(v for v in range(n) if solver.BooleanValue(self.kept[v]))
        return Plan.from_stages(self.graph, stages, kept=kept, strategy="optimal", budget_bytes=self.budget_bytes)


def solver_of(cp_model, time_limit_s: float = math.inf, workers: int = 1):
    """A CP-SAT solver for these models.

    NOTE [CP-SAT's inclusion presolve]
    OR-Tools 9.15's presolve of constraints included in others (``presolve_inclusion_work_limit``) proves some of
    these models infeasible where a plan satisfies them (U-Net's least memory, after some hundred cuts: "no plan
    under 3.32 GB", where a plan of 3.13 GB satisfies every constraint, and the same model solved without presolve,
    or with this part of it off, finds one of 2.92 GB). It is switched off."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(min(time_limit_s, 1e9), 1e-3)
    solver.parameters.num_workers = workers
    solver.parameters.presolve_inclusion_work_limit = 0
    return solver


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _components(out: list[list[int]], into: list[list[int]]) -> list[int]:
    """Each node's strongly connected component (Kosaraju's two passes, without recursion)."""
    n, finished, seen = len(out), [], [False] * len(out)
    for root in range(n):
        if seen[root]:
            continue
        seen[root], stack = True, [(root, iter(out[root]))]
        while stack:
            v, rest = stack[-1]
            for w in rest:
                if not seen[w]:
                    seen[w] = True
                    stack.append((w, iter(out[w])))
                    break
            else:
                stack.pop()
                finished.append(v)
    component, count = [-1] * n, 0
    for root in reversed(finished):
        if component[root] >= 0:
            continue
        component[root], stack = count, [root]
        while stack:
            for w in into[stack.pop()]:
                if component[w] < 0:
                    component[w] = count
                    stack.append(w)
        count += 1
    return component


def nothing_reads(graph: Graph) -> int:
    """The values no layer, no backward and not the loss reads, and whose layers saved nothing else: a plan
    that keeps one runs the same step as one that does not; the model keeps them."""
    read = graph.read_by_backward()
    return bits(u for u in range(len(graph))
                if not graph.succs[u] and u not in read and u not in graph.profile.loss_reads
                and not (graph.profile.reached[u] and graph.saves_more(u)))


def _not(literal):
    return not literal if isinstance(literal, bool) else literal.Not()


def _cost_scale(costs) -> float:
    """Costs as CP-SAT's integers: exactly where they are whole, else rounded down at a fine scale (the bound
    stays a bound)."""
    if all(float(c).is_integer() for c in costs):
        return 1.0
    return 2.0 ** 30 / max(max(costs), 1e-12) / max(len(costs), 1)


class _OutOfTime(Exception):
    pass


def _held_at_peak(model: _Relaxation, plan: Plan) -> bool:
    """Where ``plan``'s replay peaks in a layer's backward, count there what recomputations will read (valid for
    every plan: a cut that may take this one, over the budget, out of the relaxation); whether any was added."""
    v = peak_layer(timeline(model.graph, plan))
    return v is not None and model.hold_for_recomputation(v)
