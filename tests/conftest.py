import sys
from pathlib import Path

# Test helpers import each other (test_simulate uses test_graph's graphs).
sys.path.insert(0, str(Path(__file__).resolve().parent))
