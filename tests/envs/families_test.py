"""Every task family end to end through the evaluation harness.

The oracle policy replays each task's oracle steps as model text; the harness
parses them, runs the real tools through the executor and scores the episode
with the family's verifier. Every family must come out at accuracy 1.
"""

import pytest

from tree_rl.envs import FAMILIES, TaskFamily, make_family
from tree_rl.evaluate import evaluate, replay_oracle_policy


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_oracle_policy_solves_every_family(name):
  family = make_family(name)
  assert isinstance(family, TaskFamily)
  tasks = family.generate("train", 12, seed=3) + family.generate("eval", 12, seed=3)
  report = evaluate(family, tasks, replay_oracle_policy(tasks))
  assert report.metrics["accuracy"] == 1.0, report.table()
  assert report.metrics["unanswerable_rate"] == 0.0
  assert report.metrics["num_episodes"] == 24


def test_unknown_family_lists_the_valid_ones():
  with pytest.raises(ValueError, match="toolworld"):
    make_family("tool_world")
