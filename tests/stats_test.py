"""Paired statistics: the exact McNemar test against a binomial tail computed by hand, and the
paired bootstrap interval, on the figures the main job reports."""

import math

import numpy as np
import pytest

from tree_rl import stats


def test_mcnemar_exact_matches_the_binomial_tail():
  # 7 gained, 0 lost: p = 2 * 0.5**7.
  assert stats.mcnemar_exact(7, 0) == pytest.approx(2 * 0.5**7)
  # 8 gained, 2 lost: 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * 56 / 1024.
  assert stats.mcnemar_exact(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 1024)
  assert stats.mcnemar_exact(2, 8) == stats.mcnemar_exact(8, 2)
  assert stats.mcnemar_exact(3, 3) == 1.0 and stats.mcnemar_exact(0, 0) == 1.0
  # A 3-task gain out of 32 with nothing lost cannot be separated at 0.05.
  assert stats.mcnemar_exact(3, 0) == 0.25
  with pytest.raises(ValueError, match="gained=-1"):
    stats.mcnemar_exact(-1, 2)


def test_paired_bootstrap_is_seeded_and_covers_the_mean():
  diffs = np.array([1.0] * 8 + [-1.0] * 2 + [0.0] * 22)
  low, high = stats.paired_bootstrap(diffs)
  assert (low, high) == stats.paired_bootstrap(diffs)  # the same seed, the same interval
  assert low < diffs.mean() < high
  assert low <= 0.0  # 8 gained against 2 lost over 32 tasks: McNemar p = 0.11, not separated
  assert stats.paired_bootstrap(np.array([1.0] * 10 + [0.0] * 22))[0] > 0.0  # p = 0.002
  # Against the normal approximation of a mean's sd: close at this n.
  half = 1.96 * diffs.std() / math.sqrt(len(diffs))
  assert (high - low) / 2 == pytest.approx(half, rel=0.15)
  with pytest.raises(ValueError, match="non-empty"):
    stats.paired_bootstrap(np.array([]))


def test_compare_pairs_by_task_and_refuses_different_task_sets():
  a = {f"t{i}": i < 11 for i in range(32)}          # 11 right
  b = {f"t{i}": i < 18 for i in range(32)}          # 18 right: 7 gained, 0 lost
  result = stats.compare(a, b)
  assert (result.tasks, result.gained, result.lost) == (32, 7, 0)
  assert result.difference == pytest.approx(7 / 32)
  assert result.p_value == pytest.approx(2 * 0.5**7)
  assert result.ci_low > 0 and result.ci_high < 0.5
  line = result.describe("sft", "rl")
  assert line.startswith("rl - sft on 32 tasks: +0.219 (0.344 -> 0.562), 95% paired bootstrap CI [")
  assert line.endswith("exact McNemar p = 0.0156 (7 gained, 0 lost)")
  with pytest.raises(ValueError, match=r"in one only: \['t31'\]"):
    stats.compare(a, {k: v for k, v in b.items() if k != "t31"})


def test_the_run_summary_says_why_evaluations_of_different_tasks_are_not_paired(tmp_path):
  from tree_rl.evaluate import EpisodeSummary, EvalReport
  from tree_rl.train import _paired_comparisons

  def report(ids):
    return EvalReport(metrics={"accuracy": 0.0}, episodes=tuple(
        EpisodeSummary(task_id=t, sample=0, correct=False, reward=0.0, steps=1,
                       truncated=False, answered=True, difficulty=1) for t in ids))

  report(["a", "b"]).to_json(str(tmp_path / "eval_sft.json"))
  report(["a", "c"]).to_json(str(tmp_path / "eval_rl.json"))
  lines = _paired_comparisons(tmp_path)
  assert lines == ["rl - sft: no paired test (paired evaluations must score the same tasks; "
                   "these are in one only: ['b', 'c'])"]
  assert not (tmp_path / "eval_comparison.json").exists()
