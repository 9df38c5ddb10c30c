"""Policy losses: the tree form against a per-sequence reference over the K flattened
root-to-leaf sequences (loss, gradient, metrics), hand fixtures, config validation.

The reference below reads only `derived.flatten_leaves` outputs (token_index, loss_mask,
behavior_logp) and writes the textbook per-token PPO / GSPO formulas over [B, K, P]; its
sequence weights are recomputed here from the flattened masks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from tests.strategies import TEST_BUCKETS, appo_tree, examples, general_tree
from tree_rl.algos import registry
from tree_rl.algos.losses import LossConfig, policy_loss
from tree_rl.algos.registry import Advantages
from tree_rl.tree import (
    Buckets, LossAggregation, NodeKind, RolloutTree, flatten_leaves, pack,
    structure,
)

BUCKETS = dataclasses.replace(TEST_BUCKETS, trees=(3,))  # fixed shapes: one compile per module
SETTINGS = settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = dict(rtol=1e-5, atol=1e-5)
# Compiles dominate this module's runtime (a run takes ~1 ms, a CPU compile seconds);
# skipping LLVM's optimisation passes cuts them by more than half.
FAST = dict(compiler_options={"xla_backend_optimization_level": 0,
                              "xla_llvm_disable_expensive_passes": True})

# Every aggregation x ratio_level x dual clip x KL (k1 or k3, with an entropy bonus), with an
# asymmetric (clip-higher) range. All 24 are checked on every example: one compile, ~1 ms a run.
CONFIGS = tuple(
    LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=1.5 if dual else None,
               ratio_level=level, aggregation=agg, kl_coef=0.1 if kl else 0.0,
               kl_estimator="k3" if dual else "k1", entropy_coef=0.01 if kl else 0.0)
    for agg, level, dual, kl in itertools.product(
        LossAggregation, ("token", "sequence"), (False, True), (False, True)))


# --- the flattened reference ---------------------------------------------------------------


def flat_policy_loss(logp, blogp, mask, adv, trained, ref, ent, eps_low, eps_high, cfg):
  """Loss of [B, K, P] flattened sequences, one row per sequence, and its metrics."""
  m = mask.astype(jnp.float32)
  lens = m.sum(-1)  # [B, K] policy tokens of each sequence
  n_seq = jnp.maximum(trained.sum(), 1)
  agg = cfg.aggregation
  if agg == LossAggregation.TOKEN_MEAN:
    w = jnp.ones_like(lens) / jnp.maximum((lens * trained).sum(), 1)
  elif agg == LossAggregation.SEQ_MEAN_TOKEN_MEAN:
    w = 1.0 / (n_seq * jnp.maximum(lens, 1))
  else:
    w = jnp.ones_like(lens) / n_seq
  wt = jnp.where(trained, w, 0.0)[..., None] * m  # [B, K, P]
  lr = jnp.where(mask, logp - blogp, 0.0)
  if cfg.ratio_level == "token":
    r = jnp.exp(lr)
  else:
    r = jnp.broadcast_to(jnp.exp(lr.sum(-1) / jnp.maximum(lens, 1))[..., None], lr.shape)
  term = -jnp.minimum(r * adv, jnp.clip(r, 1 - eps_low, 1 + eps_high) * adv)
  if cfg.dual_clip_c is not None:
    term = jnp.where(adv < 0, jnp.minimum(term, -cfg.dual_clip_c * adv), term)
  d = jnp.where(mask, ref - logp, 0.0)
  kl = -d if cfg.kl_estimator == "k1" else jnp.exp(d) - d - 1
  pg = jnp.sum(wt * term)
  loss = pg + cfg.kl_coef * jnp.sum(wt * kl) - cfg.entropy_coef * jnp.sum(wt * ent)
  total = jnp.sum(wt)
  mean = lambda x: jnp.where(total > 0, jnp.sum(wt * x) / jnp.maximum(total, 1e-30), 0.0)
  clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
  metrics = dict(pg_loss=pg, clip_frac=mean(clipped), approx_kl=mean(jnp.exp(lr) - 1 - lr),
                 ratio_mean=mean(r), ratio_max=jnp.max(jnp.where(wt > 0, r, 0.0)),
                 kl_ref=mean(kl), entropy=mean(ent))
  if cfg.dual_clip_c is not None:
    metrics["dual_clip_frac"] = mean((adv < 0) & (r > cfg.dual_clip_c))
  return loss, metrics


@functools.partial(jax.jit, static_argnames="cfgs", **FAST)
def _tree_all(logp, batch, adv, ref, ent, st, cfgs):
  # Every config of a test in one jit: a compile costs about a second here, a run a ms.
  f = jax.value_and_grad(policy_loss, has_aux=True)
  return [f(logp, batch, adv, c, ref, ent, st) for c in cfgs]


@functools.partial(jax.jit, static_argnames="cfgs", **FAST)
def _flat_all(logp, data, eps, cfgs):
  f = jax.value_and_grad(flat_policy_loss, has_aux=True)
  return [f(logp, **data, cfg=c, eps_low=c.clip_eps_low if eps is None else eps,
            eps_high=c.clip_eps_high if eps is None else eps) for c in cfgs]


_flatten = jax.jit(flatten_leaves, **FAST)
_structure = jax.jit(structure, **FAST)


@functools.cache
def _estimator_fn(name):
  return jax.jit(registry.get(name).fn, static_argnames="config", **FAST)


def estimator(name, batch, **inputs):
  """A registered estimator's output (default config), compiled like the rest of this module."""
  return _estimator_fn(name)(batch, registry.get(name).config_cls(), **inputs)


