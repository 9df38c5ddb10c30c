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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np


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
