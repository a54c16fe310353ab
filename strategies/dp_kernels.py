"""Compiled inner loops of the lower-set DPs (numba); NOTE [the DP] in ``lower_set_dp.py`` says what
they compute.

A family of lower sets is a ``(count, W)`` array of 64-bit words, one row per set, sorted by (memory,
size) so that a subset always comes before its supersets. The passes take it as ``sets``, a tuple
(``Table.sets`` in ``lower_set_dp.py``): ``boundary``, each set's ∂(L) as words; ``values``, per set the
columns below; a CSR pair (pointers, indices) of each set's maximal nodes; ``holders`` and ``bounded``,
per node the sets holding it in L and in ∂(L), as rows of bits over the family (``transpose``); and the
nodes' memory and time.
"""

from __future__ import annotations

import time

import numpy as np
from numba import get_num_threads, njit, objmode, prange
from numba.cpython.unsafe.numbers import trailing_zeros

# Columns of ``values``, for a lower set L: m(L); 2 m(L) + m(A(L)) + m(B(L)) with A(L) = δ⁺(L) \ L and
# B(L) = δ⁻(A(L)) \ L, so that the stage L -> L' peaks at m(U) + KEY[L'] - 2 m(L); m(∂(L)); t(L);
# t(∂(L)); |L|.
MEM, KEY, MEM_BOUNDARY, TIME, TIME_BOUNDARY, SIZE = range(6)

ONE = np.uint64(1)
LEVELS = 64  # rows of bits by a bound on the value still to come, in ``pareto_chains``


@njit(cache=True)
def _now():
    with objmode(now="float64"):
        now = time.perf_counter()
    return now


@njit(cache=True)
def enumerate_lower_sets(pred_words, limit, deadline):
    """Every lower set, each once: the children of ``L`` are ``L ∪ {v}`` for ``v > max(L)`` whose
    predecessors lie in ``L`` (so ``L`` is its child's set less its largest node, which is maximal).
    Returns ``(words, complete)``; ``complete`` is False when ``limit`` sets were reached. Past ``deadline``
    (``time.perf_counter``'s clock; inf: none) it raises ``TimeoutError``."""
    n, width = pred_words.shape
    out = np.zeros((1024, width), dtype=np.uint64)
    count = 1  # ∅
    stack_set = np.zeros(n + 1, dtype=np.int64)
    stack_next = np.zeros(n + 1, dtype=np.int64)
    depth = 0
    steps = 0
    while depth >= 0:
        steps += 1
        if deadline < np.inf and steps % 65536 == 0 and _now() > deadline:
            raise TimeoutError("the enumeration of lower sets ran past its deadline")
        s, v = stack_set[depth], stack_next[depth]
        if v >= n:
            depth -= 1
            continue
        stack_next[depth] = v + 1
        addable = True
        for w in range(width):
            if pred_words[v, w] & ~out[s, w]:
                addable = False
                break
        if not addable:
            continue
        if count == limit:
            return out[:count], False
        if count == out.shape[0]:
            grown = np.zeros((2 * count, width), dtype=np.uint64)
            grown[:count] = out
            out = grown
        out[count] = out[s]
        out[count, v >> 6] |= ONE << np.uint64(v & 63)
        depth += 1
        stack_set[depth], stack_next[depth] = count, v + 1
        count += 1
    return out[:count], True


