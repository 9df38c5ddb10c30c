"""Slow pure-Python references for the group and tree baselines.

Written from the papers' definitions over trajectories and node objects, with
plain loops, independently of the jitted kernels.
"""

from __future__ import annotations

import math

import numpy as np

from tree_rl.tree import NodeKind, RolloutTree

STD_FLOOR = 1e-6


def zscores(values, ddof, eps, center_only=False):
  n = len(values)
  if n == 0:
    return []
  mean = sum(values) / n
  var = sum((v - mean) ** 2 for v in values) / (n - ddof) if n > ddof else 0.0
  std = math.sqrt(var)
  if std <= STD_FLOOR:
    return [0.0] * n
  if center_only:
    return [v - mean for v in values]
  return [(v - mean) / (std + eps) for v in values]


def leaf_reward(tree, leaf, channels):
  return sum(leaf.rewards.get(c, 0.0) for c in channels)


def _matrix(tree: RolloutTree, value) -> np.ndarray:
  """node_leaf with value(n, k) on the policy nodes of each leaf k's path."""
  out = np.zeros((len(tree.nodes), len(tree.leaves)))
  for k, path in enumerate(tree.leaf_paths()):
    for n in path:
      if tree.nodes[n].kind == NodeKind.POLICY:
        out[n, k] = value(n, k)
  return out


def per_leaf_matrix(tree: RolloutTree, adv) -> np.ndarray:
  """Each leaf's advantage on the policy nodes of its path."""
  return _matrix(tree, lambda n, k: adv[k])


def per_node_matrix(tree: RolloutTree, node_adv) -> np.ndarray:
  """One advantage per node, the same in every sequence through it."""
  return _matrix(tree, lambda n, k: node_adv[n])


def policy_length(tree, path):
  return sum(len(tree.nodes[n].tokens) for n in path if tree.nodes[n].kind == NodeKind.POLICY)


def mean_step_formatting(tree, path, half_range):
  """PORTool's GRPO_fm term: the mean of h (2 raw - 1) over the path's steps, a step being a
  policy node none of whose children is a policy node."""
  steps = [n for n in path if tree.nodes[n].kind == NodeKind.POLICY and not any(
      c.parent == n and c.kind == NodeKind.POLICY for c in tree.nodes)]
  if not steps:
    return 0.0
  return sum(half_range * (2 * tree.nodes[n].rewards.get("format", 0.0) - 1)
             for n in steps) / len(steps)


def grpo(tree, cfg):
  r = [leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves]
  if cfg.format_reward:
    r = [x + mean_step_formatting(tree, path, cfg.fm_half_range)
         for x, path in zip(r, tree.leaf_paths())]
  return per_leaf_matrix(tree, zscores(r, cfg.std_ddof, cfg.std_eps))


def dr_grpo(tree, cfg):
  r = [leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves]
  return per_leaf_matrix(tree, zscores(r, 0, 0.0, center_only=True))


def dapo(tree, cfg):
  r = []
  for leaf, path in zip(tree.leaves, tree.leaf_paths()):
    x = leaf_reward(tree, leaf, cfg.reward_channels)
    if cfg.overlong_shaping:
      y = policy_length(tree, path)
      free = cfg.max_response_tokens - cfg.overlong_buffer_tokens
      if y > cfg.max_response_tokens:
        pen = -1.0
      elif y > free:
        pen = (free - y) / cfg.overlong_buffer_tokens
      else:
        pen = 0.0
      x += cfg.overlong_penalty * pen
    r.append(x)
  return per_leaf_matrix(tree, zscores(r, cfg.std_ddof, cfg.std_eps))


def rloo(tree, cfg):
  r = [leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves]
  g = len(r)
  if g < 2 or max(r) - min(r) <= STD_FLOOR:
    return per_leaf_matrix(tree, [0.0] * g)
  adv = [r[k] - (sum(r) - r[k]) / (g - 1) for k in range(g)]
  return per_leaf_matrix(tree, adv)


def arpo(tree, cfg):
  r = [leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves]
  a = zscores(r, cfg.std_ddof, cfg.std_eps)
  if cfg.attribution == "soft":
    return per_leaf_matrix(tree, a)
  node_adv = {}
  paths = tree.leaf_paths()
  for n in range(len(tree.nodes)):
    below = [a[k] for k, p in enumerate(paths) if n in p]
    node_adv[n] = sum(below) / len(below) if below else 0.0
  return per_node_matrix(tree, node_adv)


def tree_grpo(tree, cfg):
  r = [leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves]
  paths = tree.leaf_paths()
  inter = zscores(r, cfg.std_ddof, cfg.std_eps)
  intra = [0.0] * len(r)
  for sub in {p[1] for p in paths}:
    members = [k for k, p in enumerate(paths) if p[1] == sub]
    z = zscores([r[k] for k in members], cfg.std_ddof, cfg.std_eps)
    for k, v in zip(members, z):
      intra[k] = v
  return per_leaf_matrix(tree, [a + b for a, b in zip(intra, inter)])


def tree_rpo(tree, cfg):
  kids = tree.children()
  reward_at = {l.node: leaf_reward(tree, l, cfg.reward_channels) for l in tree.leaves}

  def backed(n):  # unweighted mean over children, recursively (TRACE eq. 45)
    if not kids[n]:
      return reward_at[n]
    return sum(backed(c) for c in kids[n]) / len(kids[n])

  adv = {}
  for p in range(len(tree.nodes)):
    if len(kids[p]) >= 2:
      z = zscores([backed(c) for c in kids[p]], cfg.std_ddof, cfg.std_eps)
      for c, v in zip(kids[p], z):
        adv[c] = v
  node_adv = {}
  for n in range(len(tree.nodes)):
    m = n  # walk up to the chain head: the first node whose parent branches
    while m != -1 and m not in adv:
      m = tree.nodes[m].parent
    node_adv[n] = adv[m] if m != -1 else 0.0
  return per_node_matrix(tree, node_adv)


REFERENCES = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "dapo": dapo,
    "rloo": rloo,
    "arpo": arpo,
    "tree_grpo": tree_grpo,
    "tree_rpo": tree_rpo,
}
