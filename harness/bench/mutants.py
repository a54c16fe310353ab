"""Does the suite catch the bugs that matter most? ``python -m harness.bench.mutants OUT_STEM [--only NAME]``.

Each mutant in ``MUTANTS`` is one named bug planted in a scratch copy of the repository (its tracked files): a
line of the executor, the simulator, a peer, the DP's kernels, the budgets or the result store replaced, as a
careless change would. The tests named beside it run
there; the mutant is caught when they fail (pytest's exit status 1: a test failed, not a copy that no longer
imports). Writes ``OUT_STEM.md``. Every mutant must be caught; a change that moves a planted line breaks
``tests/test_mutants.py`` until the list follows the code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.bench.common import command_of, made_by

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository's root
    original: str  # text that occurs exactly once in the file
    planted: str
    tests: tuple[str, ...]  # pytest node ids, relative to the root


MUTANTS = [
    Mutant("the program's RNG state is not put back after a recomputation that replayed draws",
           "harness/execute/side_effects.py",
           "    state = rng_state(rng)\n    try:\n        yield\n    finally:\n        set_rng_state(state)\n",
           "    state = rng_state(rng)\n    yield\n",
           ("tests/test_randomness.py",)),
    Mutant("a recomputed call draws from wherever the generator is, not from the state its forward call found",
           "harness/execute/side_effects.py",
           "        if node.name in self.rng_states:\n            set_rng_state(self.rng_states[node.name])\n",
           "",
           ("tests/test_randomness.py",)),
    Mutant("what a layer saves besides its value counts 0 bytes in the forward replay",
           "strategies/replay.py",
           '            allocs.append(((Buffer.EXTRA, v), graph.profile.saved_extra_bytes[v]))\n',
           '            allocs.append(((Buffer.EXTRA, v), 0))\n',
           ("tests/test_accounting.py::test_predicted_peak_is_the_measured_one_to_the_byte",)),
    Mutant("a recomputed BatchNorm starts from the state its forward call left, and updates it again",
           "harness/execute/side_effects.py",
           "                for m, name in held:\n"
           "                    (m or self.module)._buffers[name] = found[i]\n"
           "                placed.append((held, t))\n"
           "                given[id(t)] = found[i]\n",
           "                pass\n",
           ("tests/test_any_model.py::test_side_effects_are_replayed_by_mechanism",
            "tests/test_any_model.py::test_a_layer_that_reads_the_state_it_writes_is_recomputed_from_the_state_its_"
            "forward_found")),
    Mutant("a layer rerun to collect what it saves gets leaf inputs even where it writes an input in place",
           "harness/execute/step.py",
           "fresh[a.name] = _Fresh.apply(leaf) if self.effects.writes_inputs.get(node.name, True) else leaf\n",
           "fresh[a.name] = leaf\n",
           ("tests/test_any_model.py::test_side_effects_are_replayed_by_mechanism",)),
    Mutant("Megatron's attention checkpoint does not replay the RNG state, so the recomputed dropout draws anew",
           "harness/execute/peers.py",
           "            return checkpoint(func, *args, use_reentrant=False, **kwargs)\n",
           "            return checkpoint(func, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)\n",
           ("tests/test_transformer_peers.py::test_each_peer_is_exact_under_dropout_in_float64",)),
    Mutant("the op policy saves every matmul even where every second one is to be recomputed",
           "harness/execute/peers.py",
           'skip = policy == "ops_every_second_mm" and counts[ctx.is_recompute] % 2 == 0',
           "skip = False",
           ("tests/test_transformer_peers.py::test_the_op_policy_recomputes_no_matmul_and_every_second_mm_half_"
            "of_them",)),
    Mutant("a value a selective policy saves is rebuilt by its block's recomputation in the replay",
           "strategies/replay.py",
           "rebuilt |= stage & plan.kept & ~plan.selective &",
           "rebuilt |= stage & plan.kept &",
           ("tests/test_transformer_peers.py::test_on_meta_each_peer_is_predicted_as_checkpoint_per_block_is",)),
    Mutant("a saved value past the early stop goes at its block's recomputation, not with checkpoint's frame",
           "strategies/replay.py",
           "                                  | set(members(unpopped)))",
           "                                  )",
           ("tests/test_transformer_peers.py::test_on_meta_each_peer_is_predicted_as_checkpoint_per_block_is",)),
    Mutant("released parameter gradients stay to the step's end in the replay",
           "strategies/replay_steps.py",
           "        if self.graph.profile.param_grads_released:\n            for u in self.param_owners[v]:",
           "        if False:\n            for u in self.param_owners[v]:",
           ("tests/test_sharding.py::test_released_gradients_go_as_their_backward_ends_and_a_shared_ones_after_its_"
            "last_reader",)),
    Mutant("the DP's forward pass never looks at its deadline",
           "strategies/dp_kernels.py",
           "        if deadline < np.inf and _now() > deadline:  # between blocks: prange bodies cannot look at "
           "a clock\n            raise TimeoutError",
           "        if False:\n            raise TimeoutError",
           ("tests/test_dp.py::test_every_long_pass_stops_past_its_deadline",)),
    Mutant("a gigabyte in a budget is 2**30 bytes",
           "harness/budget.py",
           '"GB": 10**9,',
           '"GB": 2**30,',
           ("tests/test_budget.py",)),
    Mutant("under compile, the ops traced before an IR node's mark are left untagged, so a recomputed node's "
           "other ops may be saved",
           "harness/execute/compiled.py",
           "            for op in pending:\n                node_of[op] = v\n",
           "",
           ("tests/test_compiled.py::test_each_ir_nodes_ops_are_tagged_as_the_plan_says",)),
    Mutant("a row is written in place, so a write that fails halfway destroys the row that was there",
           "harness/results.py",
           '    with tempfile.NamedTemporaryFile("w", **hidden) as out:',
           '    with open(path, "w") as out:',
           ("tests/test_results.py::test_an_exception_inside_the_dump_leaves_the_old_row_and_no_temporary",)),
    Mutant("chen_sqrt takes a candidate whose memory reaches the threshold, not one that passes it",
           "strategies/chen_sqrt.py",
           "if i == len(candidates) - 1 or size > threshold:",
           "if i == len(candidates) - 1 or size >= threshold:",
           ("tests/test_pinned_plans.py::test_chen_sqrt_on_a_chain_of_sixteen",)),
    Mutant("chen_greedy's next threshold drops memonger's halving, sqrt(x y) for sqrt(x y / 2)",
           "strategies/chen_greedy.py",
           "threshold = math.isqrt(kept * largest // 2)",
           "threshold = math.isqrt(kept * largest)",
           ("tests/test_pinned_plans.py::test_chen_greedy_searches_memonger_s_thresholds_and_takes_the_least_peak",)),
    Mutant("swap starts a hidden copy one backward earlier than it must",
           "strategies/swap.py",
           "need[u] + 1) - 1, 0)",
           "need[u] + 1) - 2, 0)",
           ("tests/test_pinned_plans.py::test_swap_moves_the_longest_lived_values_and_starts_each_copy_as_late_as_it_hides",)),
    Mutant("exact_dp searches the principal lower sets alone, as approx_dp does",
           "strategies/exact_dp.py",
           "        family = all_lower_set_words(graph, deadline=deadline)\n",
           "        family = words_of(principal, len(graph))\n",
           ("tests/test_pinned_plans.py::test_on_a_diamond_only_the_exact_family_ends_a_stage_after_both_branches",)),
    Mutant("approx_dp runs time-centric whatever mode it is given",
           "strategies/approx_dp.py",
           "budget_bytes, options.mode, \"approx_dp\"",
           "budget_bytes, \"tc\", \"approx_dp\"",
           ("tests/test_pinned_plans.py::test_the_dps_by_equation_2_on_a_chain_of_four_and_the_optimum_below_them",)),
    Mutant("at equal replayed peaks the time-centric DP takes the tightest equation (2) budget's plan, not the "
           "least overhead",
           "strategies/lower_set_dp.py",
           "replays[b].overhead_cost if mode == \"tc\" else b))",
           "b))",
           ("tests/test_pinned_plans.py::test_on_a_diamond_only_the_exact_family_ends_a_stage_after_both_branches",)),
    Mutant("optimal's finest plan for a kept set stages the readers of kept values with them, not those of "
           "discarded ones",
           "strategies/optimal.py",
           "    for u in members_of(graph.all_nodes & ~kept):\n",
           "    for u in members_of(graph.all_nodes & kept):\n",
           ("tests/test_pinned_plans.py::test_the_dps_by_equation_2_on_a_chain_of_four_and_the_optimum_below_them",)),
    Mutant("the ILP recomputes a value's inputs in its stage even where it holds them",
           "strategies/ilp_optimal.py",
           "[(R[t, k], 1.0), (R[t, i], -1.0), (S[t, i], -1.0)]",
           "[(R[t, k], 1.0), (R[t, i], -1.0)]",
           ("tests/test_ilp.py::test_ilp_is_never_worse_than_exact_dp_at_the_same_budget",)),
    Mutant("vanilla keeps the canonical cache of its one stage, nothing, and recomputes everything",
           "strategies/vanilla.py",
           "strategy=\"vanilla\", kept=graph.all_nodes,",
           "strategy=\"vanilla\", kept=None,",
           ("tests/test_pinned_plans.py::test_vanilla_and_liveness_only_keep_everything_in_one_stage",)),
    Mutant("liveness_only reports the liveness peak as the size without liveness",
           "strategies/liveness_only.py",
           "\"naive_bytes\": simulate(graph, plan, liveness=False).peak_bytes,",
           "\"naive_bytes\": simulate(graph, plan, liveness=True).peak_bytes,",
           ("tests/test_pinned_plans.py::test_vanilla_and_liveness_only_keep_everything_in_one_stage",)),
    Mutant("checkpoint per block joins consecutive nodes outside any block into one stage",
           "strategies/torch_checkpoint_blocks.py",
           "if block is not None and block == previous:",
           "if block == previous:",
           ("tests/test_pinned_plans.py::test_the_peers_stages_follow_the_blocks_and_pytorch_s_segments",)),
    Mutant("checkpoint_sequential's segments round their size up, where PyTorch's round it down",
           "strategies/torch_checkpoint_sequential.py",
           "    size = steps // segments\n",
           "    size = -(-steps // segments)\n",
           ("tests/test_pinned_plans.py::test_the_peers_stages_follow_the_blocks_and_pytorch_s_segments",)),
    Mutant("the op policy's plan saves the odd matmuls of a block where it is to save the first of each pair",
           "strategies/sac_ops.py",
           "count % 2 == 0",
           "count % 2 == 1",
           ("tests/test_transformer_peers.py::test_the_op_policys_plan_on_a_hand_worked_block",)),
    Mutant("Megatron's plan keeps the canonical cache, dropping what the attention cores' neighbours save",
           "strategies/megatron_selective.py",
           "strategy=\"megatron_selective\", kept=graph.all_nodes,",
           "strategy=\"megatron_selective\", kept=None,",
           ("tests/test_transformer_peers.py::test_the_op_policys_plan_on_a_hand_worked_block",)),
    Mutant("the compile peer's plan claims a prediction, though the partitioner decides its memory",
           "strategies/torch_compile_budget.py",
           "runner=RUNNER, predicted=False,",
           "runner=RUNNER, predicted=True,",
           ("tests/test_peers.py::test_compile_budget_rows",)),
    Mutant("a recomputed value no backward reads is held to the end of its stage's recomputation",
           "harness/execute/layout.py",
           "frees=_frees(order, finals),",
           "frees=_frees(order, finals | {n.name for n in order}),",
           ("tests/test_accounting.py::test_each_recomputed_value_goes_when_the_replay_lets_it_go",)),
    Mutant("under compile, an op that reads a buffer the step writes is left to the partitioner",
           "harness/execute/compiled.py",
           "    for op in _reads_of_written_inputs(graph):\n",
           "    for op in _reads_of_written_inputs(graph)[:0]:\n",
           ("tests/test_compiled.py::test_each_ir_nodes_ops_are_tagged_as_the_plan_says",)),
    Mutant("swap's copies in host memory count in the device's measured peak",
           "harness/measure.py",
           'DEVICE_PARTS = ("params", "grads", "activations")',
           'DEVICE_PARTS = ("params", "grads", "activations", "host")',
           ("tests/test_swap.py::test_the_executor_moves_what_the_plan_says_and_the_peak_follows",)),
    Mutant("in the user's training loop, a recomputed dropout draws from wherever the generator is",
           "harness/execute/side_effects.py",
           "        if node.name in self.rng_states:\n            set_rng_state(self.rng_states[node.name])\n",
           "",
           ("tests/test_train.py::test_twenty_adamw_steps_equal_plain_pytorch_training",)),
    Mutant("a plan file made for another model loads without a word",
           "harness/plans.py",
           "    difference = first_difference(body[\"graph\"], fingerprint(traced, example_input))\n",
           "    difference = None\n",
           ("tests/test_train.py::test_a_plan_saved_loads_back_and_is_refused_elsewhere",)),
    Mutant("as checkpoint regions, a recomputed dropout draws from the state the cached calls before it left",
           "harness/train.py",
           "                    if recompute:\n                        set_rng_state(seen[node.name])\n",
           "                    if recompute:\n                        pass\n",
           ("tests/test_train.py::test_as_checkpoint_regions_a_recomputed_draw_after_a_cached_one_gets_the_state_its_"
            "forward_found",)),
]


def check(mutant: Mutant, root: Path = ROOT) -> None:
    """Raise ``ValueError`` unless ``mutant.original`` occurs exactly once in its file."""
    count = (root / mutant.path).read_text().count(mutant.original)
    if count != 1:
        raise ValueError(f"mutant {mutant.name!r}: its original text occurs {count} times in {mutant.path}, not "
                         "once; update MUTANTS in harness/bench/mutants.py to the code as it is")


def scratch_copy(destination: Path, root: Path = ROOT) -> None:
    """The repository's tracked files (and untracked ones git does not ignore) under ``destination``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        source = root / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def run(mutant: Mutant, root: Path = ROOT) -> dict:
    """Plant ``mutant`` in a scratch copy, run its tests there: (caught, seconds, the tests' last line)."""
    check(mutant, root)
    with tempfile.TemporaryDirectory(prefix="mutant-") as scratch:
        scratch = Path(scratch)
        scratch_copy(scratch, root)
        path = scratch / mutant.path
        path.write_text(path.read_text().replace(mutant.original, mutant.planted))
        env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
        start = time.perf_counter()
        done = subprocess.run([os.path.abspath(sys.executable), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *mutant.tests],
                              cwd=scratch, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"mutant": mutant.name, "file": mutant.path, "tests": ", ".join(mutant.tests),
            "caught": "yes" if done.returncode == 1 else f"no (pytest exit {done.returncode})",
            "seconds": seconds, "pytest": last}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.mutants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--only", help="run the mutants whose name contains this")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or args.only in m.name]
    if not chosen:
        parser.error(f"no mutant's name contains {args.only!r}; the mutants: " + "; ".join(m.name for m in MUTANTS))
    rows = []
    for mutant in chosen:
        rows.append(run(mutant))
        print(f"{rows[-1]['caught']:>4}  {mutant.name}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    table = pd.DataFrame(rows)
    caught = (table.caught == "yes").sum()
    command = command_of("mutants", argv)
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}, on cpu. Each bug planted alone in a scratch copy; "
        f"caught: its tests fail.\n\nCaught {caught} of {len(table)}.\n\n"
        + table.to_markdown(index=False, floatfmt=".0f") + "\n")
    print(f"caught {caught} of {len(table)}: {args.out_stem}.md")
    if caught < len(table):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
