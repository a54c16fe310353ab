"""Load the computational graphs Kusumoto et al. 2019 itself ran on (pfnet-research/recompute's dumps) into the IR.

Format (plain text): a line ``n m`` (variables, function records); n lines ``id bytes name`` (``_`` for an
intermediate value, a path such as ``/predictor/conv3_2/W`` for a parameter); then m records, each a line
``forward`` or ``backward``, a line ``k p``, k lines ``id name`` (inputs), p lines ``id`` (outputs) and the
Chainer function's class name. V is every variable some forward function produces (data, labels and
parameters are dropped), an edge ``u -> w`` when ``u`` is an input of the function producing ``w``, memory
the variable's bytes, cost 10 when the producing class name starts with ``Conv`` else 1. The folder of the
files is ``HARNESS_PAPER_GRAPHS``: they are the authors' data, not this project's, and are not shipped.
"""

from __future__ import annotations

import heapq
import os
from pathlib import Path

from strategies import Graph

ENVIRONMENT = "HARNESS_PAPER_GRAPHS"  # a folder holding the paper's cg_NAME.txt files
NAMES = ("pspnet", "unet", "resnet50", "resnet152", "vgg19", "densenet", "googlenet")


def load(path: str | Path) -> Graph:
    lines = iter(Path(path).read_text().splitlines())
    n_vars, n_funcs = map(int, next(lines).split())
    size = {}
    for _ in range(n_vars):
        var, nbytes, _name = next(lines).split(maxsplit=2)
        size[int(var)] = int(nbytes)
    producers = []  # (inputs, outputs, class name)
    for _ in range(n_funcs):
        direction = next(lines).strip()
        k, p = map(int, next(lines).split())
        inputs = [int(next(lines).split()[0]) for _ in range(k)]
        outputs = [int(next(lines).split()[0]) for _ in range(p)]
        class_name = next(lines).strip()
        next(lines)  # attributes (JSON)
        if direction == "forward":
            producers.append((inputs, outputs, class_name))
    # The dump's order is not topological: number the variables in a topological order (Kahn's
    # algorithm, ties broken by the dump's order, so the numbering is deterministic).
    produced_by = {out: f for f, (_, outputs, _) in enumerate(producers) for out in outputs}
    feeds = [[produced_by[i] for i in inputs if i in produced_by] for inputs, _, _ in producers]
    waiting = [len(set(f)) for f in feeds]
    consumers = [[] for _ in producers]
    for f, sources in enumerate(feeds):
        for source in set(sources):
            consumers[source].append(f)
    ready = [f for f, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    node_of, mem, cost, names, edges = {}, [], [], [], []
    while ready:
        f = heapq.heappop(ready)
        inputs, outputs, class_name = producers[f]
        for out in outputs:
            node_of[out] = len(mem)
            mem.append(size[out])
            cost.append(10.0 if class_name.startswith("Conv") else 1.0)
            names.append(f"{class_name}:{out}")
            edges += [(node_of[i], node_of[out]) for i in inputs if i in node_of]
        for consumer in consumers[f]:
            waiting[consumer] -= 1
            if waiting[consumer] == 0:
                heapq.heappush(ready, consumer)
    assert len(mem) == sum(len(o) for _, o, _ in producers), f"{path}: the forward functions form a cycle"
    return Graph(mem_bytes=mem, cost=cost, edges=edges, names=names)


def available(directory: str | Path | None = None) -> dict[str, Path]:
    """The paper graphs present in ``directory`` (default: ``$HARNESS_PAPER_GRAPHS``; empty where it is unset or
    the folder is absent)."""
    directory = directory or os.environ.get(ENVIRONMENT)
    if not directory:
        return {}
    directory = Path(directory)
    return {name: directory / f"cg_{name}.txt" for name in NAMES if (directory / f"cg_{name}.txt").exists()}
