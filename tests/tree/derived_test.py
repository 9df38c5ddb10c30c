"""Derived arrays against brute force on the host trees, and the invariant
tree = flattened leaves for per-token loss weights."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tests.tree.rollout_tree_test import small_tree
from tree_rl.tree import (
    Buckets, LossAggregation, NodeKind, flatten_leaves, pack, sequence_weights, structure,
    token_loss_weights, tree_attention_mask,
)

# Jitted once per mode: op-by-op dispatch of the fori_loop would dominate the runtime.
jit_structure = jax.jit(structure)
jit_mask = jax.jit(tree_attention_mask)
jit_flatten = jax.jit(flatten_leaves, static_argnames="mode")
jit_token_weights = jax.jit(token_loss_weights, static_argnames="mode")
jit_seq_weights = jax.jit(sequence_weights, static_argnames="mode")


def to_np(struct):
  """Host copies of a struct's array fields (jax.device_get would rebuild the
  struct from numpy arrays, which the runtime shape checks reject)."""
  return type("Host", (), {k: np.asarray(v) for k, v in vars(struct).items()
                           if hasattr(v, "shape")})


SETTINGS = settings(max_examples=S.examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TREES = st.lists(st.one_of(S.general_tree(), S.portool_tree(), S.appo_tree()), min_size=1,
                 max_size=3)


def _layout(tree):
  """Host layout: per token (node, position), in canonical depth-first order."""
  c = tree.canonical()
  node_of, pos_of, start = [], [], {}
  for i, n in enumerate(c.nodes):
    start[i] = 0 if n.parent < 0 else start[n.parent] + len(c.nodes[n.parent].tokens)
    node_of += [i] * len(n.tokens)
    pos_of += list(range(start[i], start[i] + len(n.tokens)))
  return c, node_of, pos_of


@SETTINGS
@given(TREES)
def test_structure_matches_host(trees):
  batch = pack(trees, S.TEST_BUCKETS)
  s = to_np(jit_structure(batch))
  for b, t in enumerate(trees):
    c = t.canonical()
    n, k = len(c.nodes), len(c.leaves)
    kids = c.children()
    for i in range(n):
      path = set(c.path(i))
      np.testing.assert_array_equal(s.ancestor[b, i, :n], [j in path for j in range(n)])
      assert s.depth[b, i] == len(path) - 1
      assert s.num_children[b, i] == len(kids[i])
      assert s.node_tokens[b, i] == len(c.nodes[i].tokens)
      pol = len(c.nodes[i].tokens) if c.nodes[i].kind == NodeKind.POLICY else 0
      assert s.node_policy_tokens[b, i] == pol
    for j, p in enumerate(c.leaf_paths()):
      assert s.path_policy_tokens[b, j] == sum(
          len(c.nodes[i].tokens) for i in p if c.nodes[i].kind == NodeKind.POLICY)
      np.testing.assert_array_equal(s.leaves_under[b, :n, j], [i in p for i in range(n)])
    assert not s.ancestor[b, n:].any() and not s.leaves_under[b, :, k:].any()
    assert (s.depth[b, n:] == -1).all()


@SETTINGS
@given(TREES)
def test_attention_mask_matches_brute_force(trees):
  batch = pack(trees, S.TEST_BUCKETS)
  mask = np.asarray(jit_mask(batch))
  for b, t in enumerate(trees):
    c, node_of, _ = _layout(t)
    want = np.zeros(mask.shape[1:], bool)
    for i, ni in enumerate(node_of):
      path = set(c.path(ni))
      for j, nj in enumerate(node_of[: i + 1]):
        want[i, j] = nj in path
    np.testing.assert_array_equal(mask[b], want)


@SETTINGS
@given(TREES)
def test_flatten_leaves_gives_root_to_leaf_sequences(trees):
  batch = pack(trees, S.TEST_BUCKETS)
  flat = to_np(jit_flatten(batch))
  for b, t in enumerate(trees):
    c = t.canonical()
    for k, path in enumerate(c.leaf_paths()):
      toks = [x for i in path for x in c.nodes[i].tokens]
      mask = [c.nodes[i].kind == NodeKind.POLICY for i in path for _ in c.nodes[i].tokens]
      np.testing.assert_array_equal(flat.tokens[b, k, : len(toks)], toks)
      np.testing.assert_array_equal(flat.positions[b, k, : len(toks)], np.arange(len(toks)))
      np.testing.assert_array_equal(flat.loss_mask[b, k, : len(toks)], mask)
      assert (flat.token_index[b, k, len(toks):] == -1).all()
      np.testing.assert_array_equal(
          np.asarray(batch.tokens)[b][flat.token_index[b, k, : len(toks)]], toks)
    assert (flat.token_index[b, len(c.leaves):] == -1).all()


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_tree_weights_equal_flattened_weights(mode):
  @SETTINGS
  @given(TREES, st.integers(0, 2**31 - 1), st.booleans())
  def check(trees, seed, use_leaf_mask):
    batch = pack(trees, S.TEST_BUCKETS)
    rng = np.random.default_rng(seed)
    leaf_mask = jnp.asarray(rng.random(batch.leaf_node.shape) < 0.7) if use_leaf_mask else None
    x = jnp.asarray(rng.normal(size=batch.tokens.shape), jnp.float32)
    tree_sum = (jit_token_weights(batch, mode, leaf_mask) * x).sum()
    flat = jit_flatten(batch, mode, leaf_mask)
    x_flat = jnp.where(flat.token_index >= 0,
                       jnp.take_along_axis(x[:, None, :], jnp.maximum(flat.token_index, 0), 2), 0)
    np.testing.assert_allclose(tree_sum, (flat.weights * x_flat).sum(), rtol=1e-5, atol=1e-6)
    # With x == 1 the weights of token_mean / seq_mean_token_mean sum to 1.
    total = float(flat.weights.sum())
    n_trained = float(jit_seq_weights(batch, mode, leaf_mask).astype(bool).sum())
    if mode != LossAggregation.SEQ_MEAN_TOKEN_SUM and n_trained:
      assert total == pytest.approx(1.0, rel=1e-5)

  check()


def test_sequence_weights_by_hand():
  # small_tree leaves: policy lengths 3 (2+1), 4 (2+2), 1.
  batch = pack([small_tree()], Buckets.exact())
  w = lambda m: np.asarray(sequence_weights(batch, m))[0]
  np.testing.assert_allclose(w("token_mean"), [1 / 8] * 3)
  np.testing.assert_allclose(w("seq_mean_token_mean"), [1 / 9, 1 / 12, 1 / 3])
  np.testing.assert_allclose(w("seq_mean_token_sum"), [1 / 3] * 3)
  # Node 1 (tokens 4, 5) is shared by leaves 0 and 1: weight 1/9 + 1/12.
  tw = np.asarray(token_loss_weights(batch, "seq_mean_token_mean"))[0]
  np.testing.assert_allclose(tw[3:5], [1 / 9 + 1 / 12] * 2)
  assert tw[:3].sum() == 0 and tw[5] == 0  # prompt and env tokens
  with pytest.raises(ValueError, match="valid:.*token_mean"):
    LossAggregation("sequence_mean")


def test_one_compile_per_bucket():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def derived(batch):
    return structure(batch).leaves_under.sum(), tree_attention_mask(batch).sum()

  chex.clear_trace_counter()
  for seed in range(3):
    t = small_tree()
    t.nodes[3].tokens = [seed + 1] * (seed + 1)
    t.nodes[3].logprobs = [-0.1] * (seed + 1)
    derived(pack([t, small_tree()], S.TEST_BUCKETS))