@njit(cache=True)
def describe_sets(words, pred_words, succ_words, node_mem, node_time):
    """The ``values`` table of a family (unsorted), with each set's boundary and maximal nodes as words."""
    count, width = words.shape
    n = node_mem.shape[0]
    values = np.zeros((count, 6))
    boundary = np.zeros((count, width), dtype=np.uint64)
    maximal = np.zeros((count, width), dtype=np.uint64)
    later = np.zeros(width, dtype=np.uint64)
    for s in range(count):
        later[:] = 0
        for v in range(n):
            word, bit = v >> 6, ONE << np.uint64(v & 63)
            inside = words[s, word] & bit
            leaves, stays, fed = False, False, False
            for w in range(width):
                if succ_words[v, w] & ~words[s, w]:
                    leaves = True
                if succ_words[v, w] & words[s, w]:
                    stays = True
                if pred_words[v, w] & words[s, w]:
                    fed = True
            if inside:
                values[s, MEM] += node_mem[v]
                values[s, TIME] += node_time[v]
                values[s, SIZE] += 1
                if leaves:
                    boundary[s, word] |= bit
                    values[s, MEM_BOUNDARY] += node_mem[v]
                    values[s, TIME_BOUNDARY] += node_time[v]
                if not stays:
                    maximal[s, word] |= bit
            elif fed:
                later[word] |= bit
                values[s, KEY] += node_mem[v]
        for v in range(n):  # B(L): outside L (in A(L) or not), feeding a node of A(L)
            if words[s, v >> 6] >> np.uint64(v & 63) & ONE:
                continue
            for w in range(width):
                if succ_words[v, w] & later[w]:
                    values[s, KEY] += node_mem[v]
                    break
        values[s, KEY] += 2 * values[s, MEM]
    return values, boundary, maximal


@njit(cache=True)
def rows(words, n):
    """CSR of each row's members (ascending)."""
    count = words.shape[0]
    pointers = np.zeros(count + 1, dtype=np.int64)
    for s in range(count):
        for v in range(n):
            if words[s, v >> 6] >> np.uint64(v & 63) & ONE:
                pointers[s + 1] += 1
    pointers = np.cumsum(pointers)
    indices = np.empty(pointers[count], dtype=np.int64)
    for s in range(count):
        filled = pointers[s]
        for v in range(n):
            if words[s, v >> 6] >> np.uint64(v & 63) & ONE:
                indices[filled] = v
                filled += 1
    return pointers, indices


@njit(cache=True)
def transpose(words, n):
    """Per node, the sets whose row holds it, as a row of bits over the family (bit ``s`` of word ``s >> 6``)."""
    count = words.shape[0]
    columns = np.zeros((n, (count + 63) >> 6), dtype=np.uint64)
    for s in range(count):
        bit = ONE << np.uint64(s & 63)
        for v in range(n):
            if words[s, v >> 6] >> np.uint64(v & 63) & ONE:
                columns[v, s >> 6] |= bit
    return columns


@njit(cache=True, inline="always")
def _window_end(values, i, room):
    """One past the last set ``j`` with ``m(L_j) <= m(L_i) + room / 2`` (``KEY[j] >= 2 m(L_j)``)."""
    return np.searchsorted(values[:, MEM], values[i, MEM] + room / 2, side="right")


