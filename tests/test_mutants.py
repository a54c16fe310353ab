"""The mutation check's bugs still apply to the code, and the suite catches one of them end to end."""

import pytest

from harness.bench import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_planted_bug_still_names_a_line_of_the_code(mutant):
    mutants.check(mutant)
    assert mutant.planted != mutant.original


@pytest.mark.slow
def test_the_rng_put_back_planted_is_caught():
    row = mutants.run(mutants.MUTANTS[0])
    assert row["caught"] == "yes", row
