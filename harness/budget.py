"""Budgets as users write them: null, a byte count (``6000000000``, ``6e9``), a size such as ``6GB`` or ``512MiB``
(decimal units are powers of ten, binary ones of two), or ``device``
(the memory the CUDA device has free). A budget counts the whole device: parameters, buffers and the
input batch included."""

from __future__ import annotations

import re

from harness.measure import nvml_memory

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_budget(budget, device: str = "meta") -> int | None:
    """Bytes, or None for no budget; a malformed budget raises ``ValueError`` saying what is valid."""
    if budget == "device":
        return _free_device_bytes(device)
    if budget is None or isinstance(budget, int) and not isinstance(budget, bool):
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return budget
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(budget))
    unit = match.group(2).upper() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise ValueError(f"malformed budget {budget!r}: give null, a byte count, or a number with a unit "
                         f"({', '.join(u if u in ('B', 'KB', 'MB', 'GB', 'TB') else u[:-2] + 'iB' for u in _UNITS)}),"
                         " for example 6GB or 512MiB, or device")
    size = int(float(match.group(1)) * _UNITS[unit or "B"])
    if size <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return size


def _free_device_bytes(device: str) -> int:
    """The memory the CUDA device has free, read by NVML: asking CUDA would open a context in this process, which
    itself holds hundreds of megabytes of the device a cell then measures on (in a process of its own)."""
    if device != "cuda":
        raise ValueError(f"budget=device means the memory a CUDA device has free; device={device} has none "
                         "to read (give a size such as 6GB)")
    return int(nvml_memory(0).free)