@njit(cache=True)
def _transitions(sets, i, cache, budget, keep, start, stop, out):
    """The stages from ``L_i`` with cache ``cache`` that fit ``budget``: every superset ``L_j`` with
    ``max(i + 1, start) <= j < stop`` in ``keep`` (a row of bits over the family) and ``cache + KEY[j] -
    2 m(L_i) <= budget``, ascending, written to ``out = (sets, caches, times)``, with the cache
    ``m(∂(L_j) \\ L_i)`` and the overhead ``t((L_j \\ L_i) \\ ∂(L_j))`` the stage adds. Returns their number.

    A superset holds the maximal nodes of ``L_i``: the AND of their rows in ``holders``, 64 sets a word,
    over the window of sets light enough to fit. The part of ``∂(L_j)`` inside ``L_i`` lies in ``∂(L_i)``,
    a few nodes; each adds itself to the sets of the word whose boundary holds it (its row in
    ``bounded``), in ascending node order, so the sums are those of adding the members one by one."""
    boundary, values, top_ptr, top_idx, holders, bounded, node_mem, node_time = sets
    out_set, out_cache, out_time = out
    first, last = max(i + 1, start), min(stop, _window_end(values, i, budget - cache))
    if last <= first:
        return 0
    room = budget - cache + 2 * values[i, MEM]
    edge = np.empty(64 * boundary.shape[1], dtype=np.int64)  # ∂(L_i)
    size = 0
    for w in range(boundary.shape[1]):
        rest = boundary[i, w]
        while rest:
            edge[size] = 64 * w + trailing_zeros(rest)
            size += 1
            rest &= rest - ONE
    shared_mem, shared_time = np.zeros(64), np.zeros(64)  # per set of the word: (m, t)(∂(L_j) ∩ L_i)
    count = 0
    first_word, last_word = first >> 6, (last - 1) >> 6
    for w in range(first_word, last_word + 1):
        word = keep[w]
        if w == first_word:
            word &= ~np.uint64(0) << np.uint64(first & 63)
        if w == last_word:
            word &= ~np.uint64(0) >> np.uint64(63 - ((last - 1) & 63))
        for t in range(top_ptr[i], top_ptr[i + 1]):
            word &= holders[top_idx[t], w]
        for k in range(size):
            v = edge[k]
            rest = word & bounded[v, w]
            while rest:
                bit = trailing_zeros(rest)
                rest &= rest - ONE
                shared_mem[bit] += node_mem[v]
                shared_time[bit] += node_time[v]
        while word:
            bit = trailing_zeros(word)
            word &= word - ONE
            j = 64 * w + bit
            mem, time = shared_mem[bit], shared_time[bit]
            shared_mem[bit] = shared_time[bit] = 0.0
            if values[j, KEY] > room:
                continue
            out_set[count] = j
            out_cache[count] = values[j, MEM_BOUNDARY] - mem
            out_time[count] = values[j, TIME] - values[i, TIME] - values[j, TIME_BOUNDARY] + time
            count += 1
    return count


@njit(cache=True)
def _buffers(count, lanes=1):
    """Room for the transitions from one set, per lane, and a ``keep`` row of every set."""
    out = np.empty((lanes, count), dtype=np.int64), np.empty((lanes, count)), np.empty((lanes, count))
    return out, np.full((count + 63) >> 6, ~np.uint64(0))


# NOTE [lanes]: the two passes over every transition run on all cores. The family is cut into blocks of
# consecutive sets (BLOCK); the stages that leave a block are spread over lanes (every lane-th set), and
# those within it are taken in order by one lane. The passes only take minima and maxima, so their results
# do not depend on the number of lanes.
BLOCK = 256


def least_cache(sets, budget, deadline=np.inf):
    """``_least_cache`` on every core numba may use; past ``deadline`` it raises ``TimeoutError``."""
    return _least_cache(sets, budget, get_num_threads(), BLOCK, deadline)


def backward(sets, budget, least, deadline=np.inf):
    """``_backward`` on every core numba may use; past ``deadline`` it raises ``TimeoutError``."""
    return _backward(sets, budget, least, get_num_threads(), BLOCK, deadline)


@njit(cache=True, parallel=True)
def _least_cache(sets, budget, lanes, block, deadline):
    """Per set, the least cache ``m(U)`` with which some chain reaches it within ``budget`` (inf: none).

    Pushed forward (NOTE [lanes]): a block's sets are final once every earlier block has pushed into it
    (each lane into a row of its own) and the block has pushed into itself, in order."""
    count = sets[1].shape[0]
    (out_set, out_cache, out_time), everything = _buffers(count, lanes)
    pushed = np.full((lanes, count), np.inf)
    least = np.full(count, np.inf)
    least[0] = 0.0
    for start in range(0, count, block):
        if deadline < np.inf and _now() > deadline:  # between blocks: prange bodies cannot look at a clock
            raise TimeoutError("the DP's pass ran past its deadline")
        stop = min(start + block, count)
        for j in range(start, stop):
            for lane in range(lanes):
                least[j] = min(least[j], pushed[lane, j])
        inside = (out_set[0], out_cache[0], out_time[0])
        for i in range(start, stop):
            if least[i] < np.inf:
                for e in range(_transitions(sets, i, least[i], budget, everything, i + 1, stop, inside)):
                    j = out_set[0, e]
                    least[j] = min(least[j], least[i] + out_cache[0, e])
        for lane in prange(lanes):
            out = (out_set[lane], out_cache[lane], out_time[lane])
            for i in range(start + lane, stop, lanes):
                if least[i] < np.inf:
                    for e in range(_transitions(sets, i, least[i], budget, everything, stop, count, out)):
                        j = out_set[lane, e]
                        pushed[lane, j] = min(pushed[lane, j], least[i] + out_cache[lane, e])
    return least


