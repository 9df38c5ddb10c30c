"""ARPO's entropy-based adaptive rollout (Dong et al. 2025, "Agentic Reinforced Policy
Optimization", arXiv 2507.19849).

This is our reading of the paper (docs/methods/grpo.md#arpo-rollout), with the knob values
of its public training scripts, `branch_probability = 0.5` and `entropy_weight = 0.2` (APPO,
arXiv 2606.12384, App. C, lists the same "threshold 0.5" and "entropy coefficient 0.2").

  1. Initialisation: N initial rollouts per prompt (INIT); the rest of the global
     budget, M - N, is kept for partial branches.
  2. Initial entropy: H_init of a trajectory is the mean per-token entropy of
     the first k tokens of its first step (the step sampled from the prompt).
  3. Monitoring: after every tool-call round, the next step is sampled from the
     context ending in the tool reply; H_t is the mean entropy of its first k
     tokens and
       Delta H_t = H_t - H_init                       (nats per token)
       P_t = clip(alpha + beta * Delta H_t, 0, 1)
     ARPO's rule "branch if U - beta * Delta H <= alpha, U ~ Uniform(0, 1)" is
     the same event as U <= P_t.
  4. Beaming: on a branch, Z partial rollouts (the beam size) start from that
     point, the context that ends in the tool reply: each samples its own step
     t (a sibling of the step that triggered it, tagged BRANCH) and then runs on
     like any trajectory, so it may branch again at later tool rounds. A
     branch does not re-test the step it was created to resample (that would
     let one high-entropy point keep forking itself).
  5. Budget: branching stops once the tree has M trajectories (Z is cut to
     what is left), so every tree has at most M leaves; trees where entropy
     stays low keep fewer, and nothing re-fills them.

Readings of our own, where the paper is not precise: Delta H is the raw
difference (the paper "normalises" it without saying how), the entropies are
the behaviour policy's ones recorded at sampling (the sampler is the current
policy), and k = 20 (our choice). Entropy is measured on the whole first k
tokens of the sampled step rather than on a separate k-token probe: the
decision is the same, and nothing is sampled twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from tree_rl.rollout.branching import Branch, Forest
from tree_rl.rollout.strategies.base import BranchingStrategy, register
from tree_rl.tree.types import LeafTag


@register("arpo")
@dataclasses.dataclass
class ARPOStrategy(BranchingStrategy):
  """Attributes:
    budget: M, the global rollout size per prompt (16 in ARPO's scripts, with N = 8);
      None: 2N.
    initial_rollouts: N, trajectories sampled from the prompt (8 in ARPO's scripts).
    beam_size: Z, partial branches opened by one branch decision (2).
    alpha: base branch probability (ARPO's `branch_probability`, 0.5).
    beta: weight of the entropy change (ARPO's `entropy_weight`, 0.2).
    entropy_window_k: k, tokens whose mean entropy is H (20, our choice).
    seed: the branch decisions' randomness.
  """

  generic_fields: ClassVar[Mapping[str, str]] = {"samples_per_task": "initial_rollouts",
                                                 "max_turns": ""}
  budget: int | None = None
  initial_rollouts: int = 8
  beam_size: int = 2
  alpha: float = 0.5
  beta: float = 0.2
  entropy_window_k: int = 20
  seed: int = 0

  def __post_init__(self):
    if self.budget is None:
      self.budget = 2 * self.initial_rollouts
    if not 1 <= self.initial_rollouts <= self.budget:
      raise ValueError(f"ARPOStrategy: need 1 <= initial_rollouts <= budget, got "
                       f"{self.initial_rollouts}, {self.budget}")
    if self.beam_size < 1 or self.entropy_window_k < 1:
      raise ValueError("ARPOStrategy: beam_size and entropy_window_k must be >= 1")
    self._rng = np.random.default_rng(self.seed)

  def leaves_per_task(self) -> int | None:
    return None  # at most `budget`; how many depends on the entropies

  def branch_probability(self, h_step: float, h_init: float) -> float:
    """P_t = clip(alpha + beta (H_t - H_init), 0, 1)."""
    return float(np.clip(self.alpha + self.beta * (h_step - h_init), 0.0, 1.0))

  def grow(self, forest: Forest) -> None:
    trees = forest.trees
    count = [self.initial_rollouts] * len(trees)
    open_ = [b for t in range(len(trees)) for b in forest.start(t, self.initial_rollouts)]
    while open_:
      stepped = list(open_)
      open_, _ = forest.step(open_)
      for b in stepped:
        if b.last_policy < 0:  # sampled nothing this turn (context full)
          continue
        node = trees[b.tree].nodes[b.last_policy]
        h = float(np.mean((node.entropies or [0.0])[:self.entropy_window_k]))
        if "h_init" not in b.data:  # its first step: the initial entropy
          b.data["h_init"] = h
          continue
        if b.data.pop("fresh", False) or count[b.tree] >= self.budget:
          continue
        if self._rng.random() < self.branch_probability(h, b.data["h_init"]):
          z = min(self.beam_size, self.budget - count[b.tree])
          count[b.tree] += z
          open_.extend(self._beam(forest, b, z))

  def _beam(self, forest: Forest, b: Branch, z: int) -> list[Branch]:
    """Z partial rollouts restarting b's latest step from the tool reply before it."""
    data = {"h_init": b.data["h_init"], "fresh": True}
    return [forest.branch_at(b.tree, b.last_policy, 0, LeafTag.BRANCH, data) for _ in range(z)]
