"""The fused Pallas tree-attention kernels equal dense attention, values and gradients.

Both kernel sets run in Pallas' interpret mode here (a CPU): the GPU (Triton) kernels
on blocks of 16, the TPU (Mosaic) kernels on their blocks of 128, with trees scaled so
that nodes straddle those blocks; `tests/lowering_test.py` lowers the same kernels for
CUDA and TPU. Every case compares the output and dq, dk, dv of a weighted sum of the
output against `dense_attention` on the same tree, in f32 (tight) and bf16 (inputs and
products in bf16, accumulation in f32: loose).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tree_rl.config_types import ModelSpec
from tree_rl.models.attention import (AttentionConfig, TreeMask, _visible_blocks, attention,
                                      dense_attention, fit_attention, max_visible_blocks)
from tree_rl.models.pallas_attention import block_lists, pallas_tree_attention, token_vectors
from tree_rl.tree import Buckets, NodeKind, RolloutTree, derived, pack

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=6e-2, rtol=6e-2)}
SETTINGS = settings(max_examples=S.examples(100), deadline=None, derandomize=True, database=None)


def _buckets(tokens: int) -> Buckets:
  return Buckets(tokens=(tokens,), nodes=(64 if tokens <= 128 else 256,), leaves=(64,),
                 path_tokens=(tokens,), trees=None)


def _chain_tree(lengths, branches=()):
  """A root of lengths[0] tokens, a chain of nodes of the next lengths, and 1-leaf
  branches of the given lengths forking off the root."""
  tree = RolloutTree.new([3 + i % 40 for i in range(lengths[0])])
  parent = 0
  for n, length in enumerate(lengths[1:]):
    kind = NodeKind.POLICY if n % 2 == 0 else NodeKind.ENV
    lps = [-1.0] * length if kind == NodeKind.POLICY else None
    parent = tree.add_node(parent, kind, [5 + (n + j) % 40 for j in range(length)], logprobs=lps)
  if parent or not branches:  # a leaf ends a trajectory: not on a root with branches
    tree.add_leaf(parent, {"outcome": 1.0})
  for length in branches:
    node = tree.add_node(0, NodeKind.POLICY, [7] * length, logprobs=[-1.0] * length)
    tree.add_leaf(node, {"outcome": 0.0})
  return tree


# backend -> (block, packed tokens per row, scale of the edge cases' node lengths)
BACKENDS = {"gpu": (16, 128, 1), "tpu": (128, 512, 4)}


@functools.partial(jax.jit, static_argnames=("dtype", "backend", "max_kv_blocks"))
def _both(node_of_token, ancestor, subtree_end, key, dtype, backend="gpu", max_kv_blocks=0):
  """Outputs and (dq, dk, dv) of sum(out * w), dense vs the kernel (interpret mode)."""
  b, l = node_of_token.shape
  kq, kk, kv, kw = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, l, HEADS, HEAD_DIM)).astype(dtype)
  k = jax.random.normal(kk, (b, l, KV_HEADS, HEAD_DIM)).astype(dtype)
  v = jax.random.normal(kv, (b, l, KV_HEADS, HEAD_DIM)).astype(dtype)
  w = jax.random.normal(kw, (b, l, HEADS, HEAD_DIM))
  tree = TreeMask(node_of_token, ancestor)

  def dense(q, k, v):
    return dense_attention(q, k, v, tree)

  def fused(q, k, v):
    return pallas_tree_attention(q, k, v, node_of_token, subtree_end, BACKENDS[backend][0],
                                 interpret=True, backend=backend, max_kv_blocks=max_kv_blocks)

  def grads(fn):
    return jax.grad(lambda *a: (fn(*a).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)

  return (dense(q, k, v), grads(dense)), (fused(q, k, v), grads(fused))


def _check(batch, dtype=jnp.float32, seed=0, backend="gpu", max_kv_blocks=0):
  st_ = derived.structure(batch)
  (out_d, g_d), (out_p, g_p) = _both(batch.node_of_token, st_.ancestor, batch.subtree_end,
                                     jax.random.key(seed), dtype, backend, max_kv_blocks)
  tol = TOL[dtype]
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(out_p), f32(out_d), **tol)
  for name, a, b in zip(("dq", "dk", "dv"), g_p, g_d):
    scale = max(1.0, float(np.abs(f32(b)).max()))  # bf16 gradients: relative to their size
    np.testing.assert_allclose(f32(a) / scale, f32(b) / scale, **tol, err_msg=name)
  # Padding queries see nothing: exactly 0, as dense attention gives.
  pad = np.asarray(batch.node_of_token) < 0
  assert not np.any(f32(out_p)[pad])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@SETTINGS
@given(trees=st.lists(S.general_tree(max_nodes=30), min_size=1, max_size=2))
def test_kernel_equals_dense_on_random_trees(trees, dtype):
  """The GPU kernels on random trees (blocks of 16 hold several nodes each), packed into 2
  rows (one compile)."""
  _check(pack(trees, dataclasses.replace(_buckets(128), trees=(2,))), dtype)


def _edge_case(case: str, scale: int):
  """The edge cases' trees, node lengths times `scale` (4 for the TPU's 128-token blocks:
  the trees span 1-3 of a 512-token row's 4 blocks)."""
  x = lambda *lengths: [n * scale for n in lengths]
  return {
      # Every node one token: many nodes per block, the mask does all the work.
      # (190 of them on the TPU's: they fill two of its 128-token blocks.)
      "single_token_nodes": [_chain_tree([1] * (20 if scale == 1 else 140),
                                         branches=[1] * (10 if scale == 1 else 50))],
      # A tree that is just its prompt: plain causal attention over one node.
      "one_node": [_chain_tree(x(37))],
      # A short tree in a long row: most query and key blocks are padding.
      "padding": [_chain_tree(x(3, 2))],
      "several_trees": [_chain_tree(x(5, 9, 4), x(6, 3)), _chain_tree(x(17, 2)),
                        _chain_tree(x(2), x(30, 1, 12))],
      # Nodes that cross block edges (16 x scale): a 23-token root, branches of 19 and 26
      # tokens, so a branch's block also holds its sibling's tokens, which it must not see.
      "straddling": [_chain_tree(x(23, 19, 9), x(26, 13))],
  }[case]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["single_token_nodes", "one_node", "padding", "several_trees",
                                  "straddling"])
