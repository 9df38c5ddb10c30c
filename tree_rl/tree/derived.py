"""Arrays derived from a TreeBatch inside jit.

`structure(batch)` computes, per tree, the ancestor-or-self matrix, depths,
which leaves pass through each node, child counts and policy-token counts;
the rest (tree attention mask, per-token loss weights, flattened root-to-leaf
sequences) builds on it. Nothing loops over nodes, leaves or tokens: `pack`
emits each node's depth-first subtree range and token counts, so ancestry is a
comparison (m is an ancestor-or-self of n iff m <= n < subtree_end[m]) and
everything else is a gather, a masked reduction or a scatter with static shapes.
"""

from __future__ import annotations

import enum

import flax.struct
import jax
import jax.numpy as jnp

from tree_rl.tree.batch import PAD_KIND, TreeBatch
from tree_rl.tree.types import Array, Bool, Float, Int, NodeKind


class LossAggregation(str, enum.Enum):
  """How per-token losses of the K root-to-leaf sequences are combined.

  All three normalise over the whole batch (every trained leaf of every tree).
  """

  TOKEN_MEAN = "token_mean"  # DAPO: sum over all tokens / total tokens
  SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"  # GRPO/PORTool: 1/|seq| then 1/#seq
  SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"  # Dr.GRPO: token sum, then 1/#seq

  @classmethod
  def _missing_(cls, value):
    raise ValueError(
        f"unknown loss aggregation {value!r}; valid: {[m.value for m in cls]}"
    )


@flax.struct.dataclass
class TreeStructure:
  """Per-tree structure derived from parent pointers and token ownership."""

  node_valid: Bool[Array, "B N"]
  leaf_valid: Bool[Array, "B K"]
  ancestor: Bool[Array, "B N N"]  # [b, n, m]: m is an ancestor-or-self of n
  depth: Int[Array, "B N"]  # root 0
  leaves_under: Bool[Array, "B N K"]  # leaf k's path passes through node n
  num_children: Int[Array, "B N"]
  num_leaves_under: Int[Array, "B N"]
  node_tokens: Int[Array, "B N"]
  node_policy_tokens: Int[Array, "B N"]
  path_policy_tokens: Int[Array, "B K"]  # policy tokens on leaf k's root-to-leaf path
  is_policy: Bool[Array, "B N"]


@jax.jit
def structure(batch: TreeBatch) -> TreeStructure:
  """The per-tree structure, from the per-node arrays `pack` emits: subtree ranges give the
  ancestor test (m <= n < subtree_end[m]) and the leaves under each node as comparisons,
  so nothing here loops over nodes or passes over the L tokens. Jitted: inside a program it
  is inlined; called on host arrays it is one compiled program per batch shape, not a
  dozen op-by-op dispatches."""
  n_nodes = batch.parent.shape[1]
  node_valid = batch.node_kind != PAD_KIND
  leaf_valid = batch.leaf_node >= 0
  idx = jnp.arange(n_nodes, dtype=jnp.int32)
  end = batch.subtree_end
  # anc[b, n, m]: m <= n < end[b, m] (a padding node's range is empty).
  anc = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, :, None] < end[:, None, :])
  depth = anc.sum(-1).astype(jnp.int32) - 1
  # under[b, n, k]: leaf k's node lies in n's subtree.
  leaf = batch.leaf_node[:, None, :]
  under = (idx[None, :, None] <= leaf) & (leaf < end[:, :, None]) & leaf_valid[:, None, :]
  # Children per node: a scatter-add over parents (the root's -1 and padding dropped).
  slot = jnp.where(node_valid & (batch.parent >= 0), batch.parent, n_nodes)
  num_children = jax.vmap(lambda s: jnp.zeros(n_nodes, jnp.int32).at[s].add(1, mode="drop"))(slot)
  path_policy_tokens = jnp.einsum("bnk,bn->bk", under.astype(jnp.int32), batch.node_policy_tokens)
  return TreeStructure(
      node_valid=node_valid,
      leaf_valid=leaf_valid,
      ancestor=anc,
      depth=jnp.where(node_valid, depth, -1),
      leaves_under=under,
      num_children=num_children,
      num_leaves_under=under.sum(-1).astype(jnp.int32),
      node_tokens=batch.node_tokens,
      node_policy_tokens=batch.node_policy_tokens,
      path_policy_tokens=path_policy_tokens,
      is_policy=batch.node_kind == int(NodeKind.POLICY),
  )


