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
import itertools
from collections.abc import Sequence

import flax.struct
import jax
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
  # Per-node structure `pack` derives on the host, so that kernels need no pass over
  # tokens or parents: n's depth-first subtree is the node range [n, subtree_end[n]) (the
  # ancestor test is m <= n < subtree_end[m]; padding: subtree_end[n] = n, an empty range);
  # node_tokens and node_policy_tokens count n's tokens and its trained ones.
  subtree_end: Int[Array, "B N"]
  node_tokens: Int[Array, "B N"]
  node_policy_tokens: Int[Array, "B N"]
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
  if check:
    for b, tree in enumerate(trees):
      try:
        tree.check(vocab_size=vocab_size, reward_channels=required_channels)
      except TreeError as e:
        raise TreeError(f"tree {b}: {e}") from None
  arrays, static = _host_arrays(trees, buckets, reward_channels, absent_as_nan)
  return TreeBatch(**jax.device_put(arrays), **static)


def _host_arrays(trees: Sequence[RolloutTree], buckets: Buckets,
                 reward_channels: tuple[str, ...], absent_as_nan: tuple[str, ...]
                 ) -> tuple[dict[str, np.ndarray], dict[str, object]]:
  """`pack`'s work on the host: (the TreeBatch's arrays as numpy, its static fields)."""
  lays = [_Layout(tree) for tree in trees]

  n_trees = Buckets.pick("trees", buckets.trees, len(lays)) if buckets.trees else len(lays)
  L = Buckets.pick("tokens", buckets.tokens, max(t.num_tokens for t in lays))
  N = Buckets.pick("nodes", buckets.nodes, max(t.num_nodes for t in lays))
  K = Buckets.pick("leaves", buckets.leaves, max(len(t.leaves) for t in lays))
  P = Buckets.pick("path_tokens", buckets.path_tokens, max(t.max_path_tokens for t in lays))
  C = len(reward_channels)
  chan = {name: c for c, name in enumerate(reward_channels)}

  a = padded_arrays(n_trees, L, N, K, C)
  tokens, positions, node_of_token = a["tokens"], a["positions"], a["node_of_token"]
  loss_mask, behavior_logp, parent = a["loss_mask"], a["behavior_logp"], a["parent"]
  node_kind, step, node_reward = a["node_kind"], a["step"], a["node_reward"]
  leaf_node, leaf_reward, leaf_tag = a["leaf_node"], a["leaf_reward"], a["leaf_tag"]
  subtree_end, node_tokens = a["subtree_end"], a["node_tokens"]
  node_policy_tokens = a["node_policy_tokens"]

  for b, lay in enumerate(lays):
    n, t = lay.num_nodes, lay.num_tokens
    tokens[b, :t] = lay.tokens
    positions[b, :t] = lay.positions
    node_of_token[b, :t] = lay.node_of_token
    loss_mask[b, :t] = lay.loss_mask
    behavior_logp[b, :t] = lay.behavior_logp
    parent[b, :n] = lay.parent
    node_kind[b, :n] = lay.kind
    step[b, :n] = lay.step
    subtree_end[b, :n] = lay.subtree_end
    node_tokens[b, :n] = lay.lens
    node_policy_tokens[b, :n] = np.where(np.asarray(lay.kind) == int(NodeKind.POLICY), lay.lens, 0)
    for i, rewards in lay.node_rewards:
      for name, v in rewards.items():
        if name in chan:
          node_reward[b, i, chan[name]] = v
    for k, (node, leaf) in enumerate(lay.leaves):
      for name in absent_as_nan:
        if name in chan and name not in leaf.rewards:
          leaf_reward[b, k, chan[name]] = np.nan
      leaf_node[b, k] = node
      leaf_tag[b, k] = int(leaf.tag)
      for name, v in leaf.rewards.items():
        if name in chan:
          leaf_reward[b, k, chan[name]] = v

  return a, dict(
      reward_channels=tuple(reward_channels),
      max_path_len=P,
      max_loss_tokens=_policy_width(int(loss_mask.sum(axis=1).max()), L, bool(buckets.tokens)),
  )


