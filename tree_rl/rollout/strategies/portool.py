"""PORTool's tree rollout (arXiv 2510.26020, §3.2 Step 1 and App. A, Algorithm 1).

  for j in 1..n: sample s_{j,1} from the prompt, run its tools  # n independent first steps
  for t in 2..T_max:
    move completed trajectories out; n_c = #completed; stop if n_c = n
    traj <- DupAndSamp(traj, f, n - n_c)                   # each open one copied f times,
    every copy samples its own step t and runs its tools   # n - n_c of the copies kept
  whatever is left ends at T_max (truncated)               # exactly n trajectories

DupAndSamp picks n - n_c of the f (n - n_c) copies uniformly without
replacement (the paper does not say how; docs/methods/portool.md#fork-factor-and-selection:
this has the same distribution as the main text's "generate f forks, keep n - n_c"). So each
open trajectory is kept k in {0..f} times with sum k = n - n_c: k - 1 copies
fork from its last (env) node (a node-boundary fork, tagged BRANCH), and a
trajectory kept 0 times is discarded; its nodes, which no leaf passes through,
are pruned when the rollout finishes. A trajectory is completed when its episode
finished (PORTool's `response_gen`, or a final answer) or ended on a limit.
Hence exactly n leaves per tree, unless the engine could not sample at all.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from tree_rl.rollout.branching import Branch, Forest
from tree_rl.rollout.strategies.base import BranchingStrategy, register


@register("portool")
@dataclasses.dataclass
class PORToolStrategy(BranchingStrategy):
  """Attributes:
    n: trajectories per query (8, PORTool §4.1).
    fork_factor: f, copies per open trajectory before selection (not given in the
      paper; docs/methods/portool.md#fork-factor-and-selection). f = 1 gives n
      chains (GRPO).
    t_max: tool-call steps per trajectory (5, PORTool §3.2 Step 2); overrides the
      loop's max_turns.
    seed: DupAndSamp's selection randomness.
  """

  # t_max replaces the loop's max_turns.
  generic_fields: ClassVar[Mapping[str, str]] = {"samples_per_task": "n"}
  n: int = 8
  fork_factor: int = 2
  t_max: int = 5
  seed: int = 0

  def __post_init__(self):
    if self.n < 1 or self.fork_factor < 1 or self.t_max < 1:
      raise ValueError(f"PORToolStrategy: n, fork_factor and t_max must be >= 1, got "
                       f"{self.n}, {self.fork_factor}, {self.t_max}")
    self._rng = np.random.default_rng(self.seed)

  def dup_and_samp(self, num_open: int) -> np.ndarray:
    """How many copies of each of `num_open` trajectories DupAndSamp keeps (sums to num_open)."""
    picks = self._rng.choice(num_open * self.fork_factor, size=num_open, replace=False)
    return np.bincount(picks // self.fork_factor, minlength=num_open)

  def grow(self, forest: Forest) -> None:
    forest.max_turns = self.t_max
    open_ = [b for t in range(len(forest.tasks)) for b in forest.start(t, self.n)]
    while open_:
      open_, _ = forest.step(open_)  # step t of every open copy; completed ones leave
      by_tree: dict[int, list[Branch]] = collections.defaultdict(list)
      for b in open_:
        by_tree[b.tree].append(b)
      open_ = []
      for branches in by_tree.values():
        for b, kept in zip(branches, self.dup_and_samp(len(branches))):
          if kept == 0:
            forest.discard(b)
          else:
            open_.append(b)
            open_.extend(forest.fork(b, int(kept) - 1))

  def leaves_per_task(self) -> int | None:
    return self.n