def tree_attention_mask(batch: TreeBatch, st: TreeStructure | None = None) -> Bool[Array, "B L L"]:
  """mask[b, i, j]: token i attends to token j.

  True iff node(j) is an ancestor-or-self of node(i) and j <= i (depth-first
  layout puts every ancestor's tokens before a node's own). Dense O(L^2): for
  tests and small trees; the model uses a blockwise form.
  """
  st = st or structure(batch)
  node = jnp.maximum(batch.node_of_token, 0)
  valid = batch.node_of_token >= 0

  def per_tree(anc, node, valid):
    m = anc[node[:, None], node[None, :]]
    l = node.shape[0]
    causal = jnp.arange(l)[None, :] <= jnp.arange(l)[:, None]
    return m & causal & valid[:, None] & valid[None, :]

  return jax.vmap(per_tree)(st.ancestor, node, valid)


def token_leaf_mask(batch: TreeBatch, st: TreeStructure) -> Bool[Array, "B L K"]:
  """[b, t, k]: token t lies on leaf k's root-to-leaf path."""
  node = jnp.maximum(batch.node_of_token, 0)
  m = jnp.take_along_axis(st.leaves_under, node[:, :, None], axis=1)
  return m & (batch.node_of_token >= 0)[:, :, None]


def sequence_weights(
    batch: TreeBatch,
    mode: LossAggregation | str,
    leaf_mask: Bool[Array, "B K"] | None = None,
    st: TreeStructure | None = None,
) -> Float[Array, "B K"]:
  """Weight w_k of each policy token of leaf k's sequence in the loss.

  token_mean: 1 / (total policy tokens of all trained sequences);
  seq_mean_token_mean: 1 / (#sequences * |seq_k|);
  seq_mean_token_sum: 1 / #sequences.
  `leaf_mask` selects the trained leaves (APPO: initial rollouts only).
  """
  mode = LossAggregation(mode)
  st = st or structure(batch)
  trained = st.leaf_valid if leaf_mask is None else st.leaf_valid & leaf_mask
  lens = st.path_policy_tokens.astype(jnp.float32)
  n_seq = jnp.maximum(trained.sum(), 1).astype(jnp.float32)
  if mode == LossAggregation.TOKEN_MEAN:
    w = jnp.ones_like(lens) / jnp.maximum((lens * trained).sum(), 1.0)
  elif mode == LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    w = 1.0 / (n_seq * jnp.maximum(lens, 1.0))
  else:
    w = jnp.ones_like(lens) / n_seq
  return jnp.where(trained, w, 0.0)


def token_loss_weights(
    batch: TreeBatch,
    mode: LossAggregation | str,
    leaf_mask: Bool[Array, "B K"] | None = None,
    st: TreeStructure | None = None,
) -> Float[Array, "B L"]:
  """Per-token weights on the packed tree equal to the flattened-leaf weights.

  A token shared by several leaves appears once in the tree and once per leaf
  when flattened; its tree weight is the sum of its copies' weights:
  weight(t) = sum_k [t on path k] * w_k * loss_mask(t).
  """
  st = st or structure(batch)
  w = sequence_weights(batch, mode, leaf_mask, st)
  node_w = jnp.einsum("bnk,bk->bn", st.leaves_under.astype(jnp.float32), w)
  node = jnp.maximum(batch.node_of_token, 0)
  tok_w = jnp.take_along_axis(node_w, node, axis=1)
  return jnp.where(batch.loss_mask & (batch.node_of_token >= 0), tok_w, 0.0)


def prev_token_index(batch: TreeBatch) -> Int[Array, "B L"]:
  """Packed index of the token before each token in its own sequence.

  Inside a node it is t - 1; the first token of a node follows the last token
  of its parent node (the depth-first layout puts that parent earlier). -1
  for the root's first token and on padding. A model scores token t from the
  hidden state at prev(t), so every token, shared or not, is scored once.
  """
  n_nodes = batch.parent.shape[1]
  node = batch.node_of_token
  key = jnp.where(node >= 0, node, n_nodes)
  # end[n] = one past the last token of node n (node_of_token is sorted).
  end = jax.vmap(lambda k: jnp.searchsorted(k, jnp.arange(n_nodes), side="right"))(key)
  parent = jnp.take_along_axis(batch.parent, jnp.maximum(node, 0), axis=1)
  parent_last = jnp.take_along_axis(end, jnp.maximum(parent, 0), axis=1) - 1
  same = jnp.pad(node[:, 1:] == node[:, :-1], ((0, 0), (1, 0)))
  t = jnp.arange(node.shape[1])[None, :]
  prev = jnp.where(same, t - 1, jnp.where(parent >= 0, parent_last, -1))
  return jnp.where(node >= 0, prev, -1).astype(jnp.int32)


