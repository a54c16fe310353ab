"""Budgets as users write them (``harness/budget.py``): every unit and form to the bytes it states, the same
bytes on the command line as in Python, and a clear refusal of anything else."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.budget import parse_budget
from harness.cell import make_cell

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("written, nbytes", [
    (None, None), (6_000_000_000, 6_000_000_000), ("6000000000", 6_000_000_000), ("6e9", 6_000_000_000),
    (6e9, 6_000_000_000), ("1.5e3", 1_500), ("512B", 512), ("6KB", 6_000), ("6MB", 6_000_000),
    ("6GB", 6_000_000_000), ("6TB", 6_000_000_000_000), ("6KiB", 6 * 1024), ("6MiB", 6 * 1024 ** 2),
    ("6GiB", 6 * 1024 ** 3), ("6TiB", 6 * 1024 ** 4), ("6gb", 6_000_000_000), (" 6 GiB ", 6 * 1024 ** 3),
    ("0.5GB", 500_000_000), ("12.8GB", 12_800_000_000),
])
def test_each_form_is_the_bytes_it_states(written, nbytes):
    assert parse_budget(written) == nbytes


@pytest.mark.parametrize("written", ["6XB", "six GB", "6 G B", "-1GB", "GB", "6e", True])
def test_anything_else_is_refused_naming_the_units(written):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(written)
    if isinstance(written, str) and written not in ("-1GB",):
        with pytest.raises(ValueError, match=r"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB\), for example 6GB"):
            parse_budget(written)


@pytest.mark.parametrize("written", [0, -5, "0GB", "0.0000000001B"])
def test_a_budget_of_nothing_is_refused(written):
    with pytest.raises(ValueError, match="budget must be positive"):
        parse_budget(written)


def test_device_means_the_free_memory_of_a_cuda_device_only():
    with pytest.raises(ValueError, match="budget=device means the memory a CUDA device has free; device=meta"):
        parse_budget("device", "meta")


@pytest.mark.parametrize("override, nbytes", [("budget=6GB", 6_000_000_000), ("budget=6GiB", 6 * 1024 ** 3),
                                              ("budget=6e9", 6_000_000_000), ("budget=6000000000", 6_000_000_000),
                                              ("budget=null", None)])
def test_the_command_line_and_the_row_mean_the_same_bytes(override, nbytes):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        config = compose("config", overrides=["+net=resnet50", "+strategy=vanilla", override])
    cell = make_cell("resnet50", "vanilla", budget=config.budget)
    assert cell.budget_bytes == nbytes == parse_budget(override.split("=")[1] if nbytes else None)


def test_device_is_read_by_nvml_from_the_first_visible_device(monkeypatch):
    """``budget=device`` asks NVML, not CUDA (which would open a context in the parent of every cell), for the
    device a cell will see first: an index or a UUID in CUDA_VISIBLE_DEVICES; a CUDA index names the device that
    list gives it."""
    import sys
    import types

    asked = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: asked.append(("index", index)) or "handle",
        nvmlDeviceGetHandleByUUID=lambda uuid: asked.append(("uuid", uuid)) or "handle",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(free=7_000_000_000))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    for visible, want in ((None, ("index", 0)), ("2,3", ("index", 2)), ("GPU-1a2b", ("uuid", "GPU-1a2b"))):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert parse_budget("device", "cuda") == 7_000_000_000 and asked.pop() == want
    from harness.measure import nvml_memory  # the measurement's NVML figure, by the device's CUDA index

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvml_memory(1).free == 7_000_000_000 and asked.pop() == ("index", 3)


def test_the_least_budget_is_asked_for_and_is_the_edge_of_feasible():
    """``least_budget`` gives, in the bytes every budget counts, the least any plan of the strategy fits: the cell
    runs at it and not a byte below, and an infeasible row names the same figure."""
    from harness.run import least_budget, run

    cell = make_cell("resnet50", "approx_dp", batch_size=2, image_size=32, options={"mode": "tc"})
    least = least_budget(cell)
    at, below = run(cell.but(budget_bytes=least)), run(cell.but(budget_bytes=least - 1))
    assert at["status"] == "ok" and at["measured_peak_bytes"] <= least
    assert below["status"] == "infeasible" and below["min_feasible_bytes"] == least
    under_static = run(cell.but(budget_bytes=at["static_bytes"] // 2))  # not even the parameters fit
    assert under_static["status"] == "infeasible" and under_static["min_feasible_bytes"] == least
