"""GRPO / DAPO sampling: n independent episodes per prompt, a depth-1 fan at the root.

The group of G outputs per question of GRPO (DeepSeekMath, arXiv 2402.03300, §4.1.1) and
of DAPO (arXiv 2503.14476).

The tree is n chains under the prompt node (every leaf INIT). The n requests of
a prompt share its context, so the engine prefills the prompt once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from tree_rl.rollout.branching import Forest
from tree_rl.rollout.strategies.base import BranchingStrategy, register


@register("flat")
@dataclasses.dataclass
class FlatStrategy(BranchingStrategy):
  """Attributes:
    n: episodes per prompt, the group size (8: the flat GRPO baseline of TRACE
      and PORTool's n; DAPO uses 16).
  """

  generic_fields: ClassVar[Mapping[str, str]] = {"samples_per_task": "n", "max_turns": ""}
  n: int = 8

  def __post_init__(self):
    if self.n < 1:
      raise ValueError(f"FlatStrategy.n={self.n} must be >= 1")

  def grow(self, forest: Forest) -> None:
    forest.run([b for t in range(len(forest.tasks)) for b in forest.start(t, self.n)])

  def leaves_per_task(self) -> int | None:
    return self.n
