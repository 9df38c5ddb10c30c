"""Slow pure-Python PORTool reference (arXiv 2510.26020, §3.2 Steps 2-3, Eqs. 2-3,
Theorem 3.1), for tests.

Written from the paper's formulas, read as in docs/methods/portool.md, with plain
loops over the host RolloutTree, in float64: trajectories are the leaf paths, steps the policy nodes on them,
the fork of a step is its nearest policy ancestor (or the root).
"""

from __future__ import annotations

import math

import numpy as np

from tree_rl.tree import NodeKind, RolloutTree

STD_ZERO = 1e-6  # a group with (numerically) zero spread has advantage 0
# (docs/methods/portool.md#z-score-convention)


def norm(values: list[float], ddof: int, eps: float) -> list[float]:
  """z-score of each value within the multiset `values` (PORTool's norm(x, S), §3.2 Step 3)."""
  g = len(values)
  mean = sum(values) / g
  if g <= ddof:
    return [0.0] * g
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (g - ddof))
  if std <= STD_ZERO:
    return [0.0] * g
  return [(v - mean) / (std + eps) for v in values]


def step_parent(tree: RolloutTree, i: int) -> int:
  """Nearest strict ancestor of node i that is a policy node, else the root."""
  j = tree.nodes[i].parent
  while j > 0 and tree.nodes[j].kind != NodeKind.POLICY:
    j = tree.nodes[j].parent
  return max(j, 0)


def forks(tree: RolloutTree, config) -> tuple[dict[int, list[int]], list[int]]:
  """Step-level children C(p) of every step-level node p, and the fork set F."""
  kids: dict[int, list[int]] = {}
  for i, node in enumerate(tree.nodes):
    if node.kind == NodeKind.POLICY:
      kids.setdefault(step_parent(tree, i), []).append(i)
  fork_set = [p for p, c in kids.items() if len(c) >= 2 and (p != 0 or config.root_is_fork)]
  return kids, fork_set


def reference(tree: RolloutTree, config) -> np.ndarray:
  """A[s, k] of Eq. 3 for every node s and leaf k of a canonical tree."""
  nodes, leaves = tree.nodes, tree.leaves
  n = len(leaves)
  out = np.zeros((len(nodes), n))
  if n == 0:
    return out
  policy = [node.kind == NodeKind.POLICY for node in nodes]
  paths = [tree.path(leaf.node) for leaf in leaves]
  steps_of = [[i for i in p if policy[i]] for p in paths]  # s_{k,1..T_k}
  big_t = [len(s) for s in steps_of]
  tau = [sum(len(nodes[i].tokens) for i in s) for s in steps_of]
  through = {i: [k for k in range(n) if i in paths[k]] for i in range(len(nodes))}  # m(s)
  depth = {}
  for s in steps_of:
    for t, i in enumerate(s, start=1):
      depth[i] = t
  r_out = [sum(leaf.rewards.get(c, 0.0) for c in config.reward_channels) for leaf in leaves]

  def r_fm(i):
    raw = nodes[i].rewards.get(config.format_channel, 0.0)
    return config.fm_half_range * (2 * raw - 1) if config.format_is_raw else raw

  def outcome_values(i):  # gamma^(T_k - t) R_out(tau_k), k in m(s)
    return [config.gamma ** (big_t[k] - depth[i]) * r_out[k] for k in through[i]]

  # Step rewards R(c) per fork (Eq. 2, the G rule of
  # docs/methods/portool.md#step-reward-g-rule).
  kids, fork_set = forks(tree, config)
  reward = {}
  for p, ch in kids.items():
    full_max = [max(outcome_values(c)) + r_fm(c) for c in ch]
    out_max = [max(outcome_values(c)) for c in ch]
    if config.g_rule in ("adaptive", "mix2"):
      test = full_max if config.g_rule == "adaptive" else out_max
      differ = any(abs(a - b) > config.g_tie_tol for a in test for b in test)
      use_max = len(ch) >= 2 and differ
    else:
      use_max = config.g_rule == "max"
    for c in ch:
      vals = [v + r_fm(c) for v in outcome_values(c)]
      reward[c] = max(vals) if use_max else sum(vals) / len(vals)

  a_fork = {}
  for p in fork_set:
    for c, z in zip(kids[p], norm([reward[c] for c in kids[p]], config.std_ddof,
                                  config.std_eps)):
      a_fork[c] = z
  a_trj = norm(r_out, config.std_ddof, config.std_eps)

  w1 = 0.0 if config.omega_mode == "fork_only" else 1.0
  for k in range(n):
    for i in steps_of[k]:
      traj = sum(a_trj[j] for j in through[i]) / len(through[i])
      fork = 0.0
      if i in a_fork:
        p = step_parent(tree, i)
        if config.omega_mode in ("theorem", "fork_only"):
          w2 = (n * tau[k] / (len(through[i]) * len(nodes[i].tokens) * len(kids[p])
                              * len(fork_set)))
        elif config.omega_mode == "no_scale":
          w2 = 1.0
        else:
          w2 = 0.0
        fork = w2 * a_fork[i]
      out[i, k] = w1 * traj + fork
  return out
