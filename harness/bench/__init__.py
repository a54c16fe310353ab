"""The drivers that write ``results/``: each a ``python -m harness.bench.NAME`` command that makes its cells
(``harness.cell.make_cell``) and runs them through the stages (``harness.run``), or reads their rows, and writes a
table, a figure or both.

``report`` (the tables of rows), ``figure3`` and ``max_batch`` (Kusumoto et al.'s Figure 3 and the largest
batches), ``fidelity`` (predicted against measured peaks), ``peers`` (every strategy beside the ILP),
``optimality`` (every strategy beside the proven optimum in the replay's accounting),
``solvers`` (DP solve times), ``swap`` (Meng et al.'s table), ``coverage`` (every torchvision model),
``frontier`` (memory against step time, eager and compiled), ``cost_models``, ``overhead`` and ``profile_step``
(what the cost model changes, the executor's host work, where a step's time goes), ``fsdp`` (one rank under
FSDP2) and ``mutants`` (planted bugs against the tests). ``paper_numbers`` holds the papers' published figures
the tables print beside ours."""