def flat_inputs(batch, adv, logp, ref, ent):
  """The flattened sequences' per-token arrays (host), and the packed index of each."""
  flat = _flatten(batch)
  idx = np.asarray(flat.token_index)  # [B, K, P]
  b = np.arange(idx.shape[0])[:, None, None]
  safe = np.maximum(idx, 0)
  take = lambda x: np.where(idx >= 0, np.asarray(x)[b, safe], 0.0).astype(np.float32)
  node = np.maximum(np.asarray(batch.node_of_token)[b, safe], 0)
  k = np.arange(idx.shape[1])[None, :, None]
  scale = np.asarray(adv.token_scale_or_ones(logp.shape))
  a = np.where(idx >= 0, np.asarray(adv.dense(batch))[b, node, k] * take(scale), 0.0)
  trained = (idx >= 0).any(-1) & np.asarray(adv.leaf_mask)
  return idx, dict(logp=take(logp), blogp=np.asarray(flat.behavior_logp),
                   mask=np.asarray(flat.loss_mask), adv=a.astype(np.float32),
                   trained=trained, ref=take(ref), ent=take(ent))


def packed_grad(idx, g_flat, shape):
  """d loss / d packed logp from the flattened gradient: the sum over each token's copies."""
  ok = idx >= 0
  bb = np.broadcast_to(np.arange(idx.shape[0])[:, None, None], idx.shape)
  out = np.zeros(shape, np.float32)
  np.add.at(out, (bb[ok], idx[ok]), g_flat[ok])
  return out


def check_against_flat(batch, adv, logp, ref, ent, cfgs, eps=None):
  """Tree loss, metrics and d loss / d logp equal the flattened reference's, for each config."""
  idx, fl = flat_inputs(batch, adv, logp, ref, ent)
  cfgs = tuple(cfgs)
  got = _tree_all(logp, batch, adv, ref, ent, _structure(batch), cfgs=cfgs)
  data = {k: jnp.asarray(v) for k, v in fl.items()}
  want = _flat_all(data.pop("logp"), data, eps, cfgs=cfgs)
  got, want = jax.device_get((got, want))
  for cfg, ((loss, met), grad), ((want_loss, want_met), g_flat) in zip(cfgs, got, want):
    assert set(met) == set(want_met)
    names = sorted(want_met)
    np.testing.assert_allclose([loss] + [met[n] for n in names],
                               [want_loss] + [want_met[n] for n in names], **TOL,
                               err_msg=f"[loss, {', '.join(names)}]: {cfg}")
    np.testing.assert_allclose(grad, packed_grad(idx, g_flat, logp.shape), **TOL,
                               err_msg=f"grad: {cfg}")


