"""Random token-position branching (TreePO-style), the control for learned branch points.

TRACE's TreePO baseline samples 4 bare rollouts per prompt and branches at 2
random points of each (TRACE, arXiv 2606.11119, §5.1 and App. E.4-E.5): the same
tree-shaped update, with "random root and prefix allocation". Here (tree_rl's reading,
docs/methods/trace.md#treepo-random-branching):

  1. n_init initial rollouts per prompt (INIT), run to the end;
  2. the remaining budget - n_init leaves are spread evenly over the initial
     rollouts (the remainder to randomly chosen ones), and each branch point
     is a policy token drawn uniformly from its rollout (without replacement
     while there are enough; EOS / end-of-turn ids excluded). A branch keeps
     the tokens before the point and resamples from it (`Forest.branch_at`),
     tagged BRANCH, and runs to the end.

The budget is matched to a reference strategy: `budget = reference.leaves_per_task()`
(e.g. PORTool's n, APPO's M, TRACE's M (1 + N) / #prompts), so a comparison
spends the same number of leaves per prompt. With neither a reference nor a
budget it is TreePO's 4 + 4 * 2 = 12. A rollout with no policy token (its
prompt filled the context) keeps the budget with fresh rollouts from the prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from tree_rl.rollout.branching import Branch, Forest
from tree_rl.rollout.strategies.base import BranchingStrategy, register
from tree_rl.tree.types import LeafTag

POINTS_PER_ROLLOUT = 2  # TreePO baseline in TRACE: 2 random branch points per bare rollout


@register("random")
@dataclasses.dataclass
class RandomStrategy(BranchingStrategy):
  """Attributes:
    reference: a strategy whose `leaves_per_task()` sets the budget.
    budget: leaves per prompt (overrides `reference`).
    n_init: initial rollouts per prompt (4, TRACE's TreePO baseline); capped at the budget.
    seed: branch point randomness.
  """

  generic_fields: ClassVar[Mapping[str, str]] = {"samples_per_task": "n_init", "max_turns": ""}
  reference: BranchingStrategy | None = None
  budget: int | None = None
  n_init: int = 4
  seed: int = 0

  def __post_init__(self):
    if self.n_init < 1:
      raise ValueError(f"RandomStrategy.n_init={self.n_init} must be >= 1")
    if self.budget is None and self.reference is not None:
      self.budget = self.reference.leaves_per_task()
      if self.budget is None:
        raise ValueError(f"reference strategy {self.reference.name!r} has no fixed leaf budget;"
                         " pass budget=")
    if self.budget is None:
      self.budget = self.n_init * (1 + POINTS_PER_ROLLOUT)
    if self.budget < 1:
      raise ValueError(f"RandomStrategy.budget={self.budget} must be >= 1")
    self._rng = np.random.default_rng(self.seed)

  def leaves_per_task(self) -> int | None:
    return self.budget

  def grow(self, forest: Forest) -> None:
    n0 = min(self.n_init, self.budget)
    forest.run([b for t in range(len(forest.tasks)) for b in forest.start(t, n0)])
    eos = frozenset(forest.chat.eos_ids)
    plan = []  # (tree, leaf, offset or -1), all chosen before any split
    for t, tree in enumerate(forest.trees):
      sources = [k for k, leaf in enumerate(tree.leaves) if leaf.tag == LeafTag.INIT]
      extra = self.budget - n0
      if extra <= 0:
        continue
      if not sources:
        plan.extend((t, -1, -1) for _ in range(extra))
        continue
      per = np.full(len(sources), extra // len(sources))
      per[self._rng.choice(len(sources), extra % len(sources), replace=False)] += 1
      for k, c in zip(sources, per):
        offsets = forest.policy_offsets(t, k, exclude=eos)
        if not offsets:
          plan.extend((t, k, -1) for _ in range(c))
          continue
        picks = self._rng.choice(offsets, size=int(c), replace=int(c) > len(offsets))
        plan.extend((t, k, int(p)) for p in sorted(picks))
    new: list[Branch] = []
    for t, k, off in plan:
      if off < 0:
        new.extend(forest.start(t, 1, LeafTag.BRANCH))
      else:
        new.append(forest.branch_at_offset(t, k, off))
    forest.run(new)
