"""Tree baselines: Tree-GRPO (intra + inter) and TreeRPO (sibling z-scores of
backed-up means). TRACE (arXiv 2606.11119, §4.4, App. E.4) trains with one of these.

Sources: Tree-GRPO (Ji et al., "Tree Search for LLM Agent Reinforcement Learning",
arXiv 2509.21240) and TreeRPO (Yang et al., "TreeRPO: Tree Relative Policy Optimization",
arXiv 2506.05183), in the form TRACE restates them (Eqs. 45-49). tree_rl's readings:
docs/methods/grpo.md.

Both run on the node tree as packed. TreeRPO compresses chains
(docs/methods/grpo.md#treerpo-chain-compression): a node whose
parent has a single child belongs to the same edge as its parent, so every
policy token takes the advantage of its chain head (the nearest
ancestor-or-self whose parent has >= 2 children); tokens above the first
branch point get 0 (their group has one member).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tree_rl.algos.grpo import ZScoreConfig, _group_metrics, tree_zscore
from tree_rl.algos.registry import AdvEstimator, Advantages, register
from tree_rl.tree import segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import TreeStructure, structure
from tree_rl.tree.types import Array, Float, Int


def _deepest_ancestor(st: TreeStructure, cond) -> Int[Array, "B N"]:
  """Index of the deepest ancestor-or-self m of each node with cond[m], else -1.

  Depth-first order numbers every ancestor before its descendants, so the
  deepest qualifying ancestor is the one with the largest index.
  """
  n = st.ancestor.shape[-1]
  idx = jnp.where(st.ancestor & cond[:, None, :], jnp.arange(n)[None, None, :], -1)
  return idx.max(-1)


# ----------------------------------------------------------------------------
# Tree-GRPO
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeGRPOConfig(ZScoreConfig):
  """Tree-GRPO: the shared z-score fields (std type: docs/methods/grpo.md#std-convention)."""


@register(AdvEstimator.TREE_GRPO, TreeGRPOConfig)
def tree_grpo_advantages(batch: TreeBatch, config: TreeGRPOConfig) -> Advantages:
  """A_k = z_intra(R_k) + z_inter(R_k) (Tree-GRPO, Ji et al. 2025; TRACE eq. 48).

  intra: the leaves of the same sub-tree, i.e. those under the same child of
  the prompt root (one sub-tree per initial chain, the original Tree-GRPO
  reading; TRACE's "siblings sharing the parent prefix" reading leaves a
  factual leaf in several groups; docs/methods/grpo.md#tree-grpo-intra-group). inter: all leaves
  of the prompt. On a depth-1 tree every intra group has one member, so this
  reduces to GRPO.
  """
  st = structure(batch)
  r = batch.leaf_rewards(*config.reward_channels)
  first_level = _deepest_ancestor(st, batch.parent == 0)  # [B, N]
  safe_leaf = jnp.maximum(batch.leaf_node, 0)
  sub = jnp.take_along_axis(first_level, safe_leaf, axis=1)  # [B, K]
  n = batch.parent.shape[1]
  intra = segment.segment_zscore(r, sub, n, st.leaf_valid, ddof=config.std_ddof,
                                 eps=config.std_eps)
  inter = tree_zscore(r, st.leaf_valid, ddof=config.std_ddof, eps=config.std_eps)
  return Advantages.from_leaf_values(
      st.leaf_valid, intra + inter, metrics=_group_metrics(r, st.leaf_valid),
      extras={"intra": intra, "inter": inter})


# ----------------------------------------------------------------------------
# TreeRPO
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeRPOConfig(ZScoreConfig):
  """TreeRPO: the shared z-score fields (std type: docs/methods/grpo.md#std-convention)."""


def backed_up_means(batch: TreeBatch, st: TreeStructure, leaf_r: Float[Array, "B K"]):
  """TreeRPO's R (TRACE eq. 45): the leaf reward at a leaf, the *unweighted*
  mean of the children's R at an internal node.

  Unrolled, R(n) = sum_{k under n} R_k * prod_{m on the path n..leaf_k, m not
  the leaf} 1/|C(m)|. With c(m) = log|C(m)| (0 at leaves) and S(x) the sum of
  c over the ancestors-or-self of x, the product is exp(-(S(leaf_k) - S(n) +
  c(n))), so R is one [N, K] contraction instead of a bottom-up loop.
  """
  c = jnp.log(jnp.maximum(st.num_children, 1).astype(jnp.float32))  # [B, N]
  s_node = jnp.einsum("bnm,bm->bn", st.ancestor.astype(jnp.float32), c)
  s_leaf = jnp.take_along_axis(s_node, jnp.maximum(batch.leaf_node, 0), axis=1)  # [B, K]
  log_w = (s_node - c)[:, :, None] - s_leaf[:, None, :]  # [B, N, K], <= 0 under n
  w = jnp.where(st.leaves_under, jnp.exp(jnp.minimum(log_w, 0.0)), 0.0)
  return jnp.einsum("bnk,bk->bn", w, leaf_r)


@register(AdvEstimator.TREE_RPO, TreeRPOConfig)
def tree_rpo_advantages(batch: TreeBatch, config: TreeRPOConfig) -> Advantages:
  """Sibling z-scores of backed-up means (TreeRPO; TRACE eqs. 45-47).

  For every parent p with >= 2 children, A_c = (R(c) - mean_p R) / (std_p R +
  eps) over its children c; each policy node takes the advantage of its chain
  head. The per-node advantage is the same in every sequence through the
  node.
  """
  st = structure(batch)
  r_leaf = batch.leaf_rewards(*config.reward_channels)
  r_node = backed_up_means(batch, st, r_leaf)
  n = batch.parent.shape[1]
  parent_children = jnp.take_along_axis(st.num_children, jnp.maximum(batch.parent, 0), axis=1)
  branch_child = st.node_valid & (batch.parent >= 0) & (parent_children >= 2)
  z = segment.segment_zscore(r_node, batch.parent, n, branch_child, ddof=config.std_ddof,
                             eps=config.std_eps)
  head = _deepest_ancestor(st, branch_child)
  node_adv = jnp.where(head >= 0, jnp.take_along_axis(z, jnp.maximum(head, 0), axis=1), 0.0)
  metrics = _group_metrics(r_leaf, st.leaf_valid)
  tree_ok = st.node_valid.any(-1)
  n_groups = (st.num_children >= 2).sum(-1)
  metrics["groups_per_tree"] = jnp.where(tree_ok, n_groups, 0).sum() / jnp.maximum(tree_ok.sum(), 1)
  return Advantages.from_node_values(st.leaf_valid, node_adv, metrics=metrics,
                                     extras={"backed_up": r_node})
