"""Paired statistics for two policies scored on the same tasks.

Two evaluations of the same task set are paired: a task's difficulty is shared by both
scores, so the test looks at the tasks where they disagree. `compare` gives:

  - the exact McNemar test: of the n discordant tasks, `gained` went wrong -> right and
    `lost` right -> wrong; under "no difference" each discordant task is a fair coin, so
    p = P(Binomial(n, 1/2) as far from n/2 as observed), two-sided, exact (no normal
    approximation, which is poor at the handful of discordant tasks a 32-task eval has);
  - a paired bootstrap interval of the accuracy difference: tasks are resampled with
    replacement and the mean of (b - a) over the resample is taken, 10,000 times, seeded.

Both say "cannot separate" honestly at small n: with 32 tasks a 3-task gain is p = 0.25.

Over seeds, `compare_over_seeds` pools each seed's pair into one test over tasks (a sign-flip
test and a task bootstrap), and `seeds_for_power` turns the spread of the per-seed
differences into the seeds a gap needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import scipy.stats


def mcnemar_exact(gained: int, lost: int) -> float:
  """Two-sided exact McNemar p-value for `gained` and `lost` discordant pairs."""
  if gained < 0 or lost < 0:
    raise ValueError(f"counts must be >= 0, got gained={gained}, lost={lost}")
  n, k = gained + lost, min(gained, lost)
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
  return min(1.0, 2.0 * tail)


def paired_bootstrap(diffs: np.ndarray, *, samples: int = 10_000, level: float = 0.95,
                     seed: int = 0) -> tuple[float, float]:
  """The percentile interval of mean(diffs) over task resamples (`level` coverage)."""
  diffs = np.asarray(diffs, np.float64)
  if diffs.ndim != 1 or not len(diffs):
    raise ValueError(f"diffs must be a non-empty vector, got shape {diffs.shape}")
  rng = np.random.default_rng(seed)
  means = diffs[rng.integers(0, len(diffs), size=(samples, len(diffs)))].mean(axis=1)
  tail = (1.0 - level) / 2.0
  return float(np.quantile(means, tail)), float(np.quantile(means, 1.0 - tail))


@dataclasses.dataclass(frozen=True)
class PairedComparison:
  """Policy b against policy a on the same tasks.

  Attributes:
    tasks: tasks scored by both.
    accuracy_a, accuracy_b: the two accuracies over those tasks.
    gained, lost: tasks a got wrong and b right, and the reverse.
    p_value: the exact McNemar p (two-sided).
    ci_low, ci_high: the 95% paired bootstrap interval of accuracy_b - accuracy_a.
  """

  tasks: int
  accuracy_a: float
  accuracy_b: float
  gained: int
  lost: int
  p_value: float
  ci_low: float
  ci_high: float

  @property
  def difference(self) -> float:
    return self.accuracy_b - self.accuracy_a

  def describe(self, a: str, b: str) -> str:
    """One line, e.g. "rl - sft on 32 tasks: +0.219 (0.344 -> 0.562), 95% paired bootstrap
    CI [+0.094, +0.344]; exact McNemar p = 0.016 (7 gained, 0 lost)"."""
    return (f"{b} - {a} on {self.tasks} tasks: {self.difference:+.3f} ({self.accuracy_a:.3f} "
            f"-> {self.accuracy_b:.3f}), 95% paired bootstrap CI [{self.ci_low:+.3f}, "
            f"{self.ci_high:+.3f}]; exact McNemar p = {self.p_value:.3g} ({self.gained} "
            f"gained, {self.lost} lost)")


