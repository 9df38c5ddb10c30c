"""pack / unpack: layout, bucketing, padding, round trip."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tests.tree.rollout_tree_test import small_tree
from tree_rl.tree import Buckets, NodeKind, TreeError, pack, unpack


def test_layout_of_small_tree():
  b = pack([small_tree()], Buckets(tokens=(16,), nodes=(8,), leaves=(4,), path_tokens=(8,)))
  assert b.shape == dict(B=1, L=16, N=8, K=4, C=3, P=8)
  np.testing.assert_array_equal(b.tokens[0, :10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
  # Depth-first: node 3 ([7]) and node 4 ([8, 9]) share the prefix up to token 6,
  # so both start at position 6; node 5 ([10]) starts right after the prompt.
  np.testing.assert_array_equal(b.positions[0, :10], [0, 1, 2, 3, 4, 5, 6, 6, 7, 3])
  np.testing.assert_array_equal(b.node_of_token[0, :11], [0, 0, 0, 1, 1, 2, 3, 4, 4, 5, -1])
  np.testing.assert_array_equal(b.loss_mask[0, :10], [0, 0, 0, 1, 1, 0, 1, 1, 1, 1])
  np.testing.assert_allclose(b.behavior_logp[0, 3:5], [-0.1, -0.2])
  np.testing.assert_array_equal(b.parent[0], [-1, 0, 1, 2, 2, 0, -1, -1])
  np.testing.assert_array_equal(b.node_kind[0, :7], [0, 1, 2, 1, 1, 1, -1])
  np.testing.assert_array_equal(b.leaf_node[0], [3, 4, 5, -1])
  np.testing.assert_allclose(b.leaf_rewards("outcome")[0], [1, 0, -1, 0])
  np.testing.assert_allclose(b.node_rewards("format")[0, 3], 0.725)
  np.testing.assert_array_equal(b.leaf_tag[0, :3], [0, 1, 0])


def test_buckets_pick_smallest_fit_and_name_overflow():
  trees = [small_tree()]
  b = pack(trees, Buckets(tokens=(8, 32, 64), nodes=(4, 16), leaves=(2, 8), path_tokens=(4, 16),
                          trees=(1, 4)))
  assert b.shape == dict(B=1, L=32, N=16, K=8, C=3, P=16)
  b = pack(trees * 3, Buckets(trees=(2, 4)))
  assert b.shape["B"] == 4
  assert not np.asarray(b.node_kind[3] >= 0).any()  # a padding tree
  with pytest.raises(TreeError, match=r"10 tokens do not fit the largest bucket 8"):
    pack(trees, Buckets(tokens=(8,)))


def test_absent_channel_packs_as_nan_only_when_asked():
  t = small_tree()
  t.leaves[0].rewards["reasoning"] = 0.75  # leaves 1 and 2 have no judge score
  sizes = Buckets(tokens=(16,), leaves=(4,))
  b = pack([t], sizes, absent_as_nan=("reasoning",))
  np.testing.assert_allclose(b.leaf_rewards("reasoning")[0], [0.75, np.nan, np.nan, 0.0])
  np.testing.assert_allclose(b.leaf_rewards("outcome")[0], [1, 0, -1, 0])
  np.testing.assert_allclose(pack([t], sizes).leaf_rewards("reasoning")[0], [0.75, 0, 0, 0])


def test_pack_checks_each_tree_and_names_it():
  bad = small_tree()
  bad.nodes[4].tokens[0] = 99
  with pytest.raises(TreeError, match=r"tree 1: node 4: token 99"):
    pack([small_tree(), bad], vocab_size=50)


@settings(max_examples=S.examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(S.general_tree(), min_size=1, max_size=3))
def test_unpack_inverts_pack(trees):
  batch = pack(trees, S.TEST_BUCKETS, vocab_size=S.VOCAB)
  back = unpack(batch)
  assert len(back) == len(trees)
  for orig, got in zip(trees, back):
    want = orig.canonical()
    assert [n.parent for n in got.nodes] == [n.parent for n in want.nodes]
    assert [n.kind for n in got.nodes] == [n.kind for n in want.nodes]
    assert [n.tokens for n in got.nodes] == [n.tokens for n in want.nodes]
    assert [n.step for n in got.nodes] == [n.step for n in want.nodes]
    for gn, wn in zip(got.nodes, want.nodes):
      if wn.kind == NodeKind.POLICY:
        np.testing.assert_allclose(gn.logprobs, wn.logprobs, rtol=1e-6)
      assert gn.rewards["format"] == pytest.approx(wn.rewards.get("format", 0.0))
    assert [l.node for l in got.leaves] == [l.node for l in want.leaves]
    assert [l.tag for l in got.leaves] == [l.tag for l in want.leaves]
    for gl, wl in zip(got.leaves, want.leaves):
      assert gl.rewards["outcome"] == pytest.approx(wl.rewards["outcome"])
    got.check(vocab_size=S.VOCAB)
