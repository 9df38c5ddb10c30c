"""Blockwise attention's static key-block bound: fitted exactly per batch, loud when too small.

The hand-worked batch: block 4, one tree of an 8-token prompt (blocks P0, P1) and four
4-token branches (blocks A, B, C, D), packed to L = 24 = 6 blocks. Visible (query
block, key block) pairs: P0 sees {P0}, P1 {P0, P1}, each branch {P0, P1, itself}:
1 + 2 + 4 * 3 = 15 pairs, so the bound (pair slots per query block) is
ceil(15 / 6) = 3; a bound of 2 holds 12 and drops pairs. Causal attention over the
same 24 tokens would have 21 pairs (bound 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import Decoder, ModelConfig
from tree_rl.models.attention import (KV_LADDER, AttentionConfig, AttentionFitter, TreeMask,
                                      attention_overflow, fit_attention, kv_block_pairs,
                                      max_visible_blocks, raise_on_overflow)
from tree_rl.models.logprobs import sequence_logprobs, tree_logprobs
from tree_rl.tree import Buckets, NodeKind, RolloutTree, derived, pack

BLOCK = 4


def _fork_batch(prompt: int = 8, branches: int = 4):
  """One tree: a `prompt`-token root and `branches` 4-token branches (one block each)."""
  tree = RolloutTree.new(list(range(3, 3 + prompt)))
  for b in range(branches):
    node = tree.add_node(0, NodeKind.POLICY, [20 + 4 * b + j for j in range(4)],
                         logprobs=[-1.0] * 4)
    tree.add_leaf(node, {"outcome": 1.0})
  return pack([tree], Buckets.exact())


def _model(bound: int, impl: str = "blockwise") -> Decoder:
  attn = AttentionConfig(impl, BLOCK, bound) if impl == "blockwise" else AttentionConfig()
  return Decoder(ModelConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0), attention_config=attn)


def _host(batch):
  return np.asarray(batch.node_of_token), np.asarray(batch.parent)


def test_the_hand_worked_batch_needs_bound_three():
  batch = _fork_batch()
  assert batch.tokens.shape == (1, 24)
  assert max_visible_blocks(*_host(batch), BLOCK) == 3
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)
  q_blk, k_blk, overflow = kv_block_pairs(tree, BLOCK, 3)
  assert not overflow and int((np.asarray(q_blk) >= 0).sum()) == 15
  assert kv_block_pairs(tree, BLOCK, 2)[2]  # 12 slots < 15 pairs


def test_fit_attention_takes_the_tightest_ladder_bound():
  batch = _fork_batch()
  fitted = fit_attention(AttentionConfig("blockwise", BLOCK, 1), *_host(batch))
  assert fitted == AttentionConfig("blockwise", BLOCK, 3)
  # A 20-token prompt (5 blocks: 1 + ... + 5 = 15 pairs) and 5 branches (6 pairs each)
  # is 45 pairs in 10 blocks: bound 5, which is not a rung, so the next rung, 6.
  wide = _fork_batch(prompt=20, branches=5)
  assert max_visible_blocks(*_host(wide), BLOCK) == 5 and 5 not in KV_LADDER
  assert fit_attention(AttentionConfig("blockwise", BLOCK, 1), *_host(wide)).max_kv_blocks == 6
  assert fit_attention(AttentionConfig(), *_host(batch)) == AttentionConfig()  # dense: as is
  with pytest.raises(ValueError, match="L=24 must be a multiple of the attention block 16"):
    fit_attention(AttentionConfig("blockwise", 16, 1), *_host(batch))


def test_fitter_caches_one_graph_per_bound_and_matches_dense():
  batch = _fork_batch()
  model = _model(bound=1)
  fit = AttentionFitter(model)
  graphdef = fit.graphdef(batch)
  assert fit.graphdef(batch) is graphdef  # one graph (and one compile) per bound
  fitted = nnx.merge(graphdef, nnx.state(model))
  assert fitted.attention_config.max_kv_blocks == 3
  assert model.attention_config.max_kv_blocks == 1  # the caller's model is not touched
  dense = _model(bound=0, impl="dense")
  np.testing.assert_allclose(np.asarray(tree_logprobs(fitted, batch)[0]),
                             np.asarray(tree_logprobs(dense, batch)[0]), atol=1e-5)


def test_a_shapes_bound_only_grows_and_changes_no_value():
  fork = _fork_batch()  # bound 3
  chain = RolloutTree.new(list(range(3, 11)))  # 8 + 16 tokens in a line: 21 pairs, bound 4
  chain.add_leaf(chain.add_node(0, NodeKind.POLICY, list(range(20, 36)), logprobs=[-1.0] * 16),
                 {"outcome": 1.0})
  chain = pack([chain], Buckets.exact())
  assert chain.tokens.shape == fork.tokens.shape == (1, 24)
  model = _model(bound=1)
  fit = AttentionFitter(model)
  tight = nnx.merge(fit.graphdef(fork), nnx.state(model))
  assert tight.attention_config.max_kv_blocks == 3
  assert fit.config(chain).max_kv_blocks == 4
  # The fork, seen again at the same shape, reuses the larger bound (and its compile) ...
  assert fit.config(fork).max_kv_blocks == 4 and fit.graphdef(fork) is fit.graphdef(chain)
  wide = nnx.merge(fit.graphdef(fork), nnx.state(model))
  # ... whose empty pair slots change no bit.
  for a, b in zip(jax.jit(tree_logprobs)(tight, fork), jax.jit(tree_logprobs)(wide, fork)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert AttentionFitter(model).config(fork).max_kv_blocks == 3  # a new fitter: tight again


def test_a_too_small_bound_raises_with_the_shapes_and_bounds():
  batch = _fork_batch()
  small = _model(bound=2)
  msg = (r"packed batch \[B=1, L=24\] has a row with 15 visible .* pairs with block 4, "
         r"which needs max_kv_blocks >= 3, but the model's bound is 2")
  with pytest.raises(ValueError, match=msg):  # an eager call raises at once
    np.asarray(tree_logprobs(small, batch)[0])
  # Under jit (and grad: the update step's path) the output is NaN, never a partial
  # softmax, and the device-side count the step returns raises on the host.
  graphdef, state = nnx.split(small)
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)

  @jax.jit
  def step(s, b):
    model = nnx.merge(graphdef, s)
    loss, grads = jax.value_and_grad(
        lambda s: tree_logprobs(nnx.merge(graphdef, s), b)[0].sum())(s)
    return loss, grads, attention_overflow(tree, model.attention_config)

  loss, grads, pairs = step(state, batch)
  assert np.isnan(loss) and all(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(grads))
  assert int(pairs) == 15
  with pytest.raises(ValueError, match=msg):
    raise_on_overflow(pairs, batch.tokens.shape, small.attention_config)
  # A direct forward (no log-prob wrapper to raise) is NaN too.
  assert np.isnan(np.asarray(small.hidden(batch.tokens, batch.positions, tree))).all()
  # One rung up is exact, and its count is 0.
  exact = nnx.merge(AttentionFitter(small).graphdef(batch), state)
  assert int(jax.jit(attention_overflow, static_argnums=1)(tree, exact.attention_config)) == 0
  np.testing.assert_allclose(np.asarray(tree_logprobs(exact, batch)[0]),
                             np.asarray(tree_logprobs(_model(0, "dense"), batch)[0]), atol=1e-5)


def test_causal_sequences_are_checked_too():
  tokens = jnp.arange(3, 27, dtype=jnp.int32)[None]  # 24 causal tokens: 21 pairs, bound 4
  valid = jnp.ones_like(tokens, bool)
  with pytest.raises(ValueError, match=r"needs max_kv_blocks >= 4, but the model's bound is 3"):
    np.asarray(sequence_logprobs(_model(bound=3), tokens, valid)[0])
  np.testing.assert_allclose(np.asarray(sequence_logprobs(_model(bound=4), tokens, valid)[0]),
                             np.asarray(sequence_logprobs(_model(0, "dense"), tokens, valid)[0]),
                             atol=1e-5)


def test_no_host_callback_is_traced():
  """The backstop is a device-side count: nothing in a jitted forward calls the host (a
  host callback cannot be lowered for another platform), and a bound of every block
  (max_kv_blocks >= nb, 6 here) holds every pair, so its count is not even computed."""
  batch = _fork_batch()
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)

  def traced(bound):
    model = _model(bound)
    graphdef, state = nnx.split(model)
    fwd = jax.make_jaxpr(lambda s, b: tree_logprobs(nnx.merge(graphdef, s), b)[0])(state, batch)
    count = jax.make_jaxpr(lambda t: attention_overflow(t, model.attention_config))(tree)
    return str(fwd), str(count)

  for bound in (5, 6):
    fwd, count = traced(bound)
    assert "callback" not in fwd and "callback" not in count
  assert "reduce_sum" not in traced(6)[1] and "reduce_sum" in traced(5)[1]


def test_the_bound_from_subtree_ranges_equals_the_bound_from_parents():
  """`pack`'s subtree ranges give every row's ancestors at once; the bound equals the one
  found by walking each row's parents, on random trees with padding trees and tokens."""
  rng = np.random.default_rng(3)
  trees = []
  for _ in range(6):
    tree = RolloutTree.new(rng.integers(3, 60, int(rng.integers(2, 12))).tolist())
    for _ in range(int(rng.integers(1, 9))):
      at = int(rng.integers(0, len(tree.nodes)))
      n = int(rng.integers(1, 10))
      tree.add_node(at, NodeKind.POLICY, rng.integers(3, 60, n).tolist(), logprobs=[-1.0] * n)
    kids = tree.children()
    for i in range(len(tree.nodes)):
      if not kids[i]:
        tree.add_leaf(i, {"outcome": 1.0})
    trees.append(tree)
  batch = pack(trees, Buckets(tokens=(96,), trees=(8,)))
  for block in (4, 8, 16):
    walked = max_visible_blocks(*_host(batch), block)
    assert max_visible_blocks(*_host(batch), block, np.asarray(batch.subtree_end)) == walked