def test_kernel_equals_dense_on_edge_cases(case, dtype, backend):
  _, tokens, scale = BACKENDS[backend]
  _check(pack(_edge_case(case, scale), _buckets(tokens)), dtype, seed=len(case),
         backend=backend)


def test_tpu_kernels_with_a_fitted_bound_and_one_too_small():
  """The TPU kernels' static pair slots: a bound fitted to the batch is exact; one too
  small for it poisons the output with NaN, never a partial softmax."""
  batch = pack(_edge_case("straddling", 8), _buckets(1024))
  need = max_visible_blocks(np.asarray(batch.node_of_token), np.asarray(batch.parent), 128)
  assert 1 < need < 8  # the tree skips some of the 8 blocks' causal pairs
  _check(batch, backend="tpu", max_kv_blocks=need)
  st_ = derived.structure(batch)
  _, (out, _) = _both(batch.node_of_token, st_.ancestor, batch.subtree_end,
                      jax.random.key(0), jnp.float32, "tpu", 1)  # 8 + 8 slots < 8 + 9 pairs
  assert np.isnan(np.asarray(out)).all()


def test_block_lists_are_the_visible_block_pairs():
  batch = pack([_chain_tree([23, 19, 9], [26, 13]), _chain_tree([5, 9, 4], [6, 3])],
               _buckets(128))
  st_ = derived.structure(batch)
  node, end = token_vectors(batch.node_of_token, batch.subtree_end)
  kv_list, kv_count, q_list, q_count = map(np.asarray, block_lists(node, end, BLOCK))
  vis = np.asarray(_visible_blocks(TreeMask(batch.node_of_token, st_.ancestor), BLOCK))
  for row in range(vis.shape[0]):
    for blk in range(vis.shape[1]):
      np.testing.assert_array_equal(kv_list[row, blk, :kv_count[row, blk]],
                                    np.flatnonzero(vis[row, blk]))
      np.testing.assert_array_equal(q_list[row, blk, :q_count[row, blk]],
                                    np.flatnonzero(vis[row, :, blk]))
  # The tree is sparse: fewer visible pairs than causal attention's nb (nb + 1) / 2.
  nb = vis.shape[1]
  assert kv_count.sum(1).max() < nb * (nb + 1) // 2


