"""Slow pure-Python reference for APPO (arXiv 2606.12384, §3.2-3.3, Eqs. 4-7), written from
the paper's formulas as read in docs/methods/appo.md.

Plain loops over a host RolloutTree in canonical order (tree.canonical(): the
packed order). Token arrays (`logp`, `entropy`) are flat over the tree's
tokens in that order, node after node, as `pack` lays them out.
"""

from __future__ import annotations

import math

import numpy as np

from tree_rl.tree import LeafTag, NodeKind, RolloutTree

REWARD_STD_FLOOR = 1e-6  # reward z-scores: 0 for a group without spread
TOKEN_STD_FLOOR = 1e-8  # docs/methods/appo.md#zero-spread-z-scores
LOG_CLAMP = 20.0  # docs/methods/appo.md#future-value-clamp


def _mean_std(vals, ddof):
  if not vals:
    return 0.0, 0.0
  m = sum(vals) / len(vals)
  if len(vals) <= ddof:
    return m, 0.0
  return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - ddof))


def _z(x, mean, std, eps):
  return (x - mean) / (std + eps) if std > REWARD_STD_FLOOR else 0.0


def _reward(tree, k, config):
  return float(sum(tree.leaves[k].rewards.get(c, 0.0) for c in config.reward_channels))


def group_zscores(tree: RolloutTree, config):
  """(z_I per INIT leaf, z_B per BRANCH leaf, stats_B) as dicts keyed by leaf index."""
  init = [k for k, l in enumerate(tree.leaves) if l.tag == LeafTag.INIT]
  branch = [k for k, l in enumerate(tree.leaves) if l.tag == LeafTag.BRANCH]
  r = {k: _reward(tree, k, config) for k in init + branch}
  if config.dual_group:
    stats_i = _mean_std([r[k] for k in init], config.std_ddof)
    stats_b = _mean_std([r[k] for k in branch], config.std_ddof)
  else:
    stats_i = stats_b = _mean_std([r[k] for k in init + branch], config.std_ddof)
  z_i = {k: _z(r[k], *stats_i, config.std_eps) for k in init}
  z_b = {k: _z(r[k], *stats_b, config.std_eps) for k in branch}
  return z_i, z_b, stats_b


def reference(tree: RolloutTree, config) -> np.ndarray:
  """A_base[node, leaf] of Eq. 6 under config.base_adv_mode
  (docs/methods/appo.md#base-advantage-reading)."""
  out = np.zeros((len(tree.nodes), len(tree.leaves)))
  z_i, z_b, stats_b = group_zscores(tree, config)
  paths = tree.leaf_paths()
  for k, zk in z_i.items():
    for n in paths[k]:
      if tree.nodes[n].kind != NodeKind.POLICY:
        continue
      shared = [b for b in z_b if n in paths[b]]  # S(n, i): branches sharing node n
      if config.base_adv_mode == "literal":
        if z_b:
          out[n, k] = 0.5 * (zk + _z(_reward(tree, k, config), *stats_b, config.std_eps))
        else:
          out[n, k] = zk
      elif not shared:
        out[n, k] = zk
      else:
        mean_b = sum(z_b[b] for b in shared) / len(shared)
        out[n, k] = 0.5 * (zk + mean_b) if config.base_adv_mode == "avg_flowback" else zk + mean_b
  return out


# ----------------------------------------------------------------------------
# Token-level pieces: Omega (Eq. 4), token scale (Eq. 7), Branching Score (Eq. 5)
# ----------------------------------------------------------------------------


def _path_tokens(tree: RolloutTree, leaf_node: int):
  """[(flat token index, node, offset in node)] along the root-to-leaf sequence."""
  start, acc = [], 0
  for node in tree.nodes:
    start.append(acc)
    acc += len(node.tokens)
  return [(start[n] + j, n, j) for n in tree.path(leaf_node)
          for j in range(len(tree.nodes[n].tokens))]