def random_inputs(batch, rng):
  """Current / reference log-probs and entropies. A per-node offset spreads the
  sequence-level ratios across both clip sides as well as the token-level ones."""
  bsz, n = batch.parent.shape
  node = np.maximum(np.asarray(batch.node_of_token), 0)
  offset = rng.uniform(-0.6, 0.6, (bsz, n))[np.arange(bsz)[:, None], node]
  logp = np.asarray(batch.behavior_logp) + offset + rng.uniform(-0.4, 0.4, node.shape)
  ref = logp + rng.uniform(-0.5, 0.5, node.shape)
  ent = rng.uniform(0.0, 3.0, node.shape)
  return [jnp.asarray(x, jnp.float32) for x in (logp, ref, ent)]


def random_advantages(batch, rng):
  """Per-(node, leaf) advantages (some exactly 0), a random trained subset, and a token
  scale that is all ones, positive, or of either sign."""
  bsz, n = batch.parent.shape
  k, l = batch.leaf_node.shape[1], batch.tokens.shape[1]
  a = rng.uniform(-2.0, 2.0, (bsz, n, k)) * (rng.random((bsz, n, k)) < 0.85)
  scale = [np.ones((bsz, l)), rng.uniform(0.5, 1.5, (bsz, l)),
           rng.uniform(-1.0, 1.5, (bsz, l))][rng.integers(3)]
  return Advantages(node_leaf=jnp.asarray(a, jnp.float32),
                    leaf_mask=jnp.asarray(rng.random((bsz, k)) < 0.8),
                    token_scale=jnp.asarray(scale, jnp.float32))


def core(adv, extras=None):
  """An estimator's output, in its own form (leaf, node or node-leaf values), without its
  metrics and with an explicit token scale."""
  scale = adv.token_scale_or_ones(adv.leaf_mask.shape[:1] + (BUCKETS.tokens[0],))
  return Advantages(node_leaf=adv.node_leaf, leaf_values=adv.leaf_values,
                    node_values=adv.node_values, leaf_mask=adv.leaf_mask, token_scale=scale,
                    extras=extras or {})


@SETTINGS
@given(hst.lists(general_tree(), min_size=1, max_size=3), hst.integers(0, 2**31 - 1),
       hst.booleans())
def test_general_tree_matches_flat(trees, seed, use_grpo):
  batch = pack(trees, BUCKETS)
  rng = np.random.default_rng(seed)
  logp, ref, ent = random_inputs(batch, rng)
  adv = core(estimator("grpo", batch)) if use_grpo else random_advantages(batch, rng)
  check_against_flat(batch, adv, logp, ref, ent, CONFIGS)


@SETTINGS
@given(hst.lists(appo_tree(), min_size=1, max_size=3), hst.integers(0, 2**31 - 1),
       hst.booleans())
def test_appo_tree_matches_flat(trees, seed, use_appo):
  batch = pack(trees, BUCKETS)
  rng = np.random.default_rng(seed)
  logp, ref, ent = random_inputs(batch, rng)
  if use_appo:  # APPO's leaf_mask (INIT leaves) and its future-aware token_scale
    adv = core(estimator("appo", batch, logp=logp, entropy=ent))
    assert adv.token_scale.min() >= 1.0
  else:
    adv = random_advantages(batch, rng)
  check_against_flat(batch, adv, logp, ref, ent, CONFIGS)


@settings(SETTINGS, max_examples=examples(25))
@given(hst.lists(general_tree(), min_size=1, max_size=3), hst.integers(0, 2**31 - 1))
def test_awpo_clip_radius_replaces_eps(trees, seed):
  batch = pack(trees, BUCKETS)
  logp, ref, ent = random_inputs(batch, np.random.default_rng(seed))
  out = estimator("awpo", batch)
  eps = out.extras["clip_eps"]
  adv = core(out, {"clip_eps": eps})
  cfgs = [LossConfig(), LossConfig(ratio_level="sequence", dual_clip_c=1.5)]
  check_against_flat(batch, adv, logp, ref, ent, cfgs, eps=eps)


