"""On a GPU: the Pallas kernels compiled by Triton equal dense attention, and a decoder
with them equals the blockwise decoder, values and gradients (skipped without a GPU).

`benchmarks/gpu_suite.py` runs these first (`pytest -m gpu tests/models`). Sizes are a
GPU's: packed rows of 2048 tokens in blocks of 64, SmolLM2's head geometry (9 query
heads over 3 kv heads of 64 dims).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.pallas_attention_test import _chain_tree
from tree_rl.models import Decoder, ModelConfig
from tree_rl.models.attention import AttentionConfig, TreeMask, dense_attention, fit_attention
from tree_rl.models.logprobs import tree_logprobs
from tree_rl.models.pallas_attention import pallas_tree_attention
from tree_rl.tree import Buckets, derived, pack

pytestmark = pytest.mark.gpu
TOL = {jnp.float32: dict(atol=2e-4, rtol=2e-4), jnp.bfloat16: dict(atol=8e-2, rtol=8e-2)}


def _batch(tokens: int = 2048):
  trees = [_chain_tree([300, 200, 150, 40], [500, 120, 64]),
           _chain_tree([64, 900], [1, 1, 700])]
  return pack(trees, Buckets(tokens=(tokens,), nodes=(64,), leaves=(16,),
                             path_tokens=(tokens,), trees=None))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_kernels_equal_dense(dtype):
  batch = _batch()
  tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)
  b, l = batch.tokens.shape
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, l, 9, 64)).astype(dtype)
  k, v = (jax.random.normal(x, (b, l, 3, 64)).astype(dtype) for x in ks[1:3])
  w = jax.random.normal(ks[3], q.shape)

  def run(fn):
    loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()
    return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)

  with jax.default_matmul_precision("highest"):  # an f32 reference without TF32
    out_d, g_d = run(lambda q, k, v: dense_attention(q, k, v, tree))
  out_p, g_p = run(lambda q, k, v: pallas_tree_attention(q, k, v, batch.node_of_token,
                                                         batch.subtree_end, 64))
  f32 = lambda x: np.asarray(x, np.float32)
  np.testing.assert_allclose(f32(out_p), f32(out_d), **TOL[dtype])
  for name, a, c in zip(("dq", "dk", "dv"), g_p, g_d):
    scale = max(1.0, float(np.abs(f32(c)).max()))
    np.testing.assert_allclose(f32(a) / scale, f32(c) / scale, **TOL[dtype], err_msg=name)


def test_a_pallas_decoder_equals_the_blockwise_decoder():
  batch = _batch()
  config = ModelConfig.tiny("qwen2", vocab_size=256, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, hidden_size=256)
  host = (np.asarray(batch.node_of_token), np.asarray(batch.parent),
          np.asarray(batch.subtree_end))
  models = {impl: Decoder(config, rngs=nnx.Rngs(0), attention_config=fit_attention(
      AttentionConfig(impl, 64, 1 if impl == "blockwise" else 0), *host))
      for impl in ("blockwise", "pallas")}

  out = {}
  with jax.default_matmul_precision("highest"):
    for impl, model in models.items():
      graphdef, state = nnx.split(model)
      fn = jax.jit(jax.value_and_grad(
          lambda s, b, g=graphdef: tree_logprobs(nnx.merge(g, s), b)[0].sum()))
      out[impl] = fn(state, batch)
  (v_b, g_b), (v_p, g_p) = out["blockwise"], out["pallas"]
  np.testing.assert_allclose(float(v_p), float(v_b), rtol=1e-4)
  jax.tree.map(lambda a, c: np.testing.assert_allclose(np.asarray(a), np.asarray(c),
                                                       atol=1e-4, rtol=1e-3), g_p, g_b)