def test_subtree_end_from_the_ancestor_matrix_is_packs():
  batch = pack([_chain_tree([3, 2, 2], [4, 1]), _chain_tree([2])], _buckets(128))
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)
  np.testing.assert_array_equal(np.asarray(tree.subtree_end()), np.asarray(batch.subtree_end))
  causal = TreeMask.causal(jnp.ones((2, 32), bool))
  np.testing.assert_array_equal(np.asarray(causal.subtree_end()), [[1], [1]])


def test_attention_dispatches_to_the_kernel_and_pads_odd_head_dims():
  """`attention(..., AttentionConfig("pallas"))` is the kernel (interpret mode on a CPU);
  a head dim that is not a power of two (24) is padded inside and gives dense's result."""
  batch = pack([_chain_tree([7, 11, 5], [9])], _buckets(64))
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (1, 64, 6, 24))
  k, v = (jax.random.normal(x, (1, 64, 3, 24)) for x in ks[1:])
  out = attention(q, k, v, tree, AttentionConfig("pallas", block=16))
  np.testing.assert_allclose(out, dense_attention(q, k, v, tree), atol=2e-5, rtol=2e-5)


def test_bad_shapes_fail_naming_them():
  q = jnp.zeros((1, 48, 2, 16))
  nodes, ends = jnp.zeros((1, 48), jnp.int32), jnp.ones((1, 1), jnp.int32)
  with pytest.raises(ValueError, match="L=48 must be a multiple of the attention block 32"):
    pallas_tree_attention(q, q, q, nodes, ends, 32, interpret=True)
  with pytest.raises(ValueError, match="block=24 must be a power of two >= 16"):
    pallas_tree_attention(q, q, q, nodes, ends, 24, interpret=True)


def test_pallas_is_refused_where_its_kernels_cannot_run():
  spec = ModelSpec(attention="pallas")
  spec.check_backend("gpu")
  with pytest.raises(ValueError, match=r"attention='pallas' is a GPU and TPU kernel, but "
                     r"JAX's backend is 'cpu': use config.model.attention='blockwise'"):
    spec.check_backend("cpu")
  with pytest.raises(ValueError, match=r"config.model.attention_block=64: the TPU kernels"):
    spec.check_backend("tpu")
  ModelSpec(attention="pallas", attention_block=128).check_backend("tpu")
  ModelSpec(attention="blockwise").check_backend("cpu")


def test_only_a_bounded_pallas_config_is_fitted():
  """GPUs need no bound (nothing to refit, nothing to recompile); the TPU kernels' bound
  (max_kv_blocks > 0) is fitted per batch like blockwise's."""
  batch = pack(_edge_case("straddling", 8), _buckets(1024))
  host = np.asarray(batch.node_of_token), np.asarray(batch.parent)
  gpu = AttentionConfig("pallas", block=128)
  assert not gpu.bounded and fit_attention(gpu, *host) == gpu
  tpu = fit_attention(AttentionConfig("pallas", block=128, max_kv_blocks=8), *host)
  assert tpu.bounded and tpu.max_kv_blocks == max_visible_blocks(*host, 128)