# PORTool's App. B form: the two parts clipped separately equal the sum of two flattened
# losses, one per part (no KL or entropy: those do not depend on the advantage).
TWO_TERM = tuple(dataclasses.replace(c, surrogate="two_term") for c in CONFIGS
                 if c.kl_coef == 0)


@settings(SETTINGS, max_examples=examples(25))
@given(hst.lists(general_tree(), min_size=1, max_size=3), hst.integers(0, 2**31 - 1))
def test_two_term_is_the_sum_of_separately_clipped_parts(trees, seed):
  batch = pack(trees, BUCKETS)
  rng = np.random.default_rng(seed)
  logp, ref, ent = random_inputs(batch, rng)
  a1 = random_advantages(batch, rng)
  a2 = a1.replace(node_leaf=jnp.asarray(
      rng.uniform(-2.0, 2.0, a1.node_leaf.shape) * (rng.random(a1.node_leaf.shape) < 0.7),
      jnp.float32))
  extras = {"trajectory_term": a1.node_leaf, "fork_term": a2.node_leaf}
  adv = a1.replace(node_leaf=a1.node_leaf + a2.node_leaf, extras=extras)
  got = _tree_all(logp, batch, adv, ref, ent, _structure(batch), cfgs=TWO_TERM)
  want = []
  for part in (a1, a2):
    idx, fl = flat_inputs(batch, part, logp, ref, ent)
    data = {k: jnp.asarray(v) for k, v in fl.items()}
    want.append(_flat_all(data.pop("logp"), data, None, cfgs=TWO_TERM))
  got, want = jax.device_get((got, want))
  for i, cfg in enumerate(TWO_TERM):
    (loss, met), grad = got[i]
    np.testing.assert_allclose([loss, met["pg_loss"]], [want[0][i][0][0] + want[1][i][0][0]] * 2,
                               **TOL, err_msg=str(cfg))
    g_want = packed_grad(idx, want[0][i][1] + want[1][i][1], logp.shape)
    np.testing.assert_allclose(grad, g_want, **TOL, err_msg=f"grad: {cfg}")


# --- hand fixtures -------------------------------------------------------------------------

BLOGP = (-1.0, -0.5, -2.0)


def chain(adv, ratios, extras=None):
  """Prompt -> three one-token policy nodes -> one leaf: packed token t+1 is node t+1, whose
  advantage is adv[t] and current log-prob BLOGP[t] + log(ratios[t])."""
  tree = RolloutTree.new([1])
  n = 0
  for i, lp in enumerate(BLOGP):
    n = tree.add_node(n, NodeKind.POLICY, [5 + i], logprobs=[lp])
  tree.add_leaf(n, {"outcome": 1.0})
  batch = pack([tree], Buckets.exact())
  nl = jnp.asarray([0.0, *adv], jnp.float32)[None, :, None]
  a = Advantages(node_leaf=nl, leaf_mask=jnp.ones((1, 1), bool), extras=extras or {})
  logp = jnp.asarray([[0.0] + [b + math.log(r) for b, r in zip(BLOGP, ratios)]], jnp.float32)
  return batch, a, logp


SUM = LossConfig(aggregation="seq_mean_token_sum")  # one sequence: w = 1


@functools.partial(jax.jit, static_argnames="cfg", **FAST)
def _loss_grad(logp, batch, adv, cfg, ref_logp=None, entropy=None):
  return jax.value_and_grad(policy_loss, has_aux=True)(logp, batch, adv, cfg, ref_logp, entropy)


def loss_and_grad(batch, adv, logp, cfg, **kw):
  (loss, met), g = _loss_grad(logp, batch, adv, cfg, **kw)
  return float(loss), met, np.asarray(g)[0]


