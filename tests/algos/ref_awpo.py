"""Slow pure-Python AWPO reference (arXiv 2512.19126, §3.2, eqs. 21-29), written from the
formulas with plain loops in float64. Test-only: the oracle for tree_rl.algos.awpo.

Conventions shared with the kernel (both from docs/methods/awpo.md, not from each other):
one group per tree (all its leaves); population (1/K) statistics; a std <= 1e-6 counts as 0; a non-finite
reasoning score is a missing judge score (w_g = 0).
"""

from __future__ import annotations

import math

import numpy as np

from tree_rl.tree import NodeKind, RolloutTree

SD_FLOOR = 1e-6  # segment.STD_FLOOR, restated: a group with sd <= this has no spread.


def _mean(xs):
  return sum(xs) / len(xs)


def _pop_sd(xs):
  m = _mean(xs)
  sd = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
  return sd if sd > SD_FLOOR else 0.0


def group(r_out, r_reason, cfg) -> dict:
  """AWPO for one group of K responses.

  Returns a dict with "adv" (list of K A_hyper), "gate", "w" (eq. 25, the group's term in
  w_bar), "d" (eq. 27) and "near_edge" (True when a float32 kernel could
  legitimately take the other side of a threshold comparison: gate vs eps_mix, or mean_out
  close to but not exactly on tau_low, tau_high or r_out_max).
  """
  k = len(r_out)
  present = [math.isfinite(x) for x in r_reason]
  missing = not all(present)
  good = [x for x, ok in zip(r_reason, present) if ok]
  fill = _mean(good) if good else 0.0
  r_reason = [x if ok else fill for x, ok in zip(r_reason, present)]
  r_mix = [r_out[j] + r_reason[j] for j in range(k)]

  mean_out, sd_out = _mean(r_out), _pop_sd(r_out)
  mean_mix, sd_mix = _mean(r_mix), _pop_sd(r_mix)
  gate = sd_mix / (sd_out + sd_mix + cfg.eps_std)
  if missing:
    w = 0.0  # missing judge score: the group falls back to the outcome-only advantage
  elif not cfg.variance_gating:
    w = 1.0  # ablation: the mixed reward alone, w_g = 1 in the clip radius
  elif mean_out < cfg.r_out_max and gate < cfg.eps_mix:
    w = gate
  else:
    w = 0.0
  if not cfg.difficulty_weighting:
    d = 1.0
  elif cfg.tau_low < mean_out < cfg.tau_high:
    d = cfg.alpha_prio
  else:
    d = cfg.alpha_base

  adv = []
  for j in range(k):
    a_out = (r_out[j] - mean_out) / (sd_out + cfg.eps_adv) if sd_out > 0 else 0.0
    a_mix = (r_mix[j] - mean_mix) / (sd_mix + cfg.eps_adv) if sd_mix > 0 else 0.0
    adv.append(d * ((1 - w) * a_out + w * a_mix))
  return {
      "adv": adv,
      "gate": gate,
      "w": w,
      "d": d,
      "near_edge": abs(gate - cfg.eps_mix) < 1e-4 or any(
          0 < abs(mean_out - t) < 1e-5 for t in (cfg.tau_low, cfg.tau_high, cfg.r_out_max)),
  }


def leaf_rewards(tree: RolloutTree, cfg):
  r_out = [sum(leaf.rewards.get(c, 0.0) for c in cfg.reward_channels) for leaf in tree.leaves]
  r_reason = [leaf.rewards.get(cfg.reasoning_channel, 0.0) for leaf in tree.leaves]
  return r_out, r_reason


def tree_group(tree: RolloutTree, cfg) -> dict:
  return group(*leaf_rewards(tree, cfg), cfg)


def reference(tree: RolloutTree, cfg) -> np.ndarray:
  """node_leaf [num_nodes, num_leaves] for one canonical tree: leaf k's A_hyper on every
  policy node of its root-to-leaf path, 0 elsewhere."""
  adv = tree_group(tree, cfg)["adv"]
  out = np.zeros((len(tree.nodes), len(tree.leaves)))
  for k, leaf in enumerate(tree.leaves):
    node = leaf.node
    while node != -1:
      if tree.nodes[node].kind == NodeKind.POLICY:
        out[node, k] = adv[k]
      node = tree.nodes[node].parent
  return out


def clip_radius(trees, cfg) -> float:
  """Eq. 29 over a batch of trees (one group each)."""
  if not cfg.dynamic_clip:
    return cfg.clip_max
  w_bar = sum(tree_group(t, cfg)["w"] for t in trees) / len(trees)
  return cfg.clip_min + (1 - w_bar) * (cfg.clip_max - cfg.clip_min)