def compare(correct_a: Mapping[str, bool], correct_b: Mapping[str, bool], *,
            samples: int = 10_000, seed: int = 0) -> PairedComparison:
  """Pairs two evaluations by task id (each a task -> correct mapping, one episode a task).

  Raises:
    ValueError: the two evaluations do not score the same tasks.
  """
  if set(correct_a) != set(correct_b):
    only = sorted(set(correct_a) ^ set(correct_b))[:5]
    raise ValueError(f"paired evaluations must score the same tasks; these are in one only: "
                     f"{only}")
  if not correct_a:
    raise ValueError("no tasks to compare")
  ids = sorted(correct_a)
  a = np.array([float(correct_a[t]) for t in ids])
  b = np.array([float(correct_b[t]) for t in ids])
  gained, lost = int(np.sum((a == 0) & (b == 1))), int(np.sum((a == 1) & (b == 0)))
  low, high = paired_bootstrap(b - a, samples=samples, seed=seed)
  return PairedComparison(tasks=len(ids), accuracy_a=float(a.mean()), accuracy_b=float(b.mean()),
                          gained=gained, lost=lost, p_value=mcnemar_exact(gained, lost),
                          ci_low=low, ci_high=high)


# ============================== Over seeds ==============================
#
# Runs of two arms at several seeds, each pair scored on a task set, pool into one test over
# tasks: a task's differences at all seeds move together (the units of the test are the tasks,
# so scoring the same fixed tasks at every seed does not count them twice), and each seed's
# pair is still paired on its own tasks.


@dataclasses.dataclass(frozen=True)
class PooledComparison:
  """b - a over several seeds' paired evaluations.

  Attributes:
    seeds: how many seed pairs were pooled.
    tasks: distinct tasks (the test's units).
    difference: the mean over all (seed, task) pairs of b - a, i.e. the mean over seeds of
      each seed's accuracy difference when every seed scores the same number of tasks.
    ci_low, ci_high: the 95% bootstrap interval of `difference`, resampling tasks (a task
      carries its differences at every seed).
    p_value: the two-sided sign-flip test over tasks: under "no difference" each task's
      summed difference is as likely negative as positive. Exact up to 16 tasks with a
      non-zero sum; else 20,000 seeded random flips (with the observed one counted).
      At one seed of 0/1 scores it equals the exact McNemar p.
    seed_differences: each seed's accuracy difference, in the order given.
    seed_sd: the sample standard deviation of `seed_differences` (NaN for one seed).

  The task interval and test hold these runs fixed: they ask whether these policies differ.
  Whether another seed's would is `seed_interval`'s question.
  """

  seeds: int
  tasks: int
  difference: float
  ci_low: float
  ci_high: float
  p_value: float
  seed_differences: tuple[float, ...]
  seed_sd: float


def sign_flip_p(totals: np.ndarray, *, samples: int = 20_000, seed: int = 0) -> float:
  """Two-sided sign-flip p of sum(totals) (one total per unit; zeros carry no information)."""
  totals = np.asarray(totals, np.float64)
  totals = totals[totals != 0.0]
  observed = abs(totals.sum())
  if not len(totals):
    return 1.0
  tol = 1e-9 * max(1.0, observed)
  if len(totals) <= 16:  # 65,536 sign patterns
    signs = 1 - 2 * ((np.arange(2 ** len(totals))[:, None] >> np.arange(len(totals))) & 1)
    return float(np.mean(np.abs(signs @ totals) >= observed - tol))
  rng = np.random.default_rng(seed)
  signs = rng.choice(np.array([-1.0, 1.0]), size=(samples, len(totals)))
  hits = np.sum(np.abs(signs @ totals) >= observed - tol)
  return float((hits + 1) / (samples + 1))


Scores = Mapping[str, float | int]  # task id -> score (a bool is an int)