def _omegas(tree, toks, logp, config):
  """Omega_i = exp(clamp(sum_{j >= i} gamma^(j - i) x_j)), the O(L^2) definition."""
  gamma = 2.0 ** (-1.0 / config.tau_half)
  xs = []
  for t, n, j in toks:
    node = tree.nodes[n]
    # The kernel sees behaviour log-probs as stored by pack (float32).
    behav = float(np.float32(node.logprobs[j])) if node.kind == NodeKind.POLICY else 0.0
    xs.append(float(logp[t]) - behav if node.kind == NodeKind.POLICY else 0.0)
  out = []
  for i in range(len(xs)):
    s = sum(gamma ** (j - i) * xs[j] for j in range(i, len(xs)))
    out.append(math.exp(min(max(s, -LOG_CLAMP), LOG_CLAMP)))
  return out


def reference_omega(tree: RolloutTree, config, logp) -> dict[int, list[float]]:
  """Omega along every INIT leaf's path, keyed by leaf index."""
  return {k: _omegas(tree, _path_tokens(tree, l.node), logp, config)
          for k, l in enumerate(tree.leaves) if l.tag == LeafTag.INIT}


def reference_token_scale(tree: RolloutTree, config, logp) -> np.ndarray:
  """1 + b * clip(Omega, c_lo, c_hi) on INIT-path policy tokens, 1 elsewhere; flat [T]."""
  lo, hi = config.fut_clip
  scale = np.ones(tree.num_tokens())
  for k, leaf in enumerate(tree.leaves):
    if leaf.tag != LeafTag.INIT:
      continue
    toks = _path_tokens(tree, leaf.node)
    for (t, n, _), om in zip(toks, _omegas(tree, toks, logp, config)):
      if tree.nodes[n].kind == NodeKind.POLICY:
        scale[t] = 1.0 + config.b * min(max(om, lo), hi)
  return scale


def _token_z(vals, valid, ddof):
  m, s = _mean_std([v for v, ok in zip(vals, valid) if ok], ddof)
  if s < TOKEN_STD_FLOOR:
    return [0.0] * len(vals), True
  return [(v - m) / s if ok else 0.0 for v, ok in zip(vals, valid)], False


def reference_branching(tree: RolloutTree, config, logp, entropy) -> dict[int, dict]:
  """Per INIT leaf: lists bs, z_fut, z_ent, valid over the path positions (Eq. 5)."""
  lo, hi = config.fut_clip
  out = {}
  for k, leaf in enumerate(tree.leaves):
    if leaf.tag != LeafTag.INIT:
      continue
    toks = _path_tokens(tree, leaf.node)
    valid = [tree.nodes[n].kind == NodeKind.POLICY for _, n, _ in toks]
    clipped = [min(max(o, lo), hi) for o in _omegas(tree, toks, logp, config)]
    z_f, flat = _token_z(clipped, valid, config.std_ddof)
    z_e, _ = _token_z([float(entropy[t]) for t, _, _ in toks], valid, config.std_ddof)
    if config.bs_mode == "bs":
      bs = [a * b for a, b in zip(z_f, z_e)]
    elif config.bs_mode == "entropy":
      bs = list(z_e)
    else:
      bs = list(z_f)
    if flat and config.bs_mode != "entropy" and any(valid):
      if config.first_minibatch_fallback == "entropy":
        bs = list(z_e)
      else:
        valid = [False] * len(valid)
    zero = lambda xs: [x if ok else 0.0 for x, ok in zip(xs, valid)]
    out[k] = dict(bs=zero(bs), z_fut=zero(z_f), z_ent=zero(z_e), valid=valid)
  return out


def reference_select(bs, z_fut, z_ent, valid, num_branches, require_both_positive=True):
  """Top-B positions: both-positive first, then the rest by raw BS; cycle if short."""
  cands = [p for p in range(len(bs)) if valid[p]]
  strong = [p for p in cands if require_both_positive and z_fut[p] > 0 and z_ent[p] > 0]
  weak = [p for p in cands if p not in strong]
  order = sorted(strong, key=lambda p: (-bs[p], p)) + sorted(weak, key=lambda p: (-bs[p], p))
  if not order:
    return [-1] * num_branches
  return [order[j % len(order)] for j in range(num_branches)]
