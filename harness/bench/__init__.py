"""The drivers that write ``results/``: each a ``python -m harness.bench.NAME`` command that runs cells
(``harness.run.run_cell``) or reads their rows and writes a table, a figure or both.

``report`` (the tables of rows), ``figure3`` and ``max_batch`` (Kusumoto et al.'s Figure 3 and the largest
batches), ``fidelity`` (predicted against measured peaks), ``peers`` (every strategy beside the ILP),
``optimality`` (every strategy beside the proven optimum in the replay's accounting),
``solvers`` (DP solve times), ``swap`` (Meng et al.'s table), ``coverage`` (every torchvision model) and
``frontier`` (memory against step time, eager and compiled)."""
