"""Each strategy's look in every figure and notebook; no backend is chosen here, so a notebook may import it.

NOTE [one look for every figure]
Each strategy has one colour and one marker in every figure and notebook (``style``); a variant of it (a DP's mode
mc, a compiled run) is told by its line or fill, never by another colour. Legends sit outside the axes and list only
what was drawn, and series that fall on one another are drawn so that each stays visible (a hollow marker larger
than a filled one, lines of the same value a few points apart).
"""

from __future__ import annotations

# strategy -> (colour, marker); others get grey and a dot
STYLES = {
    "vanilla": ("0.15", "o"), "liveness_only": ("0.55", "s"), "chen_sqrt": ("tab:blue", "^"),
    "chen_greedy": ("tab:cyan", "v"), "approx_dp": ("tab:red", "o"), "exact_dp": ("tab:orange", "D"),
    "optimal": ("tab:green", "*"), "ilp_optimal": ("tab:olive", "P"), "brute_force": ("0.7", "x"),
    "swap": ("tab:purple", "X"), "torch_checkpoint_blocks": ("tab:brown", "s"),
    "torch_checkpoint_sequential": ("tab:pink", "<"), "torch_compile_budget": ("teal", ">"),
    "sac_ops": ("goldenrod", "h"), "megatron_selective": ("navy", "p"),
}


def style(strategy: str) -> dict:
    """The colour and marker of ``strategy`` (a name, or a table's label such as ``approx_dp (mc)``) in every
    figure (NOTE [one look for every figure])."""
    colour, marker = STYLES.get(strategy.split(" ")[0].rstrip(","), ("0.4", "."))
    return {"color": colour, "marker": marker}


def line_style(label: str) -> str:
    """A line's dash: solid, or dashed for a DP's memory-centric mode."""
    return "--" if "(mc" in label else "-"
