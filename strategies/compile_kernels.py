"""Compile the DPs' numba kernels (``dp_kernels``) into numba's cache, beside their source:
``python -m strategies.compile_kernels``."""

from __future__ import annotations

from strategies import Graph, least_budget, solve


def compile_all() -> None:
    """Compile every kernel into numba's cache (beside this file) by running both DPs, in both modes, at their
    minimal budget and at a looser one, on a small graph: a first solve then loads them instead of spending
    tens of seconds compiling (``make`` runs this module once it has installed the project)."""
    blocks = 8  # residual blocks: lower sets beyond the principal ones, for the exact DP
    edges = [(3 * b + i, 3 * b + j) for b in range(blocks) for i, j in ((0, 1), (1, 2), (0, 2), (2, 3))]
    nodes = range(3 * blocks + 1)
    graph = Graph(mem_bytes=[4 + v % 5 for v in nodes], cost=[1 + v % 3 for v in nodes], edges=edges)
    for name in ("approx_dp", "exact_dp"):
        for mode in ("tc", "mc"):
            solve(name, graph, 2 * least_budget(name, graph, mode=mode), mode=mode)
            solve(name, graph, mode=mode)


if __name__ == "__main__":
    compile_all()
