"""One training step's rollout, with DAPO's dynamic sampling (arXiv 2503.14476 §3.2).

DAPO §3.2 ("Dynamic Sampling"): a group whose rewards are all equal (accuracy 1 or 0)
has advantage 0 everywhere, so it adds no policy gradient and only shrinks the
effective batch. DAPO over-samples, filters out the prompts whose accuracy is 0 or 1,
and keeps sampling until the batch is full of groups whose accuracy is strictly
between. Here a group is the tree of one prompt.

`resample_mixed` is that loop as a small host function:

  round 0 rolls out the step's `target` prompts (the next ones in the data order);
  each extra round rolls out the next k prompts, k = the mixed groups still missing;
  a tree whose leaf rewards are all equal is dropped (`is_mixed`).

Rolling out only the missing count (our choice; the paper does not say how much to
over-sample) means no mixed group is ever thrown away and a step never trains on
more than `target` groups, so the update's shapes stay those of a normal step. The
rounds are bounded by `max_extra_rounds` (our addition: the paper's loop never ends
on a policy that solves every prompt or none). When the bound is hit the step keeps
the mixed groups it has, with a warning; with none, the trainer skips the update.

The keep rule is `tree_rl.algos.grpo.dapo_keep_mask`'s: the summed leaf reward
channels of the estimator (its `reward_channels`: R before DAPO's length shaping) differ by more
than `segment.STD_FLOOR` between some two leaves. `is_mixed` applies it to
RolloutTrees on the host, before packing, so dropping a group costs no compile.

`rollout_step` runs one step's rounds with an AgentLoop: every round is reseeded
from (seed, step, round) by the caller's `reseed`, so sampling stays a function of
the seed and the step, and `prompts` says how far the data position moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from tree_rl.tree import segment
from tree_rl.tree.rollout_tree import RolloutTree

PREFIX = "rollout/dynamic_sampling/"


def is_mixed(tree: RolloutTree, channels: Sequence[str]) -> bool:
  """True iff the tree's leaf rewards (the sum of `channels`, 0 where a leaf lacks one,
  as `pack` stores it) are not all equal: max - min > segment.STD_FLOOR, the rule of
  `grpo.dapo_keep_mask`. A tree without leaves is not mixed; a NaN reward is never."""
  if not tree.leaves:
    return False
  r = np.array([sum(float(leaf.rewards.get(c, 0.0)) for c in channels)
                for leaf in tree.leaves], np.float64)
  return bool(r.max() - r.min() > segment.STD_FLOOR)


@dataclasses.dataclass(frozen=True)
class Resampled:
  """What `resample_mixed` gathered for one step.

  Attributes:
    kept: the mixed groups, at most `target`, in the order they were rolled out.
    rolled: every group rolled out, dropped ones included (the step's reward logs).
    prompts: prompts taken from the data order (target + the extra ones).
    target: the groups a step trains on (prompts_per_step).
    extra_rounds: rounds after the first.
    bound_hit: the rounds ran out with fewer than `target` mixed groups.
  """

  kept: list
  rolled: list
  prompts: int
  target: int
  extra_rounds: int
  bound_hit: bool

  def metrics(self) -> dict[str, float]:
    """The step's dynamic-sampling logs (`rollout/dynamic_sampling/...`):

      keep_frac: mixed groups / groups rolled out over all rounds (DAPO's filter rate).
      extra_rounds: rollout rounds after the first.
      extra_prompts: prompts rolled out beyond the step's `target`.
      bound_hit: 1 when the extra rounds ran out before `target` mixed groups were found.
      groups: mixed groups the update trains on (< target only when bound_hit).
      update_skipped: 1 when there was no mixed group at all (the step has no update).
    """
    return {PREFIX + "keep_frac": len(self.kept) / max(len(self.rolled), 1),
            PREFIX + "extra_rounds": float(self.extra_rounds),
            PREFIX + "extra_prompts": float(self.prompts - self.target),
            PREFIX + "bound_hit": float(self.bound_hit),
            PREFIX + "groups": float(len(self.kept)),
            PREFIX + "update_skipped": float(not self.kept)}


def resample_mixed(rollout: Callable[[int, Sequence[Any]], Sequence[Any]],
                   tasks: Callable[[int, int], Sequence[Any]], target: int,
                   keep: Callable[[Any], bool], max_extra_rounds: int) -> Resampled:
  """DAPO's dynamic sampling loop (§3.2): roll out until `target` groups pass `keep`.

  Args:
    rollout: (round, tasks) -> the groups (trees) of those tasks, at most one per task
      (a strategy may skip a task, e.g. TRACE's m_i = 0).
    tasks: (offset, n) -> the n tasks at offsets [offset, offset + n) of the step's
      slice of the data order.
    target: mixed groups wanted (the step's prompts_per_step), >= 1.
    keep: group -> whether it is mixed (`is_mixed`).
    max_extra_rounds: rounds allowed after the first, >= 0.

  Returns:
    Resampled (a warning is logged when the bound is hit).
  """
  if target < 1 or max_extra_rounds < 0:
    raise ValueError(f"resample_mixed: target={target} must be >= 1 and "
                     f"max_extra_rounds={max_extra_rounds} >= 0")
  kept: list = []
  rolled: list = []
  used, round_, n = 0, 0, target
  while True:
    batch = list(tasks(used, n))
    groups = list(rollout(round_, batch))
    if len(groups) > len(batch):
      raise ValueError(f"resample_mixed: round {round_} returned {len(groups)} groups for "
                       f"{len(batch)} tasks (at most one group per task)")
    used += len(batch)
    rolled.extend(groups)
    kept.extend(g for g in groups if keep(g))
    n = target - len(kept)
    if n <= 0 or round_ == max_extra_rounds:
      break
    round_ += 1
  bound_hit = len(kept) < target
  if bound_hit:
    logging.warning("dynamic sampling: %d of %d mixed groups after %d extra rounds "
                    "(rollout.dynamic_sampling_extra_rounds); %d prompts rolled out, "
                    "training on what there is", len(kept), target, round_, used)
  return Resampled(kept=kept, rolled=rolled, prompts=used, target=target,
                   extra_rounds=round_, bound_hit=bound_hit)


@dataclasses.dataclass(frozen=True)
class StepRollout:
  """One step's rollout: the groups to train on and the step's rollout logs.

  Attributes:
    trees: every tree rolled out this step (all rounds).
    train: the trees the update sees (`trees`, or the mixed ones with dynamic sampling).
    prompts: prompts taken from the data order.
    episodes, truncated, policy_tokens: totals of the rounds' `RolloutStats`.
    strategy_metrics: the strategy's `last_metrics` after each round, averaged over the
      rounds weighted by their trees (one round: exactly its metrics).
    sampling: the dynamic-sampling result (None when it is off).
  """

  trees: list
  train: list
  prompts: int
  episodes: int
  truncated: int
  policy_tokens: int
  strategy_metrics: Mapping[str, float]
  sampling: Resampled | None = None

  @classmethod
  def single(cls, trees: list, stats: Any, strategy: Any, prompts: int) -> "StepRollout":
    """A step grown in one go by other means (APPO's per-mini-batch branching): its
    `RolloutStats` and the strategy's `last_metrics`, every tree trained on."""
    return cls(trees=trees, train=trees, prompts=prompts, episodes=stats.num_episodes,
               truncated=stats.num_truncated, policy_tokens=stats.num_policy_tokens,
               strategy_metrics=dict(strategy.last_metrics))

  def metrics(self) -> dict[str, float]:
    """rollout/truncated_frac, rollout/policy_tokens, the strategy's metrics and, with
    dynamic sampling, `Resampled.metrics`."""
    out = {"rollout/truncated_frac": self.truncated / max(self.episodes, 1),
           "rollout/policy_tokens": float(self.policy_tokens), **self.strategy_metrics}
    if self.sampling is not None:
      out.update(self.sampling.metrics())
    return out


def _weighted(rounds: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
  """Per key, the mean over the rounds that report it, weighted by each round's trees
  (equal weights when those rounds have no tree); one round's metrics as they are."""
  if len(rounds) == 1:
    return {k: float(v) for k, v in rounds[0][1].items()}
  keys = dict.fromkeys(k for _, m in rounds for k in m)
  out = {}
  for k in keys:
    vals = [(w, float(m[k])) for w, m in rounds if k in m]
    ws = np.array([w for w, _ in vals], np.float64)
    ws = ws if ws.sum() > 0 else np.ones_like(ws)
    out[k] = float(np.dot(ws, [v for _, v in vals]) / ws.sum())
  return out


def rollout_step(agent: Any, tasks: Callable[[int, int], Sequence[Any]], target: int,
                 reseed: Callable[[int], None], channels: Sequence[str] | None = None,
                 max_extra_rounds: int = 0) -> StepRollout:
  """Grows one step's trees with `agent` (an AgentLoop).

  Args:
    agent: its `rollout(tasks)`, `last_stats` and `strategy.last_metrics` are read.
    tasks: (offset, n) -> the tasks at offsets [offset, offset + n) of the step's slice
      of the data order.
    target: prompts_per_step.
    reseed: round -> None, restarts the engine's sampling stream for that round.
    channels: the estimator's outcome channels: dynamic sampling on (None: off, one
      round of `target` prompts, every tree trained on).
    max_extra_rounds: dynamic sampling's bound on extra rounds.
  """
  rounds: list[tuple[int, Mapping[str, float]]] = []
  totals = {"episodes": 0, "truncated": 0, "policy_tokens": 0}

  def roll(round_: int, batch: Sequence[Any]) -> list:
    reseed(round_)
    trees = agent.rollout(batch)
    s = agent.last_stats
    totals["episodes"] += s.num_episodes
    totals["truncated"] += s.num_truncated
    totals["policy_tokens"] += s.num_policy_tokens
    rounds.append((len(trees), dict(agent.strategy.last_metrics)))
    return trees

  if channels is None:
    trees = roll(0, tasks(0, target))
    return StepRollout(trees=trees, train=trees, prompts=target,
                       strategy_metrics=_weighted(rounds), **totals)
  res = resample_mixed(roll, tasks, target, lambda t: is_mixed(t, channels), max_extra_rounds)
  return StepRollout(trees=res.rolled, train=res.kept, prompts=res.prompts,
                     strategy_metrics=_weighted(rounds), sampling=res, **totals)
