"""Each strategy's exact plan on small graphs worked out by hand: the plan the algorithm defines (stages, kept set,
segments, thresholds, swap set, prefetch triggers), its predicted peak and its overhead.

A heuristic that returns a valid plan that is not the one it defines (a worse threshold, another tie, a later
prefetch) fits its budget and its prediction all the same; only the plan itself tells. The walk-throughs use the
simulator's liveness replay on hand-written graphs: the backward of ``v`` reads ``v``'s inputs, a gradient has its
value's size, a value no backward reads goes after its last forward reader, and the loss reads the outputs and
frees them before the output's gradient comes.
"""

import pytest

import strategies.chen_greedy as chen_greedy
from strategies import Graph, InfeasibleBudget, Plan, members, simulate, solve
from test_graph import diamond
from test_simulate import chain

MIB = 1 << 20
PAPER = {"memory_model": "paper"}


def figures(graph, plan):
    prediction = simulate(graph, plan)
    return prediction.peak_bytes, prediction.overhead_cost


def stages_of(plan):
    return [members(stage) for stage in plan.stages]


def test_chen_sqrt_on_a_chain_of_sixteen():
    """Sixteen nodes of one byte: the candidates are ∅, the 15 prefixes ending at nodes 0..14 and V, 17 in all;
    k = isqrt(17) = 4 segments, a step of 16 // 4 = 4 bytes. A prefix is taken when its size passes the
    threshold 4, 8, 12: the prefixes of 5, 9 and 13 nodes, then V. Stages 0-4, 5-8, 9-12, 13-15; kept 4, 8, 12.

    Peak: the backward of 15 starts with 4, 8, 12 and grad 15 (4 bytes), recomputes 13 and 14 (the backwards
    of 14 and 15 read them; no backward reads 15), 6, and makes grad 14: 7. The segment 9-12 peaks the same way
    at its last node's backward: 4, 8, grad 12, then 9, 10, 11 and grad 11: 7. The first two segments hold
    fewer kept values: 6 each. Overhead: 13, 14; 9, 10, 11; 5, 6, 7; 0, 1, 2, 3: 12 nodes of cost 1."""
    g = chain(16)
    plan = solve("chen_sqrt", g)
    assert stages_of(plan) == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]
    assert members(plan.kept) == [4, 8, 12]
    assert figures(g, plan) == (7, 12.0)


def test_chen_greedy_searches_memonger_s_thresholds_and_takes_the_least_peak(monkeypatch):
    """Same chain. Threshold 0 ends a segment at every split point (0..14): 15 bytes kept, largest segment 1.
    The next threshold is isqrt(15 * 1 // 2) = 2: segments end where the running size passes 2, at 2, 5, 8,
    11, 14 (5 kept, largest 3), and then isqrt(5 * 3 // 2) = 2 again. The grid runs from the least largest
    segment, 1, to 2 * sqrt(2) = 2.83 in six steps of 0.30: int() gives 1, 1, 1, 2, 2, 2. Threshold 1 ends
    segments at 1, 3, ..., 13 (7 kept).

    Peaks: threshold 0 keeps all of 0..14, vanilla's step: 15 values, grad 15 and grad 14 at the backward of
    15, 17. Threshold 2: the segment 12-14 peaks at the backward of 14 with 2, 5, 8, 11, grad 14, 12 and 13
    recomputed and grad 13: 8. Threshold 1: the last segment, 14-15, at the backward of 15 with 7 kept, grad 15,
    14 recomputed and grad 14: 10. The least is threshold 2's, overhead two nodes in each of five segments: 10;
    a budget of 7 is below every threshold's peak, and the error names 8."""
    g = chain(16)
    tried = []
    greedy = chen_greedy._greedy
    monkeypatch.setattr(chen_greedy, "_greedy", lambda graph, points, t, budget: (tried.append(t),
                                                                                   greedy(graph, points, t, budget))[1])
    plan = solve("chen_greedy", g)
    assert tried == [0, 2, 2, 1]  # three rounds, then the grid's points not tried yet
    assert plan.info["threshold_bytes"] == 2
    assert stages_of(plan) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15]]
    assert members(plan.kept) == [2, 5, 8, 11, 14]
    assert figures(g, plan) == (8, 10.0)
    assert figures(g, chen_greedy._greedy(g, set(range(15)), 1, None)[2]) == (10, 8.0)
    assert figures(g, chen_greedy._greedy(g, set(range(15)), 0, None)[2]) == (17, 0)
    with pytest.raises(InfeasibleBudget, match="minimal feasible budget is 8 bytes"):
        solve("chen_greedy", g, 7)


