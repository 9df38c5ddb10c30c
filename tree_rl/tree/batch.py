"""TreeBatch: rollout trees as padded device arrays.

`pack` lays every tree's nodes out in depth-first preorder, each node's tokens
contiguous, and pads to bucketed static sizes so that shapes do not change
from step to step (`pack_sound`, the trainer's entry, drops the trees that fail
their checks first). `unpack` goes back to host trees. Everything else (the
ancestor matrix, leaves under each node, the tree attention mask, per-token
loss weights, the flattened root-to-leaf sequences) is derived inside jit by
`tree_rl.tree.derived`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np
from absl import logging

from tree_rl.tree.rollout_tree import Leaf, Node, RolloutTree, TreeError
from tree_rl.tree.types import DEFAULT_REWARD_CHANNELS, Array, Bool, Float, Int, LeafTag, NodeKind

PAD_KIND = -1  # node_kind of padding nodes.


@flax.struct.dataclass
class TreeBatch:
  """B packed rollout trees. Padding: node/leaf index -1, node_kind -1."""

  tokens: Int[Array, "B L"]
  positions: Int[Array, "B L"]  # position in the token's own root-to-leaf sequence
  node_of_token: Int[Array, "B L"]  # -1 on padding
  loss_mask: Bool[Array, "B L"]  # True on policy tokens
  behavior_logp: Float[Array, "B L"]
  parent: Int[Array, "B N"]  # -1 for the root and padding; parent < child
  node_kind: Int[Array, "B N"]  # NodeKind, -1 on padding
  step: Int[Array, "B N"]
  node_reward: Float[Array, "B N C"]
  leaf_node: Int[Array, "B K"]  # -1 on padding
  leaf_reward: Float[Array, "B K C"]
  leaf_tag: Int[Array, "B K"]
  # Static metadata (not traced): names of the C reward channels, and the
  # bucketed length of the longest root-to-leaf sequence, used as the static
  # width of flatten_leaves.
  reward_channels: tuple[str, ...] = flax.struct.field(
      pytree_node=False, default=DEFAULT_REWARD_CHANNELS
  )
  max_path_len: int = flax.struct.field(pytree_node=False, default=0)
  # Bucketed number of policy tokens in the fullest row (0: not known), the static
  # width of `tree_logprobs(..., policy_only=True)`: the vocabulary projection of a
  # training step runs on the policy tokens only, not on prompts and tool replies.
  max_loss_tokens: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def shape(self) -> dict[str, int]:
    b, l = self.tokens.shape
    return dict(B=b, L=l, N=self.parent.shape[1], K=self.leaf_node.shape[1],
                C=len(self.reward_channels), P=self.max_path_len)

  def channel_index(self, name: str) -> int:
    try:
      return self.reward_channels.index(name)
    except ValueError:
      raise KeyError(
          f"unknown reward channel {name!r}; this batch has {self.reward_channels}"
      ) from None

  def leaf_rewards(self, *names: str) -> Float[Array, "B K"]:
    """Sum of the named leaf reward channels, 0 on padding leaves."""
    out = sum(self.leaf_reward[..., self.channel_index(n)] for n in names)
    return jnp.where(self.leaf_node >= 0, out, 0.0)

  def node_rewards(self, name: str) -> Float[Array, "B N"]:
    return self.node_reward[..., self.channel_index(name)]


@dataclasses.dataclass(frozen=True)
class Buckets:
  """Allowed static sizes. Each dimension takes the smallest bucket that fits.

  `trees=None` keeps the exact number of trees (no padding trees).
  """

  tokens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
  nodes: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
  leaves: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  path_tokens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
  trees: tuple[int, ...] | None = None

  @staticmethod
  def exact() -> "Buckets":
    """Buckets that fit any size exactly (tests and benchmarks)."""
    return Buckets(tokens=(), nodes=(), leaves=(), path_tokens=(), trees=None)

  @staticmethod
  def pick(name: str, buckets: tuple[int, ...] | None, need: int) -> int:
    if not buckets:
      return max(need, 1)
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
      raise TreeError(
          f"pack: {need} {name} do not fit the largest bucket {buckets[-1]};"
          f" add a larger bucket (buckets: {buckets})"
      )
    return buckets[i]


def pack(
    trees: Sequence[RolloutTree],
    buckets: Buckets | None = None,
    reward_channels: tuple[str, ...] = DEFAULT_REWARD_CHANNELS,
    vocab_size: int | None = None,
    check: bool = True,
    required_channels: tuple[str, ...] = ("outcome",),
    absent_as_nan: tuple[str, ...] = (),
) -> TreeBatch:
  """Packs host trees into a TreeBatch with bucketed static sizes.

  Args:
    trees: one RolloutTree per prompt.
    buckets: allowed sizes; defaults to `Buckets()`.
    reward_channels: the C channel names; missing channels are stored as 0.
    vocab_size: checked against every token when `check` is True.
    check: run `RolloutTree.check` on every tree first (the error names the
      tree index and the node).
    required_channels: leaf channels `check` insists on.
    absent_as_nan: leaf channels whose absence means "no value" rather than 0:
      stored as NaN where a leaf lacks them (AWPO's judge score, whose NaN
      makes the estimator fall back to the outcome; docs/methods/awpo.md).

  Returns:
    A TreeBatch whose node order is each tree's depth-first preorder
    (`RolloutTree.canonical`).
  """
  buckets = buckets or Buckets()
  if not trees:
    raise TreeError("pack: no trees")
  canon = []
  for b, tree in enumerate(trees):
    if check:
      try:
        tree.check(vocab_size=vocab_size, reward_channels=required_channels)
      except TreeError as e:
        raise TreeError(f"tree {b}: {e}") from None
    canon.append(tree.canonical())

  n_trees = Buckets.pick("trees", buckets.trees, len(canon)) if buckets.trees else len(canon)
  L = Buckets.pick("tokens", buckets.tokens, max(t.num_tokens() for t in canon))
  N = Buckets.pick("nodes", buckets.nodes, max(len(t.nodes) for t in canon))
  K = Buckets.pick("leaves", buckets.leaves, max(len(t.leaves) for t in canon))
  P = Buckets.pick("path_tokens", buckets.path_tokens, max(t.max_path_tokens() for t in canon))
  C = len(reward_channels)
  chan = {name: c for c, name in enumerate(reward_channels)}

  tokens = np.zeros((n_trees, L), np.int32)
  positions = np.zeros((n_trees, L), np.int32)
  node_of_token = np.full((n_trees, L), -1, np.int32)
  loss_mask = np.zeros((n_trees, L), bool)
  behavior_logp = np.zeros((n_trees, L), np.float32)
  parent = np.full((n_trees, N), -1, np.int32)
  node_kind = np.full((n_trees, N), PAD_KIND, np.int32)
  step = np.zeros((n_trees, N), np.int32)
  node_reward = np.zeros((n_trees, N, C), np.float32)
  leaf_node = np.full((n_trees, K), -1, np.int32)
  leaf_reward = np.zeros((n_trees, K, C), np.float32)
  leaf_tag = np.zeros((n_trees, K), np.int32)

  for b, tree in enumerate(canon):
    offset = 0
    start_pos = np.zeros(len(tree.nodes), np.int64)  # position of a node's first token
    for i, node in enumerate(tree.nodes):
      n_tok = len(node.tokens)
      if node.parent >= 0:
        start_pos[i] = start_pos[node.parent] + len(tree.nodes[node.parent].tokens)
      sl = slice(offset, offset + n_tok)
      tokens[b, sl] = node.tokens
      positions[b, sl] = start_pos[i] + np.arange(n_tok)
      node_of_token[b, sl] = i
      if node.kind == NodeKind.POLICY:
        loss_mask[b, sl] = True
        behavior_logp[b, sl] = node.logprobs
      parent[b, i] = node.parent
      node_kind[b, i] = int(node.kind)
      step[b, i] = node.step
      for name, v in node.rewards.items():
        if name in chan:
          node_reward[b, i, chan[name]] = v
      offset += n_tok
    for k, leaf in enumerate(tree.leaves):
      for name in absent_as_nan:
        if name in chan and name not in leaf.rewards:
          leaf_reward[b, k, chan[name]] = np.nan
      leaf_node[b, k] = leaf.node
      leaf_tag[b, k] = int(leaf.tag)
      for name, v in leaf.rewards.items():
        if name in chan:
          leaf_reward[b, k, chan[name]] = v

  return TreeBatch(
      tokens=jnp.asarray(tokens),
      positions=jnp.asarray(positions),
      node_of_token=jnp.asarray(node_of_token),
      loss_mask=jnp.asarray(loss_mask),
      behavior_logp=jnp.asarray(behavior_logp),
      parent=jnp.asarray(parent),
      node_kind=jnp.asarray(node_kind),
      step=jnp.asarray(step),
      node_reward=jnp.asarray(node_reward),
      leaf_node=jnp.asarray(leaf_node),
      leaf_reward=jnp.asarray(leaf_reward),
      leaf_tag=jnp.asarray(leaf_tag),
      reward_channels=tuple(reward_channels),
      max_path_len=P,
      max_loss_tokens=_policy_width(int(loss_mask.sum(axis=1).max()), L, bool(buckets.tokens)),
  )


def pack_sound(trees: Sequence[RolloutTree], buckets: Buckets,
               absent_as_nan: tuple[str, ...] = (), vocab_size: int | None = None
               ) -> tuple[TreeBatch | None, list[tuple[str, str]]]:
  """Packs the sound trees: (TreeBatch or None, [(task id, why)] of the bad ones dropped).

  The trainer's entry to `pack`. A tree without leaves (every episode lost to a full
  context) is left out silently (the trainer counts those itself); one that fails
  `RolloutTree.check` (a NaN reward, ...) or holds more tokens than the largest bucket is
  dropped with a warning naming its task; with `vocab_size`, so is one holding a token
  outside the vocabulary. Leaf channels in `absent_as_nan` are NaN where a leaf lacks them
  (AWPO's missing judge score, docs/methods/awpo.md)."""
  kept, bad = [], []
  for t in trees:
    if not t.leaves:
      continue
    try:
      t.check(vocab_size=vocab_size)
      if buckets.tokens and t.num_tokens() > buckets.tokens[-1]:
        raise TreeError(f"{t.num_tokens()} tokens exceed the largest bucket "
                        f"({buckets.tokens[-1]})")
    except TreeError as e:
      bad.append((str(t.meta.get("task_id")), str(e)))
      logging.warning("dropping the tree of task %s: %s", *bad[-1])
      continue
    kept.append(t)
  # Checked above, tree by tree: pack need not check them again.
  return (pack(kept, buckets, check=False, absent_as_nan=absent_as_nan) if kept else None), bad


def check_bad_trees(step: int, bad: Sequence[tuple[str, str]], trees: int,
                    max_fraction: float) -> None:
  """Raises when more than `max_fraction` of a step's `trees` were dropped by `pack_sound`,
  naming each dropped tree's task and reason (config.rollout.max_bad_tree_fraction)."""
  if len(bad) > max_fraction * trees:
    named = "; ".join(f"task {t}: {why}" for t, why in bad)
    raise RuntimeError(f"step {step}: {len(bad)} of {trees} trees failed their checks, more than "
                       f"config.rollout.max_bad_tree_fraction={max_fraction}: {named}")


def _policy_width(need: int, length: int, bucketed: bool) -> int:
  """`max_loss_tokens`: powers of two from 256 (few shapes, so few compiles of a
  training step), at most the row length; exact when the tokens are not bucketed."""
  if not bucketed:
    return max(need, 1)
  return min(max(256, 1 << max(0, need - 1).bit_length()), length)


def unpack(batch: TreeBatch) -> list[RolloutTree]:
  """Host trees from a TreeBatch (padding trees dropped).

  Only what the batch stores comes back: entropies and truncation flags are
  host-only, and every reward channel is present (0 where it was missing).
  The trees come back in canonical (depth-first) node order.
  """
  arrays = {f.name: np.asarray(getattr(batch, f.name))
            for f in dataclasses.fields(batch) if f.metadata.get("pytree_node", True)}
  chans = batch.reward_channels
  out = []
  for b in range(arrays["tokens"].shape[0]):
    kinds = arrays["node_kind"][b]
    n_nodes = int((kinds != PAD_KIND).sum())
    if n_nodes == 0:
      continue
    nodes = []
    for i in range(n_nodes):
      sel = arrays["node_of_token"][b] == i
      kind = NodeKind(int(kinds[i]))
      nodes.append(Node(
          parent=int(arrays["parent"][b, i]),
          kind=kind,
          tokens=arrays["tokens"][b][sel].tolist(),
          logprobs=(arrays["behavior_logp"][b][sel].tolist()
                    if kind == NodeKind.POLICY else None),
          step=int(arrays["step"][b, i]),
          rewards={c: float(arrays["node_reward"][b, i, j]) for j, c in enumerate(chans)},
      ))
    leaves = [
        Leaf(node=int(arrays["leaf_node"][b, k]),
             rewards={c: float(arrays["leaf_reward"][b, k, j]) for j, c in enumerate(chans)},
             tag=LeafTag(int(arrays["leaf_tag"][b, k])))
        for k in range(arrays["leaf_node"].shape[1]) if arrays["leaf_node"][b, k] >= 0
    ]
    out.append(RolloutTree(nodes=nodes, leaves=leaves))
  return out