def padded_arrays(n_trees: int, L: int, N: int, K: int, C: int) -> dict[str, np.ndarray]:
  """Every array field of a TreeBatch of these sizes, all padding (token, node and leaf
  index -1, node_kind PAD_KIND, empty subtree ranges, zeros elsewhere): what `pack` fills."""
  z = lambda *shape, dt=np.int32: np.zeros((n_trees,) + shape, dt)
  full = lambda value, *shape: np.full((n_trees,) + shape, value, np.int32)
  return dict(
      tokens=z(L), positions=z(L), node_of_token=full(-1, L), loss_mask=z(L, dt=bool),
      behavior_logp=z(L, dt=np.float32), parent=full(-1, N), node_kind=full(PAD_KIND, N),
      step=z(N), node_reward=z(N, C, dt=np.float32), leaf_node=full(-1, K),
      leaf_reward=z(K, C, dt=np.float32), leaf_tag=z(K),
      subtree_end=np.broadcast_to(np.arange(N, dtype=np.int32), (n_trees, N)).copy(),
      node_tokens=z(N), node_policy_tokens=z(N))


@dataclasses.dataclass(frozen=True)
class Packed:
  """What `pack_sound` gives a training step.

  Attributes:
    batch: the sound trees packed, or None when no tree was sound.
    bad: (task id, why) of each tree dropped.
    kv_blocks: with `attention_block`, the batch's `max_visible_blocks` (blockwise
      attention's bound, `tree_rl.models.attention.fit_attention`), computed from the host
      arrays before they go to the device; 0 when not asked for.
  """

  batch: TreeBatch | None
  bad: list[tuple[str, str]]
  kv_blocks: int = 0


def pack_sound(trees: Sequence[RolloutTree], buckets: Buckets,
               absent_as_nan: tuple[str, ...] = (), vocab_size: int | None = None,
               attention_block: int | None = None) -> Packed:
  """Packs the sound trees (a `Packed`).

  The trainer's entry to `pack`. A tree without leaves (every episode lost to a full
  context) is left out silently (the trainer counts those itself); one that fails
  `RolloutTree.check` (a NaN reward, ...) or holds more tokens than the largest bucket is
  dropped with a warning naming its task; with `vocab_size`, so is one holding a token
  outside the vocabulary. Leaf channels in `absent_as_nan` are NaN where a leaf lacks them
  (AWPO's missing judge score, docs/methods/awpo.md). With `attention_block`, the batch's
  blockwise-attention bound at that block size comes along (`Packed.kv_blocks`), so the
  step need not read the batch back from the device to fit its graph."""
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
  if not kept:
    return Packed(None, bad)
  # Checked above, tree by tree: not checked again.
  arrays, static = _host_arrays(kept, buckets, DEFAULT_REWARD_CHANNELS, absent_as_nan)
  kv = 0
  if attention_block:
    kv = max_visible_blocks(arrays["node_of_token"], arrays["parent"], attention_block,
                            arrays["subtree_end"])
  return Packed(TreeBatch(**jax.device_put(arrays), **static), bad, kv)


def check_bad_trees(step: int, bad: Sequence[tuple[str, str]], trees: int,
                    max_fraction: float) -> None:
  """Raises when more than `max_fraction` of a step's `trees` were dropped by `pack_sound`,
  naming each dropped tree's task and reason (config.rollout.max_bad_tree_fraction)."""
  if len(bad) > max_fraction * trees:
    named = "; ".join(f"task {t}: {why}" for t, why in bad)
    raise RuntimeError(f"step {step}: {len(bad)} of {trees} trees failed their checks, more than "
                       f"config.rollout.max_bad_tree_fraction={max_fraction}: {named}")


