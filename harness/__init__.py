"""The PyTorch side: the zoo (``harness.nets``), ``trace`` (module -> IR), ``execute`` (a Plan, for real),
measurement (``harness.measure``), the entry point (``python -m harness``) and results (``load_results``)."""

from harness.config import Config  # importing it registers config_schema, which configs/config.yaml extends
from harness import nets
from harness.execute import execute
from harness.results import load_results
from harness.trace import trace
from harness.traced import Traced

__all__ = ["Config", "Traced", "execute", "load_results", "nets", "trace"]
