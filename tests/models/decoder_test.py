"""The decoder on packed trees equals the decoder on the flattened leaves."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tree_rl.models import Decoder, LoRAConfig, LoRAParam, ModelConfig
from tree_rl.models.attention import AttentionConfig, TreeMask, max_visible_blocks
from tree_rl.models.hf_io import load_hf, save_hf
from tree_rl.models.logprobs import sequence_logprobs, tree_logprobs
from tree_rl.tree import derived, pack

# Every batch is padded to 3 trees so each model compiles once per test.
BUCKETS = dataclasses.replace(S.TEST_BUCKETS, trees=(3,))
SETTINGS = settings(max_examples=S.examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODELS = {f: Decoder(ModelConfig.tiny(f), rngs=nnx.Rngs(i)) for i, f in enumerate(
    ("llama", "qwen2", "qwen3"))}


def split_jit(fn):
  """jax.jit over (graphdef static, state): nnx.jit would rebuild TreeBatch
  through its graph machinery with placeholder leaves, which the test suite's
  runtime shape checks reject."""
  jitted = jax.jit(lambda graphdefs, states, *args: fn(
      *[nnx.merge(g, s) for g, s in zip(graphdefs, states)], *args), static_argnums=0)

  def call(models, *args):
    pairs = [nnx.split(m) for m in models]
    return jitted(tuple(g for g, _ in pairs), [s for _, s in pairs], *args)

  return call


@split_jit
def _tree_and_flat(model, batch):
  st_ = derived.structure(batch)
  tree_logits = model(batch.tokens, batch.positions, TreeMask(batch.node_of_token, st_.ancestor))
  flat = derived.flatten_leaves(batch)
  b, k, p = flat.tokens.shape
  valid = flat.token_index >= 0
  flat_logits = model(flat.tokens.reshape(b * k, p), flat.positions.reshape(b * k, p),
                      TreeMask.causal(valid.reshape(b * k, p)))
  lp_tree, ent_tree = tree_logprobs(model, batch, st_, chunk=64)
  lp_flat, ent_flat = sequence_logprobs(model, flat.tokens.reshape(b * k, p),
                                        valid.reshape(b * k, p), chunk=64)
  return (tree_logits, flat_logits.reshape(b, k, p, -1), lp_tree, ent_tree,
          lp_flat.reshape(b, k, p), ent_flat.reshape(b, k, p), flat.token_index)


@pytest.mark.parametrize("family", sorted(MODELS))
@SETTINGS
@given(trees=st.lists(S.general_tree(max_nodes=24, max_leaves=8), min_size=1, max_size=3))
def test_tree_logits_and_logprobs_equal_flattened(family, trees):
  batch = pack(trees, BUCKETS)
  tl, fl, lpt, entt, lpf, entf, idx = map(np.asarray, _tree_and_flat([MODELS[family]], batch))
  valid = idx >= 0
  safe = np.maximum(idx, 0)
  gather = lambda x: np.take_along_axis(x, safe.reshape(x.shape[0], -1), axis=1).reshape(idx.shape)
  for b in range(len(trees)):
    np.testing.assert_allclose(tl[b][safe[b]][valid[b]], fl[b][valid[b]], atol=1e-5, rtol=1e-5)
  # Log-probs: the first token of each sequence has no context (0 on both sides).
  np.testing.assert_allclose(np.where(valid, gather(lpt), 0), np.where(valid, lpf, 0), atol=1e-5)
  np.testing.assert_allclose(np.where(valid, gather(entt), 0), np.where(valid, entf, 0), atol=1e-4)


@split_jit
def both(d, bw, batch):
  st_ = derived.structure(batch)
  tree = TreeMask(batch.node_of_token, st_.ancestor)
  loss = lambda model: (model(batch.tokens, batch.positions, tree) ** 2).mean()
  return d(batch.tokens, batch.positions, tree), bw(batch.tokens, batch.positions, tree), \
      nnx.grad(loss)(d), nnx.grad(loss)(bw)


_BLOCKWISE = {}


@settings(SETTINGS, max_examples=S.examples(8))
@given(trees=st.lists(S.general_tree(max_nodes=30), min_size=1, max_size=3))
def test_blockwise_equals_dense(trees):
  batch = pack(trees, BUCKETS)
  # 8 key blocks of 32 tokens, 4 pair slots per query block on average (a static
  # bound kept fixed so the test compiles once; raised only when a tree needs more).
  block = 32
  m = max(4, max_visible_blocks(np.asarray(batch.node_of_token), np.asarray(batch.parent), block))
  dense = MODELS["qwen3"]
  if m not in _BLOCKWISE:
    _BLOCKWISE[m] = Decoder(dense.config, rngs=nnx.Rngs(0),
                            attention_config=AttentionConfig("blockwise", block, m))
    nnx.update(_BLOCKWISE[m], nnx.state(dense))
  blockwise = _BLOCKWISE[m]

  ld, lb, gd, gb = both([dense, blockwise], batch)
  valid = np.asarray(batch.node_of_token) >= 0
  np.testing.assert_allclose(np.asarray(lb)[valid], np.asarray(ld)[valid], atol=1e-5, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), gd, gb)


@settings(SETTINGS, max_examples=S.examples(20))
@given(trees=st.lists(S.general_tree(max_nodes=40), min_size=1, max_size=3))
def test_max_visible_blocks_is_exact_bound(trees):
  batch = pack(trees, BUCKETS)
  from tree_rl.models.attention import _visible_blocks, kv_block_pairs
  st_ = derived.structure(batch)
  tree = TreeMask(batch.node_of_token, st_.ancestor)
  m = max_visible_blocks(np.asarray(batch.node_of_token), np.asarray(batch.parent), 32)
  q_blk, k_blk, overflow = kv_block_pairs(tree, 32, m)
  assert not overflow
  if m > 1:
    assert kv_block_pairs(tree, 32, m - 1)[2]  # one fewer overflows
  # The slots list exactly the visible block pairs, in row-major order.
  vis = np.asarray(_visible_blocks(tree, 32))
  for row in range(vis.shape[0]):
    used = np.asarray(q_blk[row]) >= 0
    want = np.argwhere(vis[row])
    np.testing.assert_array_equal(np.stack([q_blk[row][used], k_blk[row][used]], -1), want)


def test_fresh_lora_equals_base_and_only_adapters_are_lora_params():
  base = MODELS["llama"]
  lora = Decoder(base.config, rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4, target_modules=(
      "q_proj", "v_proj", "down_proj")))
  nnx.update(lora, nnx.state(base, nnx.Param))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  tree = TreeMask.causal(jnp.ones((2, 16), bool))
  np.testing.assert_allclose(lora(toks, pos, tree), base(toks, pos, tree), atol=1e-6)
  names = {"/".join(map(str, p)) for p, _ in nnx.state(lora, LoRAParam).flat_state()}
  assert names == {f"{n}_lora_{ab}" for n in ("q_proj", "v_proj", "down_proj") for ab in "ab"}


def test_bad_configs_and_checkpoints_fail_clearly(tmp_path):
  with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
    ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"]})
  with pytest.raises(ValueError, match="unknown LoRA target"):
    LoRAConfig(target_modules=("qkv",))
  save_hf(MODELS["qwen2"], str(tmp_path / "m"))
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
  bad = dict(tensors)
  del bad["model.layers.1.mlp.up_proj.weight"]
  save_file(bad, str(tmp_path / "m" / "model.safetensors"))
  with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
    load_hf(str(tmp_path / "m"))
  bad = dict(tensors)
  bad["model.norm.weight"] = np.ones(3, np.float32)
  save_file(bad, str(tmp_path / "m" / "model.safetensors"))
  with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\).*\(64,\)"):
    load_hf(str(tmp_path / "m"))
  with open(tmp_path / "m" / "config.json") as f:
    assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]


@split_jit
def _full_and_policy_only(model, batch, narrow):
  mask = batch.loss_mask.astype(jnp.float32)

  graphdef, params = nnx.split(model)

  def loss(p, b):
    lp, ent = tree_logprobs(nnx.merge(graphdef, p), b, chunk=8, policy_only=True)
    return ((lp + 0.1 * ent) * mask).sum(), (lp, ent)

  (_, full), g_full = jax.value_and_grad(loss, has_aux=True)(params, batch)
  (_, part), g_part = jax.value_and_grad(loss, has_aux=True)(params, narrow)
  lp, _ = tree_logprobs(model, batch, chunk=8)
  return full, part, g_full, g_part, lp


@settings(SETTINGS, max_examples=S.examples(8))
@given(trees=st.lists(S.general_tree(max_nodes=30), min_size=1, max_size=3))
def test_policy_only_logprobs_gather_the_policy_tokens(trees):
  batch = pack(trees, BUCKETS)
  need = int(np.asarray(batch.loss_mask).sum(1).max())
  # A width below the token axis that holds every row's policy tokens (pack buckets it to
  # 256+), in steps of 32: a few shapes, so a few compiles.
  narrow = dataclasses.replace(batch, max_loss_tokens=-(-need // 32) * 32)
  assume_narrower = narrow.max_loss_tokens < batch.tokens.shape[1]
  full, part, g_full, g_part, lp = _full_and_policy_only([MODELS["llama"]], batch, narrow)
  mask = np.asarray(batch.loss_mask)
  for a, b in zip(full, part):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    assert not np.asarray(b)[~mask].any()  # 0 off the policy tokens
  np.testing.assert_allclose(np.asarray(full[0])[mask], np.asarray(lp)[mask], atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g_full, g_part)
  assert assume_narrower or need > batch.tokens.shape[1] - 32