@pytest.mark.parametrize("sign, want, want_grad", [
    # eps = 0.2, r = (1.5, 0.9, 0.5); term = -min(r A, clip(r, 0.8, 1.2) A).
    # A = +1: -min(1.5, 1.2) = -1.2 (clipped high, no grad); -0.9 (inside, grad -r = -0.9);
    #   -min(0.5, 0.8) = -0.5 (below the range but A > 0: not clipped, grad -0.5). Sum -2.6.
    (1.0, -2.6, [0.0, -0.9, -0.5]),
    # A = -1: -min(-1.5, -1.2) = 1.5 (above the range but A < 0: not clipped, grad 1.5);
    #   0.9 (inside); -min(-0.5, -0.8) = 0.8 (clipped low, no grad). Sum 3.2.
    (-1.0, 3.2, [1.5, 0.9, 0.0]),
])
def test_three_token_clip(sign, want, want_grad):
  batch, adv, logp = chain([sign] * 3, (1.5, 0.9, 0.5))
  loss, met, g = loss_and_grad(batch, adv, logp, SUM)  # d/dlogp = r d/dr
  assert loss == pytest.approx(want, abs=1e-5)
  np.testing.assert_allclose(g, [0.0, *want_grad], atol=1e-5)
  assert float(met["clip_frac"]) == pytest.approx(1 / 3, abs=1e-6)
  assert float(met["ratio_max"]) == pytest.approx(1.5, abs=1e-5)
  for agg in ("token_mean", "seq_mean_token_mean"):  # 3 tokens, one sequence: divide by 3
    cfg = LossConfig(aggregation=agg)
    assert loss_and_grad(batch, adv, logp, cfg)[0] == pytest.approx(want / 3, abs=1e-5)


def test_dual_clip_bounds_negative_advantages():
  # A = -1, r = (4, 2, 0.5), c = 3: min(4, 3) = 3 (bounded, no grad); 2 (grad 2);
  # 0.8 (clipped low). Without the dual clip the first term would be 4.
  batch, adv, logp = chain([-1.0] * 3, (4.0, 2.0, 0.5))
  cfg = dataclasses.replace(SUM, dual_clip_c=3.0)
  loss, met, g = loss_and_grad(batch, adv, logp, cfg)
  assert loss == pytest.approx(5.8, abs=1e-5)
  np.testing.assert_allclose(g, [0.0, 0.0, 2.0, 0.0], atol=1e-5)
  assert float(met["dual_clip_frac"]) == pytest.approx(1 / 3, abs=1e-6)
  assert loss_and_grad(batch, adv, logp, SUM)[0] == pytest.approx(6.8, abs=1e-5)
  # A > 0 is untouched: -min(4, 1.2) - min(2, 1.2) - min(0.5, 0.8) = -2.9.
  batch, adv, logp = chain([1.0] * 3, (4.0, 2.0, 0.5))
  assert loss_and_grad(batch, adv, logp, cfg)[0] == pytest.approx(-2.9, abs=1e-5)


def test_awpo_clip_eps_from_extras():
  # r = (1.15, 0.95, 0.5), A = +1. eps = 0.2: nothing clipped, -(1.15 + 0.95 + 0.5) = -2.6.
  # AWPO radius 0.1: 1.15 -> 1.1, so -(1.1 + 0.95 + 0.5) = -2.55, one pair in three clipped.
  batch, adv, logp = chain([1.0] * 3, (1.15, 0.95, 0.5))
  assert loss_and_grad(batch, adv, logp, SUM)[0] == pytest.approx(-2.6, abs=1e-5)
  batch, adv, logp = chain([1.0] * 3, (1.15, 0.95, 0.5), {"clip_eps": jnp.float32(0.1)})
  loss, met, _ = loss_and_grad(batch, adv, logp, SUM)
  assert loss == pytest.approx(-2.55, abs=1e-5)
  assert float(met["clip_frac"]) == pytest.approx(1 / 3, abs=1e-6)