def residual() -> Graph:
    """Two residual blocks of one byte a value: 0 -> 1 -> 2 -> 3 = 0 + 2 -> 4 -> 5 -> 6 = 3 + 5 -> 7."""
    return Graph(mem_bytes=[1] * 8, cost=[1] * 8,
                 edges=[(0, 1), (1, 2), (0, 3), (2, 3), (3, 4), (4, 5), (3, 6), (5, 6), (6, 7)])


def test_chen_s_segments_end_at_the_skip_connections_joins():
    """The split points are 0, 3 and 6 (inside a block the skip connection goes around every node).

    chen_sqrt: candidates ∅, the prefixes of 1, 4, 7 nodes and V; isqrt(5) = 2 segments, a step of 8 // 2 = 4
    bytes; the prefix of 4 does not pass 4, that of 7 does: stages 0-6 | 7, kept 6. The backward of 6 (the
    addition, which reads 3 and 5) recomputes 0..5, all read by some backward, beside grad 6: 7, then makes
    grad 3 and grad 5: 9. Overhead 6.

    chen_greedy: threshold 0 ends a segment at each split point (3 kept, largest segment 3); the next,
    isqrt(3 * 3 // 2) = 2, at 3 and 6 (2 kept, largest 4), and again isqrt(2 * 4 // 2) = 2. The grid runs from 3 to
    2.83: none. Threshold 2: stages 0-3 | 4-6 | 7, kept 3, 6; the backward of 6 holds 3, grad 6, 4 and 5
    recomputed, grad 3 and grad 5: 6, as does that of 3 (grad 3, 0, 1, 2 recomputed, grad 0, grad 2). Threshold
    0 also keeps 0: 7 there. Overhead 2 + 3 = 5."""
    g = residual()
    sqrt_plan = solve("chen_sqrt", g)
    assert stages_of(sqrt_plan) == [[0, 1, 2, 3, 4, 5, 6], [7]] and members(sqrt_plan.kept) == [6]
    assert figures(g, sqrt_plan) == (9, 6.0)
    greedy = solve("chen_greedy", g)
    assert greedy.info["threshold_bytes"] == 2
    assert stages_of(greedy) == [[0, 1, 2, 3], [4, 5, 6], [7]] and members(greedy.kept) == [3, 6]
    assert figures(g, greedy) == (6, 5.0)
    assert figures(g, chen_greedy._greedy(g, {0, 3, 6}, 0, None)[2])[0] == 7


