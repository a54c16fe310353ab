"""The PyTorch side: the models (``harness.zoo``), tracing (``harness.tracing``: module -> IR), running a plan
(``harness.execute``), measurement (``harness.measure``), a cell and its stages (``harness.cell``, ``harness.run``),
the entry point (``python -m harness``) and results (``load_results``)."""

from harness.config import Config  # importing it registers config_schema, which configs/config.yaml extends
from harness.results import load_results
from harness.tracing.trace import trace
from harness.tracing.traced import Traced
from harness.zoo import nets

__all__ = ["Config", "Traced", "load_results", "nets", "trace"]
