"""The result store: one flat JSON row per run, written atomically; ``load_results`` reads them all."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

SCHEMA_VERSION = 2  # 2: rows carry predicted_step_flops; resume re-runs rows of an older version


class Status(str, Enum):
    """How a cell ended; a row's ``status`` (written as its value)."""

    OK = "ok"  # measured
    OOM = "oom"  # the device ran out of memory
    INFEASIBLE = "infeasible"  # no plan of the strategy fits the budget (the row names the least), or it cannot run
    TIMEOUT = "timeout"  # the solver ran out of its time
    ERROR = "error"  # anything else: the row holds the exception

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


FINAL = (Status.OK, Status.OOM, Status.INFEASIBLE, Status.TIMEOUT)  # a resumed sweep runs these cells no more


def cell_name(row: dict) -> str:
    """The file name of a run's row: one file per (net, strategy and its options, batch, size, budget, cost
    model, device, dtype where not float32, compiled or not, sharding where there is some)."""
    budget = "budgetauto" if row["budget_bytes"] is None else f"{row['budget_bytes']}B"
    options = "".join(f"__{key}-{value}" for key, value in sorted(row.get("options", {}).items()))
    net_options = "".join(f"__{key}-{value}" for key, value in _flat(row.get("net_options") or {}))
    rest = (f"__{row['strategy']}{options}__b{row['batch_size']}__s{row['image_size']}__{budget}"
            f"__{row['cost_model']}__{row['device']}{_dtype(row)}{'__compiled' if row.get('compiled') else ''}"
            f"{_sharding(row)}.json")
    if len(row["net"] + net_options + rest) > 230:  # a name holds 255 bytes, its temporary 14 more: a digest
        net_options = "__options-" + hashlib.sha1(net_options.encode()).hexdigest()[:16]
    net = (row["net"] + net_options).replace("/", "_").replace(" ", "")  # a net's options name a file, not a folder
    return net + rest


def _sharding(row: dict) -> str:
    if row.get("shard", "none") == "none":
        return ""
    return f"__{row['shard']}-w{row['world_size']}__{row['optimizer']}"


def _dtype(row: dict) -> str:
    dtype = row.get("dtype") or "float32"  # rows from before the dtype key trained in float32
    return "" if dtype == "float32" else f"__{dtype}"


def stored_path(rows_dir: str | os.PathLike, net: str, strategy: str, *, batch_size: int, image_size: int,
                device: str, budget_bytes: int | None = None, options: dict | None = None,
                compiled: bool = False, cost_model: str = "paper", dtype: str = "float32") -> Path:
    """Where ``run_cell`` wrote (or would write) the row of a zoo net's cell under ``rows_dir`` (default
    net options; ``dtype``, the net's own): how a driver's ``--from-rows`` finds it without running anything."""
    key = {"net": net, "strategy": strategy, "options": options or {}, "batch_size": batch_size,
           "image_size": image_size, "budget_bytes": budget_bytes, "cost_model": cost_model, "device": device,
           "compiled": compiled, "dtype": dtype}
    return Path(rows_dir) / cell_name(key)


def _flat(options: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested options as sorted ``(a.b, value)`` pairs: ``{"kwargs": {"image_size": 32}}`` names
    ``kwargs.image_size-32`` in a file name."""
    pairs = []
    for key, value in sorted(options.items()):
        pairs += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return pairs


def mode_of(options: dict) -> str:
    """What tells a strategy's variants apart in tables: a DP's mode (and Kusumoto et al.'s memory model, where it
    runs on it), the plan swap runs on, or the op policy's variant."""
    mode = options.get("mode") or (f"on {options['base']}" if options.get("base") else "")
    mode = mode or ("every 2nd mm" if options.get("every_second_mm") else "")
    if options.get("memory_model") == "paper":
        return f"{mode}, paper model" if mode else "paper model"
    return mode


def label(strategy: str, options: dict) -> str:
    """A strategy as tables name it: ``approx_dp (mc)``, ``swap (on approx_dp)``, ``vanilla``."""
    mode = mode_of(options)
    return strategy + (f" ({mode})" if mode else "")


def write_row(row: dict, directory: str | os.PathLike, name: str | None = None) -> Path:
    """Write ``row`` to ``directory/name`` (default ``cell_name(row)``); a reader never sees half a file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def dump(out):
        json.dump(row, out, indent=1, sort_keys=True)
        out.write("\n")

    return write_atomically(directory / (name or cell_name(row)), dump)


def write_atomically(path: Path, write) -> Path:
    """Call ``write(file)`` so that ``path`` is the old file or the new one for any reader, never half of one."""
    # The text goes to a hidden temporary beside it (one file system: the rename is atomic), which no table
    # reads (they read *.json); a failed write removes it, a killed one leaves it hidden.
    hidden = dict(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    with tempfile.NamedTemporaryFile("w", **hidden) as out:
        try:
            write(out)
        except BaseException:
            out.close()
            os.unlink(out.name)
            raise
    os.chmod(out.name, 0o666 & ~umask())  # mkstemp makes 0600; teammates on a shared file system read rows
    os.replace(out.name, path)
    return path


def umask() -> int:
    """The process's umask (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_row(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """Every row under ``path`` (a row file or a folder searched recursively), one DataFrame row each."""
    import pandas as pd  # a cell writes its row without pandas (NOTE [imported where used] in harness/zoo/nets.py)

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.rglob("*.json"))
    rows = [read_row(f) for f in files]
    rows = [r for r in rows if isinstance(r, dict) and "schema_version" in r]
    return pd.DataFrame(rows)


HOST_BOUND = 1.10  # a step whose wall time is above this times its GPU kernel time is host-bound


TIMING_PROTOCOL = ("Timing: after the warm-up steps, each timed step starts on an idle GPU and is timed by CUDA "
                   "events to its end; median and IQR over the timed steps. In rows of code 51b58c8 and later "
                   "(the rows' `git_commit`) Python's cycle collector runs between timed steps, never inside one.")
DEVICE_TIME_NOTE = (f"{TIMING_PROTOCOL} "
                    "`GPU ms`: the GPU's kernel time in one step profiled after the timed ones (empty for rows "
                    "measured before rows carried it); `GPU busy`: that over the wall time; `host-bound`: wall time "
                    f"over {HOST_BOUND:g}x the kernel time.")


def device_time(row) -> dict:
    """A timed cuda row's GPU side, for the tables beside its wall time: ``GPU ms`` (its kernels' time in one
    profiled step), ``GPU busy`` (that over the wall time) and ``host-bound`` ("yes" where the wall time is over
    ``HOST_BOUND`` times the kernel time: the harness's host work, not the strategy, sets the time); empty for
    rows without a kernel time (meta and cpu rows, and rows measured before the GPU's time was taken)."""
    kernel_ms, wall_ms = row.get("gpu_kernel_ms"), row.get("step_time_ms")
    if not is_number(kernel_ms) or not is_number(wall_ms) or kernel_ms <= 0:
        return {"GPU ms": None, "GPU busy": None, "host-bound": ""}
    return {"GPU ms": kernel_ms, "GPU busy": kernel_ms / wall_ms,
            "host-bound": "yes" if wall_ms > HOST_BOUND * kernel_ms else "no"}


def is_number(value) -> bool:
    """Whether a table's cell holds a number (not None, and not the NaN a missing value is in a DataFrame)."""
    return value is not None and not math.isnan(value)
