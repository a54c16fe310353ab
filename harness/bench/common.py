"""What the drivers that write ``results/`` share: the header line naming the command that made a table, the
``--rows``/``--from-rows`` options of a driver whose cells write rows, and the figure writer (each strategy's look:
``harness/bench/style.py``)."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def command_of(name: str, argv=None) -> str:
    """The command line that ran driver ``name`` (``harness.bench.NAME``) with ``argv`` (default: this process's)."""
    return " ".join([f"python -m harness.bench.{name}", *(argv if argv is not None else sys.argv[1:])])


def made_by(command: str) -> str:
    """A table's first words: ``Made by `COMMAND` on DATE``; the command rebuilds the table."""
    return f"Made by `{command}` on {datetime.date.today()}"


def add_rows_options(parser: argparse.ArgumentParser, each: str = "run", from_rows: str = "read the rows in --rows"):
    """``--rows`` (where every ``each``'s row goes; a killed run resumes from them) and ``--from-rows`` (run
    nothing: ``from_rows``)."""
    parser.add_argument("--rows", type=Path, default=Path("results/runs"), help=f"where every {each}'s row goes")
    parser.add_argument("--from-rows", action="store_true", help=f"run nothing: {from_rows}")


def save_figure(fig, caption: str, path: Path, ax=None, labels=("", ""), title="", legend_size=8) -> None:
    """Write ``fig`` as a PNG with ``caption`` (the command that made it) in small print at its foot; ``ax``
    given, with its axes' ``labels`` (x, y), ``title``, a light grid and the legend."""
    if ax is not None:
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # outside the axes, so that it hides no point
            ax.legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.text(0.01, 0.01, caption, fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