def test_two_term_differs_only_on_opposite_signs_outside_the_clip():
  # r = (1.5, 0.9, 0.5); parts (trajectory, fork) = (1, -0.5), (1, 0.5), (-1, 2).
  # Combined A = (0.5, 1.5, 1): -min(0.75, 0.6) - 1.35 - min(0.5, 0.8) = -2.45; grads
  #   (0 clipped, -1.35, -0.5).
  # Two terms: token 1: -min(1.5, 1.2) - min(-0.75, -0.6) = -0.45, grad only from the fork
  #   part, 0.5 * 1.5 = 0.75; token 2: same signs, -1.35 as combined
  #   (docs/methods/portool.md#surrogate-form); token 3:
  #   -min(-0.5, -0.8) - min(1.0, 1.6) = 0.8 - 1.0 = -0.2, grad -1.0. Sum -2.0.
  trj, fork = [1.0, 1.0, -1.0], [-0.5, 0.5, 2.0]
  parts = {k: jnp.asarray([0.0, *v], jnp.float32)[None, :, None]
           for k, v in (("trajectory_term", trj), ("fork_term", fork))}
  batch, adv, logp = chain([a + b for a, b in zip(trj, fork)], (1.5, 0.9, 0.5), parts)
  loss, _, g = loss_and_grad(batch, adv, logp, SUM)
  assert loss == pytest.approx(-2.45, abs=1e-5)
  np.testing.assert_allclose(g, [0.0, 0.0, -1.35, -0.5], atol=1e-5)
  loss, _, g = loss_and_grad(batch, adv, logp, dataclasses.replace(SUM, surrogate="two_term"))
  assert loss == pytest.approx(-2.0, abs=1e-5)
  np.testing.assert_allclose(g, [0.0, 0.75, -1.35, -1.0], atol=1e-5)
  # An estimator without the parts: a clear error naming them.
  batch, adv, logp = chain([1.0] * 3, (1.0, 1.0, 1.0))
  with pytest.raises(ValueError, match="trajectory_term"):
    policy_loss(logp, batch, adv, LossConfig(surrogate="two_term"))


@pytest.mark.parametrize("est, want, want_grad", [
    # d = logp - ref = (0.5, -0.25, 0). k1 = d: sum 0.25, d/dlogp = 1.
    ("k1", 0.25, [1.0, 1.0, 1.0]),
    # k3 = exp(-d) + d - 1: 0.10653066 + 0.03402542 + 0; d/dlogp = 1 - exp(-d).
    ("k3", 0.14055608, [0.39346934, -0.28402542, 0.0]),
])
def test_kl_estimators_and_entropy(est, want, want_grad):
  batch, adv, logp = chain([0.0] * 3, (1.0, 1.0, 1.0))  # A = 0: only KL and entropy
  ref = logp - jnp.asarray([[0.0, 0.5, -0.25, 0.0]])
  ent = jnp.asarray([[9.0, 1.0, 2.0, 3.0]])  # the prompt token's entropy is not trained
  cfg = dataclasses.replace(SUM, kl_coef=1.0, kl_estimator=est, entropy_coef=0.1)
  loss, met, g = loss_and_grad(batch, adv, logp, cfg, ref_logp=ref, entropy=ent)
  assert loss == pytest.approx(want - 0.6, abs=1e-5)
  np.testing.assert_allclose(g, [0.0, *want_grad], atol=1e-5)
  assert float(met["kl_ref"]) == pytest.approx(want / 3, abs=1e-5)
  assert float(met["entropy"]) == pytest.approx(2.0, abs=1e-5)