@njit(cache=True, inline="always")
def _pull(sets, i, budget, least, most, low, high, keep, start, stop, out):
    """Fold into ``most[i], low[i], high[i]`` the stages from ``L_i`` to the sets in ``[start, stop)``."""
    values = sets[1]
    out_set, out_cache, out_time = out
    most_i, low_i, high_i = most[i], low[i], high[i]
    for e in range(_transitions(sets, i, least[i], budget, keep, start, stop, out)):
        j = out_set[e]
        if least[i] + out_cache[e] > most[j]:
            continue  # also when most[j] = -inf: no chain finishes from L_j
        stage = values[j, KEY] - 2 * values[i, MEM]
        most_i = max(most_i, min(budget - stage, most[j] - out_cache[e]))
        low_i = min(low_i, out_time[e] + low[j])
        high_i = max(high_i, out_time[e] + high[j])
    most[i], low[i], high[i] = most_i, low_i, high_i


@njit(cache=True, parallel=True)
def _backward(sets, budget, least, lanes, block, deadline):
    """Per set, from the sets some chain reaches within ``budget`` (``least`` finite), backwards:
    ``most``, the most cache with which a chain can still go on to V (-inf: none can), and the least and
    the most overhead of the rest of such a chain when every stage starts from the least cache that can
    reach its set (a relaxation, so bounds on the overhead still to come from any state of the set).

    Pulled backward (NOTE [lanes]): the blocks from the last, each set pulling first from the later
    blocks, which are final, then, in descending order, from its own."""
    count = sets[1].shape[0]
    (out_set, out_cache, out_time), everything = _buffers(count, lanes)
    most = np.full(count, -np.inf)
    most[count - 1] = np.inf
    low = np.full(count, np.inf)
    high = np.full(count, -np.inf)
    low[count - 1] = high[count - 1] = 0.0
    for stop in range(count - 1, 0, -block):  # V is final from the start
        if deadline < np.inf and _now() > deadline:
            raise TimeoutError("the DP's pass ran past its deadline")
        start = max(0, stop - block)
        for lane in prange(lanes):
            out = (out_set[lane], out_cache[lane], out_time[lane])
            for i in range(start + lane, stop, lanes):
                if least[i] < np.inf:
                    _pull(sets, i, budget, least, most, low, high, everything, stop, count, out)
        inside = (out_set[0], out_cache[0], out_time[0])
        for i in range(stop - 1, start - 1, -1):
            if least[i] < np.inf:
                _pull(sets, i, budget, least, most, low, high, everything, i + 1, stop, inside)
    return most, low, high


@njit(cache=True, inline="always")
def _copy(to, to_parents, a, source, source_parents, b):
    """State ``a`` of (``to``, ``to_parents``) := state ``b`` of (``source``, ``source_parents``)."""
    to[a, 0], to[a, 1] = source[b, 0], source[b, 1]
    to_parents[a, 0], to_parents[a, 1] = source_parents[b, 0], source_parents[b, 1]