def test_the_dps_by_equation_2_on_a_chain_of_four_and_the_optimum_below_them():
    """a -> b -> c -> d, one byte each. The DPs' chains are the subsets S of {a, b, c} kept (a stage ends at each).
    Equation (2) peaks (overhead by equation (1), which also counts d): S = {a,b,c} 5 (1), {b,c} 5 (2), {b} 5
    (3), {a,b} 6, {a,c} 6, {a} 7, {c} 7, {} 8. The liveness replay of each: {a,b,c} is vanilla's step, 5 at the
    backward of d (a, b, c, grad d, grad c); {b,c} holds b, c, grad d, grad c there, 4, and recomputes a (1);
    {a,c} holds a, c, then recomputes b beside grad c and grad b: 4 (1); {b} recomputes c beside b and grad d,
    then grad c: 4 (2); {c} 4 (2); {a}, {a,b} and {} 5.

    tc: at equation (2)'s every budget the least overhead is S = {a,b,c}, so its replay, 5, is the least the DP
    finds, and 4 is refused naming 5. mc, searched in the replay (NOTE [the least replay]): the least peak, 4, and at
    it the least overhead, S = {b,c}, stages ab | c | d, recomputing a (1); ``optimal`` at 4 finds these stages."""
    g = chain(4)
    for name in ("exact_dp", "approx_dp"):
        tc = solve(name, g)
        assert stages_of(tc) == [[0], [1], [2], [3]] and members(tc.kept) == [0, 1, 2]
        assert figures(g, tc) == (5, 0)
        with pytest.raises(InfeasibleBudget, match="minimal feasible budget is 5 bytes"):
            solve(name, g, 4)
        mc = solve(name, g, mode="mc")
        assert stages_of(mc) == [[0, 1], [2], [3]] and members(mc.kept) == [1, 2]
        assert figures(g, mc) == (4, 1.0)
    best = solve("optimal", g, 4)
    assert stages_of(best) == [[0, 1], [2], [3]] and members(best.kept) == [1, 2, 3]
    assert figures(g, best) == (4, 1.0) and best.info["optimal_status"] == "optimal"


def test_on_a_diamond_only_the_exact_family_ends_a_stage_after_both_branches():
    """a -> b, a -> c, b -> d, c -> d with m = 1, 2, 3, 4 and t(b) = 10 (``test_graph.diamond``). The lower sets
    are ∅, a, ab, ac, abc, V; the principal ones lack abc.

    exact_dp, equation (2): a | bc | d peaks at M_2 = m(a) + 2 m(b, c) + m(d) = 15 (M_1 = 7, M_3 = 14), the
    least of any chain; it discards d alone (overhead 1 by equation (1); replayed, 0, since no backward reads d). approx_dp can end a stage at ab or ac only: a | c | bd
    and ac | bd both peak at M_3 = m(a, c) + 2 m(b, d) = 16 and discard b and d (11), a tie the DP breaks for
    ac | bd; a | b | cd and ab | cd peak at 17. Replayed, every plan holds 15 at its peak (a, b, c and grad d as
    d's backward makes grad b and grad c), and ac | bd recomputes b: 10.

    Judged by the replay (the default), approx_dp scans its plans at every equation (2) budget; all replay to
    15, so tc takes the least overhead, recomputing c alone (1): the DP's plan at equation (2)'s 17, ab | cd (a | b | cd
    ties it); mc, searched in the replay, finds no plan under 15 and takes the same."""
    g = diamond()
    exact = solve("exact_dp", g, **PAPER)
    assert stages_of(exact) == [[0], [1, 2], [3]] and members(exact.kept) == [0, 1, 2]
    assert simulate(g, exact, liveness=False).peak_bytes == 15 and figures(g, exact) == (15, 0)
    approx = solve("approx_dp", g, **PAPER)
    assert stages_of(approx) == [[0, 2], [1, 3]] and members(approx.kept) == [0, 2]
    assert simulate(g, approx, liveness=False).peak_bytes == 16 and figures(g, approx) == (15, 10.0)
    tc = solve("approx_dp", g)
    assert stages_of(tc) == [[0, 1], [2, 3]] and members(tc.kept) == [0, 1] and figures(g, tc) == (15, 1.0)
    mc = solve("approx_dp", g, mode="mc")
    assert stages_of(mc) == [[0, 1], [2, 3]] and figures(g, mc) == (15, 1.0)