def path_token_index(
    batch: TreeBatch, st: TreeStructure, leaf_ids: Int[Array, "B J"], path_len: int
) -> Int[Array, "B J P"]:
  """Index into the packed tree of each token of the selected leaves' paths.

  Result[b, j, p] is the packed index of the p-th token of the root-to-leaf
  sequence of leaf `leaf_ids[b, j]`, or -1 past its end (or for leaf id -1).
  Uses `positions`: a token's position is its offset in its own sequence.
  """
  l = batch.tokens.shape[1]
  node = jnp.maximum(batch.node_of_token, 0)
  safe = jnp.maximum(leaf_ids, 0)

  def per_tree(under, node, tok_valid, positions, leaves, leaf_ok):
    on = under[node][:, leaves] & tok_valid[:, None] & leaf_ok[None, :]  # [L, J]
    dest = jnp.where(on, positions[:, None], path_len)  # out of range -> dropped
    src = jnp.broadcast_to(jnp.arange(l)[:, None], on.shape)
    out = jnp.full((leaves.shape[0], path_len), -1, jnp.int32)
    j_idx = jnp.broadcast_to(jnp.arange(leaves.shape[0])[None, :], on.shape)
    return out.at[j_idx, dest].set(src, mode="drop")

  leaf_ok = (leaf_ids >= 0) & jnp.take_along_axis(st.leaf_valid, safe, axis=1)
  return jax.vmap(per_tree)(
      st.leaves_under, node, batch.node_of_token >= 0, batch.positions, safe, leaf_ok
  )


@flax.struct.dataclass
class FlatLeaves:
  """The K root-to-leaf sequences of every tree, padded to P tokens."""

  tokens: Int[Array, "B K P"]
  positions: Int[Array, "B K P"]
  loss_mask: Bool[Array, "B K P"]
  behavior_logp: Float[Array, "B K P"]
  token_index: Int[Array, "B K P"]  # index into the packed tree, -1 on padding
  weights: Float[Array, "B K P"]  # per-token loss weights under `mode`


def gather_tokens(x: Array, index: Int[Array, "B ..."], fill=0) -> Array:
  """x[b, index[b, ...]] with `fill` where index < 0. x is [B, L, ...]."""
  b = x.shape[0]
  flat = index.reshape(b, -1)
  out = jnp.take_along_axis(
      x.reshape(b, x.shape[1], -1), jnp.maximum(flat, 0)[:, :, None], axis=1
  )
  out = out.reshape(index.shape + x.shape[2:])
  mask = (index >= 0).reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.where(mask, out, fill)


def flatten_leaves(
    batch: TreeBatch,
    mode: LossAggregation | str = LossAggregation.SEQ_MEAN_TOKEN_MEAN,
    leaf_mask: Bool[Array, "B K"] | None = None,
    st: TreeStructure | None = None,
) -> FlatLeaves:
  """The K root-to-leaf sequences, with per-token loss weights.

  The invariant tested against the tree form: for any per-token quantity x,
  sum(token_loss_weights * x) over the tree equals sum(weights * x[token_index])
  over the flattened sequences.
  """
  st = st or structure(batch)
  k = batch.leaf_node.shape[1]
  leaf_ids = jnp.where(st.leaf_valid, jnp.arange(k)[None, :], -1)
  idx = path_token_index(batch, st, leaf_ids, batch.max_path_len)
  loss_mask = gather_tokens(batch.loss_mask, idx, False)
  w = sequence_weights(batch, mode, leaf_mask, st)
  return FlatLeaves(
      tokens=gather_tokens(batch.tokens, idx),
      positions=gather_tokens(batch.positions, idx),
      loss_mask=loss_mask,
      behavior_logp=gather_tokens(batch.behavior_logp, idx, 0.0),
      token_index=idx,
      weights=jnp.where(loss_mask, w[:, :, None], 0.0),
  )
