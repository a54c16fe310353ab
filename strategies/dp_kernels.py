"""Compiled inner loops of the lower-set DPs (numba); NOTE [the DP] in ``lower_set_dp.py`` says what
they compute.

A family of lower sets is a ``(count, W)`` array of 64-bit words, one row per set, sorted by (memory,
size) so that a subset always comes before its supersets; ``boundary`` holds each set's ∂(L) the same
way. ``values`` holds per set the columns below; ``lists`` two CSR pairs (pointers, indices): per set its
maximal nodes, and per node the (ascending) sets holding it.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

# Columns of ``values``, for a lower set L: m(L); 2 m(L) + m(A(L)) + m(B(L)) with A(L) = δ⁺(L) \ L and
# B(L) = δ⁻(A(L)) \ L, so that the stage L -> L' peaks at m(U) + KEY[L'] - 2 m(L); m(∂(L)); t(L);
# t(∂(L)); |L|.
MEM, KEY, MEM_BOUNDARY, TIME, TIME_BOUNDARY, SIZE = range(6)

ONE = np.uint64(1)


@njit(cache=True)
def enumerate_lower_sets(pred_words, limit):
    """Every lower set, each once: the children of ``L`` are ``L ∪ {v}`` for ``v > max(L)`` whose
    predecessors lie in ``L`` (so ``L`` is its child's set less its largest node, which is maximal).
    Returns ``(words, complete)``; ``complete`` is False when ``limit`` sets were reached."""
    n, width = pred_words.shape
    out = np.zeros((1024, width), dtype=np.uint64)
    count = 1  # ∅
    stack_set = np.zeros(n + 1, dtype=np.int64)
    stack_next = np.zeros(n + 1, dtype=np.int64)
    depth = 0
    while depth >= 0:
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
def columns(pointers, indices, n):
    """The transpose of a CSR from ``rows``: each node's rows, ascending."""
    count = pointers.shape[0] - 1
    sizes = np.zeros(n + 1, dtype=np.int64)
    for v in indices:
        sizes[v + 1] += 1
    column_pointers = np.cumsum(sizes)
    column_indices = np.empty(indices.shape[0], dtype=np.int64)
    filled = column_pointers[:n].copy()
    for s in range(count):
        for v in indices[pointers[s]:pointers[s + 1]]:
            column_indices[filled[v]] = s
            filled[v] += 1
    return column_pointers, column_indices


@njit(cache=True, inline="always")
def _candidates(i, last, lists, everything):
    """Indices ``j`` in ``(i, last)`` that may hold ``L_i``: a superset holds its maximal nodes, so the
    window's part of the shortest posting list among them (every later set when ``L_i = ∅``)."""
    top_ptr, top_idx, post_ptr, post_idx = lists
    if top_ptr[i] == top_ptr[i + 1]:
        return everything[i + 1:last]
    best_v, best_lo, best_hi = -1, 0, 0
    for t in range(top_ptr[i], top_ptr[i + 1]):
        v = top_idx[t]
        postings = post_idx[post_ptr[v]:post_ptr[v + 1]]
        lo = np.searchsorted(postings, i + 1)
        hi = np.searchsorted(postings, last)
        if best_v < 0 or hi - lo < best_hi - best_lo:
            best_v, best_lo, best_hi = v, lo, hi
    return post_idx[post_ptr[best_v] + best_lo:post_ptr[best_v] + best_hi]


@njit(cache=True, inline="always")
def _holds(words, j, i):
    """L_j ⊇ L_i."""
    for w in range(words.shape[1]):
        if words[i, w] & ~words[j, w]:
            return False
    return True


@njit(cache=True, inline="always")
def _shared(words, boundary, node_mem, node_time, j, i):
    """``(m, t)(∂(L_j) ∩ L_i)``, the part of the new boundary already computed before the stage."""
    mem, time = 0.0, 0.0
    for w in range(words.shape[1]):
        overlap = boundary[j, w] & words[i, w]
        while overlap:
            v = 64 * w + trailing_zeros(overlap)
            mem += node_mem[v]
            time += node_time[v]
            overlap &= overlap - ONE
    return mem, time


@njit(cache=True, inline="always")
def _window_end(values, i, room):
    """One past the last set ``j`` with ``m(L_j) <= m(L_i) + room / 2`` (``KEY[j] >= 2 m(L_j)``)."""
    return np.searchsorted(values[:, MEM], values[i, MEM] + room / 2, side="right")


@njit(cache=True)
def least_cache(words, boundary, values, lists, node_mem, node_time, budget):
    """Per set, the least cache ``m(U)`` with which some chain reaches it within ``budget`` (inf: none)."""
    count = words.shape[0]
    everything = np.arange(count)
    least = np.full(count, np.inf)
    least[0] = 0.0
    for i in range(count - 1):
        cache = least[i]
        if cache == np.inf:
            continue
        last = _window_end(values, i, budget - cache)
        if last <= i + 1:
            continue
        room = budget - cache + 2 * values[i, MEM]
        for j in _candidates(i, last, lists, everything):
            if values[j, KEY] > room or not _holds(words, j, i):
                continue
            after = cache + values[j, MEM_BOUNDARY] - _shared(words, boundary, node_mem, node_time, j, i)[0]
            if after < least[j]:
                least[j] = after
    return least


@njit(cache=True)
def backward(words, boundary, values, lists, node_mem, node_time, budget, least):
    """Per set, from the sets some chain reaches within ``budget`` (``least`` finite), backwards:
    ``most``, the most cache with which a chain can still go on to V (-inf: none can), and the least and
    the most overhead of the rest of such a chain when every stage starts from the least cache that can
    reach its set (a relaxation, so bounds on the overhead still to come from any state of the set)."""
    count = words.shape[0]
    everything = np.arange(count)
    most = np.full(count, -np.inf)
    most[count - 1] = np.inf
    low = np.full(count, np.inf)
    high = np.full(count, -np.inf)
    low[count - 1] = high[count - 1] = 0.0
    for i in range(count - 2, -1, -1):
        if least[i] == np.inf:
            continue
        last = _window_end(values, i, budget - least[i])
        if last <= i + 1:
            continue
        room = budget - least[i] + 2 * values[i, MEM]
        for j in _candidates(i, last, lists, everything):
            if values[j, KEY] > room or most[j] == -np.inf or not _holds(words, j, i):
                continue
            shared_mem, shared_time = _shared(words, boundary, node_mem, node_time, j, i)
            added_cache = values[j, MEM_BOUNDARY] - shared_mem
            if least[i] + added_cache > most[j]:
                continue
            stage = values[j, KEY] - 2 * values[i, MEM]
            most[i] = max(most[i], min(budget - stage, most[j] - added_cache))
            added_time = values[j, TIME] - values[i, TIME] - values[j, TIME_BOUNDARY] + shared_time
            low[i] = min(low[i], added_time + low[j])
            high[i] = max(high[i], added_time + high[j])
    return most, low, high


@njit(cache=True, inline="always")
def _insert(frontier, parents, sizes, j, value, cache, parent_set, parent_slot):
    """Add the state (value, cache) to set ``j``'s Pareto frontier (both minimised), kept sorted by cache
    ascending, so by value strictly descending; dominated states go."""
    size = sizes[j]
    if size and frontier[j, 0, 1] <= cache and frontier[j, 0, 0] <= value:
        return  # the state of least cache has the greatest value: the common rejection, first
    pos = 0
    while pos < size and frontier[j, pos, 1] < cache:
        pos += 1
    if pos > 0 and frontier[j, pos - 1, 0] <= value:
        return
    if pos < size and frontier[j, pos, 1] == cache and frontier[j, pos, 0] <= value:
        return
    end = pos
    while end < size and frontier[j, end, 0] >= value:
        end += 1
    shift = 1 - (end - pos)
    if shift > 0:
        for e in range(size - 1, end - 1, -1):
            frontier[j, e + 1] = frontier[j, e]
            parents[j, e + 1] = parents[j, e]
    elif shift < 0:
        for e in range(end, size):
            frontier[j, e + shift] = frontier[j, e]
            parents[j, e + shift] = parents[j, e]
    frontier[j, pos, 0], frontier[j, pos, 1] = value, cache
    parents[j, pos, 0], parents[j, pos, 1] = parent_set, parent_slot
    sizes[j] = size + shift


@njit(cache=True)
def pareto_chains(words, boundary, values, lists, node_mem, node_time, budget, objective, most, to_go, cutoff):
    """Forward DP keeping, per set, the Pareto frontier of (value, cache) over the chains that reach it
    within ``budget`` and can still finish (``cache <= most``). ``objective``: 0 value = the stage peak
    so far (the least budget), 1 value = overhead (time-centric), 2 value = -overhead (memory-centric).
    A state whose value plus ``to_go`` (a lower bound on the value still to come) exceeds ``cutoff`` is
    dropped. Returns ``(frontier, parents, sizes, over)``: ``frontier[s, k] = (value, cache)``,
    ``parents[s, k] = (set, slot)`` of the state it came from, and ``over`` the least value plus bound
    among the dropped states (the next cutoff worth trying)."""
    count = words.shape[0]
    everything = np.arange(count)
    capacity = 8
    frontier = np.zeros((count, capacity, 2))
    parents = np.zeros((count, capacity, 2), dtype=np.int32)
    sizes = np.zeros(count, dtype=np.int64)
    sizes[0] = 1
    largest = 1
    over = np.inf
    for i in range(count - 1):
        k = sizes[i]
        if k == 0:
            continue
        if largest + k > capacity:  # one set gets at most k states from set i
            capacity = 2 * (largest + k)
            grown = np.zeros((count, capacity, 2))
            grown[:, :frontier.shape[1]] = frontier
            frontier = grown
            grown_parents = np.zeros((count, capacity, 2), dtype=np.int32)
            grown_parents[:, :parents.shape[1]] = parents
            parents = grown_parents
        least = frontier[i, 0, 1]
        best = frontier[i, k - 1, 0]  # the least value at set i
        last = _window_end(values, i, budget - least)
        if last <= i + 1:
            continue
        room = budget - least + 2 * values[i, MEM]
        for j in _candidates(i, last, lists, everything):
            if values[j, KEY] > room or most[j] == -np.inf:
                continue
            # Before the superset test: the stage adds at least t(L_j \ L_i) - t(∂(L_j)) and at most
            # t(L_j \ L_i) of overhead, so a bound on the value at j may already exceed the cutoff.
            if objective == 1:
                bound = best + values[j, TIME] - values[i, TIME] - values[j, TIME_BOUNDARY] + to_go[j]
            elif objective == 2:
                bound = best - values[j, TIME] + values[i, TIME] + to_go[j]
            else:
                bound = -np.inf
            if bound > cutoff:
                over = min(over, bound)
                continue
            if not _holds(words, j, i):
                continue
            stage = values[j, KEY] - 2 * values[i, MEM]
            shared_mem, shared_time = _shared(words, boundary, node_mem, node_time, j, i)
            added_cache = values[j, MEM_BOUNDARY] - shared_mem
            added_time = values[j, TIME] - values[i, TIME] - values[j, TIME_BOUNDARY] + shared_time
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
                _insert(frontier, parents, sizes, j, value, cache + added_cache, i, slot)
                if sizes[j] > largest:
                    largest = sizes[j]
    return frontier, parents, sizes, over