@njit(cache=True, inline="always")
def _merge(frontier, parents, sizes, j, new, new_parents, count, scratch, scratch_parents):
    """Merge ``count`` states ``new[:count] = (value, cache)``, sorted by cache ascending, into set ``j``'s
    Pareto frontier (both minimised), kept sorted by cache ascending, so by value strictly descending;
    dominated states go, and of two equal states the one already there stays.

    One sweep by cache: a state stays when its value is below that of every state of no more cache (at
    equal caches the lower value, then the old state, comes first). The old states of less cache than the
    first new one stay where they are (found by bisection); those past the sweep that it leaves undominated
    stay too, moved once. Merging one state that is dominated costs O(log size)."""
    row, row_parents, size = frontier[j], parents[j], sizes[j]
    start = old = np.searchsorted(row[:size, 1], new[0, 1])
    least = row[start - 1, 0] if start else np.inf  # the least value swept so far
    fresh, kept = 0, 0
    while fresh < count:
        if old < size and (row[old, 1] < new[fresh, 1]
                           or (row[old, 1] == new[fresh, 1] and row[old, 0] <= new[fresh, 0])):
            if row[old, 0] < least:
                least = row[old, 0]
                _copy(scratch, scratch_parents, kept, row, row_parents, old)
                kept += 1
            old += 1
        else:
            if new[fresh, 0] < least:
                least = new[fresh, 0]
                _copy(scratch, scratch_parents, kept, new, new_parents, fresh)
                kept += 1
            fresh += 1
    while old < size and row[old, 0] >= least:
        old += 1  # dominated; the rest have less value, and stay
    end = start + kept  # where the rest go
    if end != old:  # in the order that reads each state before it is overwritten
        for e in (range(old, size) if end < old else range(size - 1, old - 1, -1)):
            _copy(row, row_parents, e - old + end, row, row_parents, e)
    for e in range(kept):
        _copy(row, row_parents, start + e, scratch, scratch_parents, e)
    sizes[j] = end + size - old


@njit(cache=True)
def _levels(ahead, count):
    """Rows of bits over the family: row ``l`` holds the sets with ``ahead <= thresholds[l]``, the
    thresholds being quantiles of ``ahead``; with, per row, the least ``ahead`` of the sets it leaves out."""
    ranked = np.sort(ahead[np.isfinite(ahead)])
    thresholds = np.unique(ranked[np.linspace(0, len(ranked) - 1, min(LEVELS, len(ranked))).astype(np.int64)])
    beyond = np.full(len(thresholds), np.inf)
    for l in range(len(thresholds)):
        above = np.searchsorted(ranked, thresholds[l], side="right")
        if above < len(ranked):
            beyond[l] = ranked[above]
    masks = np.zeros((len(thresholds), (count + 63) >> 6), dtype=np.uint64)
    for j in range(count):
        for l in range(np.searchsorted(thresholds, ahead[j]), len(thresholds)):
            masks[l, j >> 6] |= ONE << np.uint64(j & 63)
    return thresholds, beyond, masks


@njit(cache=True)
def _ahead(values, objective, to_go):
    """Per set, the least value still to come from it on (``pareto_chains``' bound; inf: no bound)."""
    if objective == 1:
        return values[:, TIME] - values[:, TIME_BOUNDARY] + to_go
    if objective == 2:
        return to_go - values[:, TIME]
    return np.full(values.shape[0], np.inf)  # the stage peak has no such bound: no rows, nothing left out


@njit(cache=True)
def _grown(frontier, parents, capacity):
    """The frontier and its parents with room for ``capacity`` states a set."""
    count = frontier.shape[0]
    grown = np.zeros((count, capacity, 2))
    grown[:, :frontier.shape[1]] = frontier
    grown_parents = np.zeros((count, capacity, 2), dtype=np.int32)
    grown_parents[:, :parents.shape[1]] = parents
    return grown, grown_parents


