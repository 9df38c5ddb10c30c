"""RolloutTree.split_node, prune and preorder: edits that keep every root-to-leaf sequence.

A split moves a node's tail, with its children, leaf and per-node rewards, to a
new node inserted right after it; every path still spells the same tokens and
behaviour log-probs (so a split tree packs to the same sequences), and indices
after the node shift by one. Prune drops nodes no leaf passes through.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tree_rl.tree import Buckets, LeafTag, NodeKind, RolloutTree, TreeError, pack


def small_tree() -> RolloutTree:
  t = RolloutTree.new([1, 2, 3])
  a = t.add_node(0, NodeKind.POLICY, [4, 5, 6], logprobs=[-0.1, -0.2, -0.3],
                 entropies=[0.5, 0.7, 0.9], rewards={"format": 0.725})
  e = t.add_node(a, NodeKind.ENV, [7])
  b = t.add_node(e, NodeKind.POLICY, [8], logprobs=[-0.4])
  d = t.add_node(0, NodeKind.POLICY, [10, 11], logprobs=[-0.5, -0.6])
  t.add_leaf(b, {"outcome": 1.0})
  t.add_leaf(d, {"outcome": -1.0}, tag=LeafTag.BRANCH)
  return t


def _paths(tree):
  """Every leaf's (tokens, behaviour log-probs or None per token)."""
  out = []
  for path in tree.leaf_paths():
    toks, lps = [], []
    for i in path:
      n = tree.nodes[i]
      toks += n.tokens
      lps += n.logprobs if n.logprobs is not None else [None] * len(n.tokens)
    out.append((toks, lps))
  return out


def test_split_moves_tail_children_leaf_and_rewards():
  t = small_tree()
  before = _paths(t)
  tail = t.split_node(1, 2)
  assert tail == 2
  head, new = t.nodes[1], t.nodes[2]
  assert (head.tokens, head.logprobs, head.entropies) == ([4, 5], [-0.1, -0.2], [0.5, 0.7])
  assert (new.tokens, new.logprobs, new.entropies) == ([6], [-0.3], [0.9])
  assert new.parent == 1 and new.kind == NodeKind.POLICY and new.step == head.step
  # The step's format score sits on the node that ends the step.
  assert head.rewards == {} and new.rewards == {"format": 0.725}
  # Old nodes 2, 3, 4 are now 3, 4, 5; the env node hangs below the tail.
  assert [n.parent for n in t.nodes] == [-1, 0, 1, 2, 3, 0]
  assert [leaf.node for leaf in t.leaves] == [4, 5]
  assert _paths(t) == before
  t.check(vocab_size=12)


def test_split_of_a_leaf_node_moves_the_leaf_to_the_tail():
  t = small_tree()
  tail = t.split_node(4, 1)
  assert t.leaves[1].node == tail == 5 and t.leaves[1].tag == LeafTag.BRANCH
  assert t.nodes[4].tokens == [10] and t.nodes[5].tokens == [11]
  t.check()


@pytest.mark.parametrize("node, pos", [(0, 1), (1, 0), (1, 3), (9, 1)])
def test_split_rejects_the_root_and_empty_halves(node, pos):
  with pytest.raises(TreeError):
    small_tree().split_node(node, pos)


def test_prune_drops_dead_chains_and_remaps_leaves():
  t = small_tree()
  dead = t.add_node(2, NodeKind.POLICY, [9], logprobs=[-1.0])  # a discarded trajectory's step
  t.add_node(dead, NodeKind.ENV, [9])
  before = _paths(t)
  mapping = t.prune()
  assert mapping == [0, 1, 2, 3, 4, -1, -1]
  assert _paths(t) == before
  t.check()


def test_preorder_is_the_canonical_order():
  t = small_tree()
  t.split_node(1, 1)
  order = t.preorder()
  canon = t.canonical()
  assert [canon.nodes[c].tokens for c in range(len(order))] == [t.nodes[i].tokens for i in order]


@settings(max_examples=S.examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=S.general_tree(), data=st.data())
def test_random_splits_keep_every_path(tree, data):
  before = _paths(tree)
  for _ in range(data.draw(st.integers(1, 3))):
    cands = [i for i, n in enumerate(tree.nodes) if i > 0 and len(n.tokens) > 1]
    if not cands:
      break
    node = data.draw(st.sampled_from(cands))
    tree.split_node(node, data.draw(st.integers(1, len(tree.nodes[node].tokens) - 1)))
  tree.check(vocab_size=S.VOCAB)
  assert _paths(tree) == before


def _packed_paths(batch):
  """Each leaf's (tokens, loss mask, behaviour log-probs), read back from the packed arrays."""
  a = {k: np.asarray(getattr(batch, k))[0] for k in
       ("tokens", "node_of_token", "loss_mask", "behavior_logp", "parent", "leaf_node")}
  out = []
  for leaf in a["leaf_node"][a["leaf_node"] >= 0]:
    chain, i = [], int(leaf)
    while i >= 0:
      chain.insert(0, i)
      i = int(a["parent"][i])
    sel = np.concatenate([np.flatnonzero(a["node_of_token"] == i) for i in chain])
    out.append((a["tokens"][sel].tolist(), a["loss_mask"][sel].tolist(),
                a["behavior_logp"][sel].tolist()))
  return sorted(out)


def test_split_tree_packs_to_the_same_sequences():
  tree = small_tree()
  before = _packed_paths(pack([tree], Buckets.exact()))
  tree.split_node(1, 1)
  tree.split_node(5, 1)  # the other first step, now at index 5
  assert len(tree.nodes) == 7
  assert _packed_paths(pack([tree], Buckets.exact())) == before