def test_sequence_ratio_two_leaves():
  # Prompt -> p1 (2 tokens) -> {p2 (1 token, leaf 0, A = +1), p3 (3 tokens, leaf 1, A = -1)}.
  # Log-ratios p1 (0.3, 0.1), p2 (0.2), p3 (-0.6, -0.3, 0.0).
  # s0 = exp(mean(0.3, 0.1, 0.2)) = exp(0.2) = 1.2214 > 1.2: clipped, term -1.2 per token.
  # s1 = exp((0.3 + 0.1 - 0.6 - 0.3 + 0) / 5) = exp(-0.1) = 0.904837: term -min(-s1, -0.8) = s1.
  # seq_mean_token_mean: 1/2 * (-1.2) + 1/2 * s1 = -0.147581; d/dlogp on leaf 1's tokens
  # = 1/2 * s1 / 5 = 0.0904837, 0 on p2 (its sequence is clipped).
  tree = RolloutTree.new([1])
  p1 = tree.add_node(0, NodeKind.POLICY, [5, 6], logprobs=[-1.0, -1.0])
  p2 = tree.add_node(p1, NodeKind.POLICY, [7], logprobs=[-0.5])
  p3 = tree.add_node(p1, NodeKind.POLICY, [8, 9, 10], logprobs=[-2.0, -1.0, -0.1])
  tree.add_leaf(p2, {"outcome": 1.0})
  tree.add_leaf(p3, {"outcome": 0.0})
  batch = pack([tree], Buckets.exact())
  nl = jnp.asarray([[0, 0], [1, -1], [1, 0], [0, -1]], jnp.float32)[None]
  adv = Advantages(node_leaf=nl, leaf_mask=jnp.ones((1, 2), bool))
  delta = jnp.asarray([[0.0, 0.3, 0.1, 0.2, -0.6, -0.3, 0.0]])
  cfg = LossConfig(ratio_level="sequence")
  loss, met, g = loss_and_grad(batch, adv, batch.behavior_logp + delta, cfg)
  s0, s1 = math.exp(0.2), math.exp(-0.1)
  assert loss == pytest.approx(-0.6 + 0.5 * s1, abs=1e-6)
  np.testing.assert_allclose(g, [0, 0.1 * s1, 0.1 * s1, 0, 0.1 * s1, 0.1 * s1, 0.1 * s1],
                             atol=1e-6)
  assert float(met["clip_frac"]) == pytest.approx(0.5, abs=1e-6)
  assert float(met["ratio_mean"]) == pytest.approx(0.5 * (s0 + s1), abs=1e-5)
  assert float(met["ratio_max"]) == pytest.approx(s0, abs=1e-5)


def test_token_scale_none_is_ones():
  batch, adv, logp = chain([1.0, -1.0, 2.0], (1.5, 0.9, 0.5))
  ones = adv.replace(token_scale=jnp.ones(logp.shape))
  assert loss_and_grad(batch, adv, logp, SUM)[0] == loss_and_grad(batch, ones, logp, SUM)[0]


# --- config validation ---------------------------------------------------------------------

# A wrong type (the last two) fails the tests' jaxtyping/beartype hook first (a TypeError naming
# the parameter); without the hook, as in training, __post_init__ raises the ValueError.
@pytest.mark.parametrize("field, value, err", [
    ("clip_eps_low", -0.1, ValueError), ("clip_eps_low", 1.0, ValueError),
    ("clip_eps_high", -0.1, ValueError), ("clip_eps_high", float("nan"), ValueError),
    ("dual_clip_c", 1.0, ValueError), ("dual_clip_c", 0.5, ValueError),
    ("ratio_level", "seq", ValueError), ("aggregation", "mean", ValueError),
    ("kl_coef", -1.0, ValueError), ("kl_estimator", "k2", ValueError),
    ("entropy_coef", -0.1, ValueError), ("surrogate", "split", ValueError),
    ("clip_eps_low", True, (TypeError, ValueError)),
    ("entropy_coef", "0.1", (TypeError, ValueError)),
])
def test_bad_config_names_field(field, value, err):
  with pytest.raises(err, match=field if isinstance(err, tuple) else f"LossConfig.{field}"):
    LossConfig(**{field: value})


def test_config_normalises_and_needs_inputs():
  assert LossConfig(aggregation="token_mean").aggregation is LossAggregation.TOKEN_MEAN
  with pytest.raises(ValueError, match="'token', 'sequence'"):
    LossConfig(ratio_level="seq")
  batch, adv, logp = chain([1.0] * 3, (1.0, 1.0, 1.0))
  with pytest.raises(ValueError, match="kl_coef"):
    policy_loss(logp, batch, adv, LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match="entropy_coef"):
    policy_loss(logp, batch, adv, LossConfig(entropy_coef=0.1))