def compare_over_seeds(pairs: Sequence[tuple[Scores, Scores]], *, samples: int = 10_000,
                       seed: int = 0) -> PooledComparison:
  """Pools paired evaluations (a, b) of several seeds, each a task -> score mapping (0/1 for
  a greedy eval) over the same tasks within the pair.

  Raises:
    ValueError: no pairs, or a pair whose two evaluations score different tasks.
  """
  if not pairs:
    raise ValueError("no seed pairs to pool")
  by_task: dict[str, list[float]] = {}
  seed_diffs = []
  for i, (a, b) in enumerate(pairs):
    if set(a) != set(b) or not a:
      only = sorted(set(a) ^ set(b))[:5]
      raise ValueError(f"seed pair {i}: paired evaluations must score the same non-empty task "
                       f"set; these are in one only: {only}")
    diffs = {t: float(b[t]) - float(a[t]) for t in a}
    seed_diffs.append(sum(diffs.values()) / len(diffs))
    for task, d in diffs.items():
      by_task.setdefault(task, []).append(d)
  units = list(by_task.values())
  sums = np.array([sum(u) for u in units])
  counts = np.array([len(u) for u in units], np.float64)
  rng = np.random.default_rng(seed)
  picks = rng.integers(0, len(units), size=(samples, len(units)))
  means = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
  sd = float(np.std(seed_diffs, ddof=1)) if len(seed_diffs) > 1 else float("nan")
  return PooledComparison(
      seeds=len(pairs), tasks=len(units), difference=float(sums.sum() / counts.sum()),
      ci_low=float(np.quantile(means, 0.025)), ci_high=float(np.quantile(means, 0.975)),
      p_value=sign_flip_p(sums, seed=seed), seed_differences=tuple(seed_diffs), seed_sd=sd)


def seed_interval(differences: Sequence[float], sd: float, dof: int, *, level: float = 0.95
                  ) -> tuple[float, float]:
  """The t-interval of the mean of per-seed `differences`, the seeds as the units (so
  training noise counts), with standard deviation `sd` on `dof` degrees of freedom: the
  differences' own (len - 1), or one pooled over comparisons (`pooled_sd`) when each has a
  couple of seeds. (NaN, NaN) without a spread.

  Raises:
    ValueError: no differences.
  """
  if not len(differences):
    raise ValueError("no per-seed differences")
  if dof < 1 or not math.isfinite(sd):
    return float("nan"), float("nan")
  mean = float(np.mean(differences))
  half = float(scipy.stats.t.ppf(0.5 + level / 2, dof)) * sd / math.sqrt(len(differences))
  return mean - half, mean + half


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
  """The pooled sample standard deviation of several groups (each comparison's per-seed
  differences about its own mean) and its degrees of freedom; groups of one add nothing.
  (NaN, 0) when no group has two values."""
  squares, dof = 0.0, 0
  for values in groups:
    if len(values) > 1:
      mean = sum(values) / len(values)
      squares += sum((v - mean) ** 2 for v in values)
      dof += len(values) - 1
  return (math.sqrt(squares / dof), dof) if dof else (float("nan"), 0)


def seeds_for_power(sd: float, gap: float, *, power: float = 0.8, alpha: float = 0.05,
                    most: int = 100_000) -> int:
  """Seeds a paired comparison needs to detect a mean difference `gap` whose per-seed
  differences have standard deviation `sd`: the smallest n >= 2 at which a two-sided paired
  t-test at level `alpha` rejects with probability >= `power` (noncentral t). `most` if even
  that many seeds are not enough.

  Raises:
    ValueError: gap <= 0, sd not a finite number >= 0, or power/alpha outside (0, 1).
  """
  if not gap > 0 or not math.isfinite(sd) or sd < 0 or not 0 < power < 1 or not 0 < alpha < 1:
    raise ValueError(f"need gap > 0, a finite sd >= 0 and power, alpha in (0, 1); got "
                     f"gap={gap}, sd={sd}, power={power}, alpha={alpha}")
  if sd == 0:
    return 2

  def reaches(n: int) -> bool:
    crit = scipy.stats.t.ppf(1 - alpha / 2, n - 1)
    shift = gap / sd * math.sqrt(n)
    upper = scipy.stats.nct.sf(crit, n - 1, shift)
    lower = scipy.stats.nct.cdf(-crit, n - 1, shift)  # NaN far in the tail: it is ~0 there
    return float(upper) + float(np.nan_to_num(lower)) >= power

  if not reaches(most):
    return most
  low, high = 1, most  # reaches(high) and not reaches(low), as n = 1 has no test
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (low, mid) if reaches(mid) else (mid, high)
  return high