def test_swap_moves_the_longest_lived_values_and_starts_each_copy_as_late_as_it_hides():
    """Eight values of 4 MiB in a chain, vanilla's plan. Swapping the first m of the candidates 0..6 (kept, read
    by a backward; 7 is only the loss's) leaves m..6 on the device: the backward of 7 holds them with grad 7
    and grad 6, 9 - m values, and a swapped value comes back beside two gradients, 3. A budget of 24 MiB (6
    values) takes m = 3. At 100 TFLOP/s a node's backward (2 FLOPs) takes no time and a copy 84 us: nothing
    hides, each value comes back at the backward that reads it, 0 at 1's, 1 at 2's, 2 at 3's. At 1e-9 TFLOP/s a
    backward takes 2 ms: each copy hides behind the backward before its reader, started at u + 2's. With no
    budget every candidate goes: 3 values, 12 MiB."""
    g = Graph(mem_bytes=[4 * MIB] * 8, cost=[1] * 8, edges=[(i, i + 1) for i in range(7)])
    fast = solve("swap", g, 24 * MIB)
    assert members(fast.swapped) == [0, 1, 2] and fast.info["prefetch"] == "just_in_time"
    assert fast.prefetch == ((0, 1), (1, 2), (2, 3))
    assert simulate(g, fast).peak_bytes == 24 * MIB
    slow = solve("swap", g, 24 * MIB, compute_tflops=1e-9)
    assert members(slow.swapped) == [0, 1, 2] and slow.info["prefetch"] == "hidden"
    assert slow.prefetch == ((0, 2), (1, 3), (2, 4))
    assert simulate(g, slow).peak_bytes == 24 * MIB
    least = solve("swap", g)
    assert members(least.swapped) == list(range(7)) and simulate(g, least).peak_bytes == 12 * MIB
    with pytest.raises(InfeasibleBudget, match=f"minimal feasible budget is {12 * MIB} bytes"):
        solve("swap", g, 12 * MIB - 1)


def test_the_peers_stages_follow_the_blocks_and_pytorch_s_segments():
    """Seven nodes: a stem, two blocks of two layers, a functional step and a head. checkpoint per block: one
    stage per block, the others alone; the blocks' two stages checkpointed. checkpoint_sequential over the five
    steps (stem, block1, block2, the function, head) in round(sqrt(5)) = 2 segments of 5 // 2 = 2 steps, the last
    taking the rest: stem and block1 | block2, the function (which goes with its input's step) and the head; the
    first segment checkpointed, the last keeping all its values."""
    scopes = ["stem", "block1.conv", "block1.relu", "block2.conv", "block2.relu", "", "head"]
    g = chain(7).replace(scopes=scopes)
    blocks = solve("torch_checkpoint_blocks", g, blocks=("block1", "block2"))
    assert stages_of(blocks) == [[0], [1, 2], [3, 4], [5], [6]] and members(blocks.checkpointed) == [1, 2]
    assert members(blocks.kept) == [0, 2, 4, 5]
    sequential = solve("torch_checkpoint_sequential", g, sequence=("stem", "block1", "block2", "relu", "head"))
    assert stages_of(sequential) == [[0, 1, 2], [3, 4, 5, 6]] and members(sequential.checkpointed) == [0]
    assert members(sequential.kept) == [2, 3, 4, 5, 6] and sequential.info["segments"] == 2


def test_vanilla_and_liveness_only_keep_everything_in_one_stage():
    """One stage, every value kept: on a chain of three, 4 bytes at the backward of c (a, b, grad c, grad b),
    6 by equation (2) (2 m(V)), nothing recomputed."""
    g = chain(3)
    for name in ("vanilla", "liveness_only"):
        plan = solve(name, g)
        assert plan.stages == (g.all_nodes,) and plan.kept == g.all_nodes and figures(g, plan) == (4, 0)
    assert solve("liveness_only", g).info["naive_bytes"] == 6
    assert Plan.from_stages(g, [g.all_nodes]).kept == 0  # the canonical cache of one stage is empty
