"""Paired statistics: the exact McNemar test against a binomial tail computed by hand, and the
paired bootstrap interval, on the figures the main job reports."""

import math

import numpy as np
import scipy.stats
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


# ============================== Over seeds ==============================


def _evals(right: range, tasks: int = 32) -> dict[str, bool]:
  return {f"t{i}": i in right for i in range(tasks)}


def test_sign_flip_p_at_one_seed_is_the_exact_mcnemar_p():
  for gained, lost in ((7, 0), (8, 2), (3, 3), (0, 0), (12, 1)):
    totals = np.array([1.0] * gained + [-1.0] * lost + [0.0] * 5)
    assert stats.sign_flip_p(totals) == pytest.approx(stats.mcnemar_exact(gained, lost))
  # Past 16 non-zero tasks it samples flips: 18 gained, 2 lost (exact p = 0.0004).
  sampled = stats.sign_flip_p(np.array([1.0] * 18 + [-1.0] * 2))
  assert sampled == pytest.approx(stats.mcnemar_exact(18, 2), abs=5e-4)
  assert sampled == stats.sign_flip_p(np.array([1.0] * 18 + [-1.0] * 2))  # seeded


def test_over_seeds_the_units_are_tasks():
  a = _evals(range(11))
  # The same 3 tasks gained at both seeds: twice the runs, not twice the evidence.
  same = stats.compare_over_seeds([(a, _evals(range(14))), (a, _evals(range(14)))])
  assert (same.seeds, same.tasks, same.p_value) == (2, 32, 0.25)
  assert same.difference == pytest.approx(3 / 32) and same.seed_sd == 0.0
  # 3 different tasks at each seed: 6 tasks gained, p = 2 / 2**6.
  b0 = _evals(range(14))
  b1 = {**a, "t20": True, "t21": True, "t22": True}
  apart = stats.compare_over_seeds([(a, b0), (a, b1)])
  assert apart.p_value == pytest.approx(2 / 64)
  assert apart.seed_differences == pytest.approx((3 / 32, 3 / 32))
  assert 0.0 < apart.ci_low < apart.difference < apart.ci_high
  # A seed scored on other tasks pools as its own units.
  elsewhere = ({"u0": False, "u1": False}, {"u0": True, "u1": True})
  other = stats.compare_over_seeds([(a, b0), elsewhere])
  assert other.tasks == 34 and other.difference == pytest.approx(5 / 34)
  with pytest.raises(ValueError, match=r"seed pair 1: .* in one only: \['t31'\]"):
    stats.compare_over_seeds([(a, b0), (a, _evals(range(3), tasks=31))])
  with pytest.raises(ValueError, match="no seed pairs"):
    stats.compare_over_seeds([])


def test_pooled_sd_and_the_interval_over_seeds():
  sd, dof = stats.pooled_sd([[0.1, 0.3], [0.0, 0.0, 0.3], [0.5]])
  # Squares about each group's mean: 0.02 + 0.06 over 1 + 2 degrees of freedom.
  assert dof == 3 and sd == pytest.approx(math.sqrt(0.08 / 3))
  assert math.isnan(stats.pooled_sd([[0.5], []])[0])
  low, high = stats.seed_interval([0.1, 0.3], sd=0.1, dof=3)
  # t(0.975, 3) = 3.182: 0.2 +- 3.182 * 0.1 / sqrt(2).
  assert (low, high) == pytest.approx((0.2 - 0.2250, 0.2 + 0.2250), abs=1e-4)
  assert all(map(math.isnan, stats.seed_interval([0.1], sd=float("nan"), dof=0)))
  with pytest.raises(ValueError, match="no per-seed"):
    stats.seed_interval([], sd=0.1, dof=3)


def test_seeds_for_power_is_the_paired_t_test_power():
  # Issue 39's figures: sd 0.095 per seed on 32 tasks; the normal approximation gives about
  # 74 seeds for a 1-task gap and 8 for a 3-task gap, the t-test a little more at small n.
  assert stats.seeds_for_power(0.095, 1 / 32) == 75
  assert stats.seeds_for_power(0.095, 3 / 32) == 11
  # At 11 seeds the power is at least 0.8, at 10 below it (noncentral t, computed directly).
  for n, above in ((11, True), (10, False)):
    crit = scipy.stats.t.ppf(0.975, n - 1)
    power = scipy.stats.nct.sf(crit, n - 1, 3 / 32 / 0.095 * math.sqrt(n))
    assert (power >= 0.8) == above
  assert stats.seeds_for_power(0.0, 0.1) == 2
  assert stats.seeds_for_power(1.0, 1e-4, most=500) == 500
  with pytest.raises(ValueError, match="gap=0"):
    stats.seeds_for_power(0.1, 0.0)