class _Layout:
  """One tree's host arrays in depth-first preorder (the order `RolloutTree.canonical`
  gives), built with a few array operations per tree: no copy of the tree, no per-token
  Python loop."""

  def __init__(self, tree: RolloutTree):
    order = tree.preorder()
    new = [0] * len(tree.nodes)
    for c, i in enumerate(order):
      new[i] = c
    nodes = [tree.nodes[i] for i in order]
    n = self.num_nodes = len(nodes)
    self.parent = [-1 if nd.parent < 0 else new[nd.parent] for nd in nodes]
    lens = self.lens = [len(nd.tokens) for nd in nodes]
    # A node's first position follows its parent's last; its path's token count likewise.
    start, path = [0] * n, [0] * n
    for c in range(n):
      p = self.parent[c]
      if p >= 0:
        start[c] = start[p] + lens[p]
      path[c] = start[c] + lens[c]
    size = [1] * n  # subtree sizes: children follow their parents in preorder
    for c in range(n - 1, 0, -1):
      size[self.parent[c]] += size[c]
    self.subtree_end = [c + size[c] for c in range(n)]
    self.kind = [int(nd.kind) for nd in nodes]
    self.step = [nd.step for nd in nodes]
    self.node_rewards = [(c, nd.rewards) for c, nd in enumerate(nodes) if nd.rewards]
    self.leaves = sorted(((new[lf.node], lf) for lf in tree.leaves), key=lambda x: x[0])
    self.max_path_tokens = max((path[c] for c, _ in self.leaves), default=0)
    t = self.num_tokens = sum(lens)
    self.tokens = np.fromiter(itertools.chain.from_iterable(nd.tokens for nd in nodes),
                              np.int32, t)
    lens_a = np.asarray(lens, np.int64)
    self.node_of_token = np.repeat(np.arange(n, dtype=np.int32), lens_a)
    first = np.cumsum(lens_a) - lens_a  # each node's first packed index
    self.positions = (np.asarray(start, np.int64)[self.node_of_token]
                      + np.arange(t) - first[self.node_of_token])
    self.loss_mask = (np.asarray(self.kind, np.int32) == int(NodeKind.POLICY))[self.node_of_token]
    self.behavior_logp = np.zeros(t, np.float32)
    self.behavior_logp[self.loss_mask] = np.fromiter(itertools.chain.from_iterable(
        nd.logprobs for nd in nodes if nd.kind == NodeKind.POLICY), np.float32,
        int(self.loss_mask.sum()))


def _policy_width(need: int, length: int, bucketed: bool) -> int:
  """`max_loss_tokens`: powers of two from 256 (few shapes, so few compiles of a
  training step), at most the row length; exact when the tokens are not bucketed."""
  if not bucketed:
    return max(need, 1)
  return min(max(256, 1 << max(0, need - 1).bit_length()), length)


def max_visible_blocks(node_of_token: np.ndarray, parent: np.ndarray, block: int,
                       subtree_end: np.ndarray | None = None) -> int:
  """Host-side exact static bound for blockwise attention's pairs
  (`tree_rl.models.attention.kv_block_pairs`) (numpy, no jit): the
  smallest `max_kv_blocks` whose nb * max_kv_blocks slots hold every row's visible
  (query block, key block) pairs.

  node_of_token `[B, L]`, parent `[B, N]` and subtree_end `[B, N]` as in TreeBatch;
  with subtree_end the ancestor test is a comparison for every row at once, without
  it each row's ancestors are followed up its parents.
  """
  node_of_token, parent = np.asarray(node_of_token), np.asarray(parent)
  b, l = node_of_token.shape
  nb, n = l // block, parent.shape[1]
  idx = np.arange(n)
  if subtree_end is not None:  # anc[t, i, j]: j <= i < subtree_end[t, j]
    end = np.asarray(subtree_end)
    anc = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, :, None] < end[:, None, :])
  else:
    anc = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()
    for t in range(b):
      for i in range(n):
        if parent[t, i] >= 0:
          anc[t, i] |= anc[t, parent[t, i]]
  # present[t, q, i]: block q holds a token of node i (padding tokens to a dropped column).
  present = np.zeros((b, nb, n + 1), np.float32)
  cols = np.where(node_of_token >= 0, node_of_token, n).reshape(b, nb, block)
  present[np.arange(b)[:, None, None], np.arange(nb)[None, :, None], cols] = 1.0
  present = present[:, :, :n]
  vis = np.einsum("bqi,bij,bkj->bqk", present, anc.astype(np.float32), present,
                  optimize=True) > 0
  vis &= np.tril(np.ones((nb, nb), bool))
  return max(1, int(-(-vis.sum((1, 2)).max() // nb)))


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
