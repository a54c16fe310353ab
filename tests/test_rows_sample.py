"""Rows on meta are the pipeline's output: a committed sample of them (``tests/rows_sample/``, cells at the suite's
sizes, every kind of plan) must come out again to the byte, whatever is refactored between the model and the row.
Fields of the run's circumstances (time, host, commit) are left out. Made again, after a change that is meant to
change them, with ``python tests/test_rows_sample.py``."""

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.run import run_cell

SAMPLE = Path(__file__).parent / "rows_sample"
CELLS = [("resnet50", "vanilla", {}, None), ("resnet50", "liveness_only", {}, None),
         ("resnet50", "chen_sqrt", {}, None), ("resnet50", "chen_greedy", {}, None),
         ("resnet50", "approx_dp", {"mode": "tc"}, None), ("resnet50", "approx_dp", {"mode": "mc"}, None),
         ("resnet50", "exact_dp", {"mode": "mc"}, None), ("resnet50", "approx_dp", {"mode": "tc"}, 205_600_000),
         ("resnet50", "swap", {}, "150MB"),  # infeasible: that row too
         ("resnet50", "torch_checkpoint_blocks", {}, None), ("vgg19", "approx_dp", {"mode": "tc"}, "1.2GB")]
CIRCUMSTANCES = {"timestamp", "hostname", "git_commit", "git_dirty", "solve_time_s", "wall_time_s", "row_path",
                 "torch_version"}


def rows() -> list[dict]:
    out = []
    for net, strategy, options, budget in CELLS:
        row = run_cell(net, strategy, batch_size=2, image_size=32, options=options, budget=budget)
        out.append({key: value for key, value in row.items() if key not in CIRCUMSTANCES})
    return out


def test_the_committed_sample_of_rows_comes_out_again_to_the_byte():
    made_with = json.loads((SAMPLE / "torch_version.json").read_text())
    if made_with != torch.__version__:
        pytest.skip(f"the sample was made with torch {made_with}, this is {torch.__version__}: an allocation may differ "
                    "(python tests/test_rows_sample.py makes it again)")
    expected = [json.loads(path.read_text()) for path in sorted(SAMPLE.glob("cell_*.json"))]
    assert len(expected) == len(CELLS)
    for want, got in zip(expected, json.loads(json.dumps(rows()))):
        assert got == want, (want["net"], want["strategy"], want["options"],
                             {key: (want.get(key), got.get(key)) for key in want.keys() | got.keys()
                              if want.get(key) != got.get(key)})


if __name__ == "__main__":
    for path in SAMPLE.glob("*.json"):
        path.unlink()
    for k, row in enumerate(rows()):
        (SAMPLE / f"cell_{k:02d}.json").write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    (SAMPLE / "torch_version.json").write_text(json.dumps(torch.__version__) + "\n")
    print(f"{len(CELLS)} rows in {SAMPLE}", file=sys.stderr)
