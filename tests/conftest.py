import os
import sys
from pathlib import Path

import numba
import torch

# Test helpers import each other (test_simulate uses test_graph's graphs).
sys.path.insert(0, str(Path(__file__).resolve().parent))

# NOTE [a worker's share of the cores]
# The suite runs one xdist worker per core, and PyTorch's and numba's thread pools each take every core in every
# worker: two workers on two cores ran four busy threads, and each CPU step waited for the other worker's (the
# suite took 18 min; with a thread a worker, 15 min 40 s, the zoo's exactness tests in half the time). Neither
# the figures the tests compare nor the DPs' plans depend on how many threads compute them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _THREADS = max(1, _CORES // _WORKERS)
    torch.set_num_threads(_THREADS)
    numba.set_num_threads(min(_THREADS, numba.config.NUMBA_NUM_THREADS))