@njit(cache=True)
def pareto_chains(sets, budget, objective, most, to_go, cutoff, deadline):
    """Forward DP keeping, per set, the Pareto frontier of (value, cache) over the chains that reach it
    within ``budget`` and can still finish (``cache <= most``). ``objective``: 0 value = the stage peak
    so far (the least budget), 1 value = overhead (time-centric), 2 value = -overhead (memory-centric).
    A state whose value plus ``to_go`` (a lower bound on the value still to come) exceeds ``cutoff`` is
    dropped. Returns ``(frontier, parents, sizes, over)``: ``frontier[s, k] = (value, cache)``,
    ``parents[s, k] = (set, slot)`` of the state it came from, and ``over`` the least value plus bound
    among the dropped states (the next cutoff worth trying), or a lower bound on it. Past ``deadline``
    (``time.perf_counter``'s clock; inf: none) it raises ``TimeoutError``, looking every 256 sets."""
    values = sets[1]
    count = values.shape[0]
    (out_sets, out_caches, out_times), keep_all = _buffers(count)
    out = out_set, out_cache, out_time = out_sets[0], out_caches[0], out_times[0]
    # A stage from L_i to L_j adds at least t(L_j \\ L_i) - t(∂(L_j)) and at most t(L_j \\ L_i) of
    # overhead, so the value at L_j is at least best + sign t(L_i) + ahead[j], best being the least value
    # at L_i: the sets where that bound exceeds the cutoff are left out a word at a time, by ``_levels``.
    sign = -1.0 if objective == 1 else 1.0
    thresholds, beyond, masks = _levels(_ahead(values, objective, to_go), count)
    new, new_parents = np.empty((0, 2)), np.empty((0, 2), dtype=np.int32)  # one transition's states, by cache
    scratch, scratch_parents = np.empty((0, 2)), np.empty((0, 2), dtype=np.int32)
    slack = 1e-9 * max(1.0, abs(cutoff))  # the bound and the values sum in another order
    capacity = 8
    frontier = np.zeros((count, capacity, 2))
    parents = np.zeros((count, capacity, 2), dtype=np.int32)
    sizes = np.zeros(count, dtype=np.int64)
    sizes[0] = 1
    largest = 1
    over = np.inf
    for i in range(count - 1):
        if deadline < np.inf and i % 256 == 0 and _now() > deadline:
            raise TimeoutError("the DP's pass ran past its deadline")
        k = sizes[i]
        if k == 0:
            continue
        if largest + k > capacity:  # one set gets at most k states from set i
            capacity = 2 * (largest + k)
            frontier, parents = _grown(frontier, parents, capacity)
        if len(new) < capacity:
            new, new_parents = np.empty((capacity, 2)), np.empty((capacity, 2), dtype=np.int32)
            scratch, scratch_parents = np.empty((capacity, 2)), np.empty((capacity, 2), dtype=np.int32)
        best = frontier[i, k - 1, 0]  # the least value at set i, at its greatest cache
        keep = keep_all
        if objective:
            level = np.searchsorted(thresholds, cutoff - best - sign * values[i, TIME] + slack)
            if level < len(thresholds):
                keep = masks[level]
                over = min(over, best + sign * values[i, TIME] + beyond[level])
        for e in range(_transitions(sets, i, frontier[i, 0, 1], budget, keep, 0, count, out)):
            j = out_set[e]
            if most[j] == -np.inf:
                continue
            added_cache, added_time = out_cache[e], out_time[e]
            if objective == 1 and best + added_time + to_go[j] > cutoff:
                over = min(over, best + added_time + to_go[j])
                continue
            if objective == 2 and best - added_time + to_go[j] > cutoff:
                over = min(over, best - added_time + to_go[j])
                continue
            stage = values[j, KEY] - 2 * values[i, MEM]
            fresh = 0
            for slot in range(k):
                cache = frontier[i, slot, 1]
                if cache + stage > budget or cache + added_cache > most[j]:
                    break  # the caches only grow along the frontier
                if objective == 0:
                    value = max(frontier[i, slot, 0], cache + stage)
                elif objective == 1:
                    value = frontier[i, slot, 0] + added_time
                else:
                    value = frontier[i, slot, 0] - added_time
                if value + to_go[j] > cutoff:
                    over = min(over, value + to_go[j])
                    continue
                new[fresh, 0], new[fresh, 1] = value, cache + added_cache
                new_parents[fresh, 0], new_parents[fresh, 1] = i, slot
                fresh += 1
            if fresh:
                _merge(frontier, parents, sizes, j, new, new_parents, fresh, scratch, scratch_parents)
                largest = max(largest, sizes[j])
    return frontier, parents, sizes, over

