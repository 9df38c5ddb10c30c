"""Shared helpers for estimator tests: pack with fixed buckets, run the
jitted estimator, and compare with a pure-Python reference per tree."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np

from tests.strategies import TEST_BUCKETS, random_token_array
from tree_rl.algos import registry
from tree_rl.tree import RolloutTree, pack


def default_inputs(name, batch, seed: int = 0) -> dict:
  """Extra per-token inputs an estimator needs (APPO: current logp, entropy)."""
  entry = registry.get(name)
  shape = batch.tokens.shape
  out = {}
  for i, key in enumerate(entry.inputs):
    if key == "logp":
      # Current log-probs near the behaviour ones, so log-ratios are small.
      out[key] = np.asarray(batch.behavior_logp) + random_token_array(seed + i, shape, -0.1, 0.1)
    elif key == "entropy":
      out[key] = random_token_array(seed + i, shape, 0.0, 3.0)
    else:
      raise KeyError(f"no default test input for {key!r}")
  return {k: jnp.asarray(v) for k, v in out.items()}


def run(name, trees: Sequence[RolloutTree], config=None, inputs=None, buckets=TEST_BUCKETS):
  """Packs `trees` and runs estimator `name`; returns (batch, Advantages)."""
  batch = pack(list(trees), buckets)
  if inputs is None:
    inputs = default_inputs(name, batch)
  adv = registry.compute_advantages(name, batch, config, **inputs)
  return batch, adv


def node_leaf_per_tree(batch, adv, trees: Sequence[RolloutTree]) -> list[np.ndarray]:
  """adv.dense(batch) trimmed to each tree's [num_nodes, num_leaves] (canonical order)."""
  nl = np.asarray(adv.dense(batch))
  return [nl[b, : len(t.nodes), : len(t.leaves)] for b, t in enumerate(trees)]


def assert_matches_reference(
    name: str,
    trees: Sequence[RolloutTree],
    reference: Callable[[RolloutTree, Any], np.ndarray],
    config=None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
):
  """Kernel node_leaf equals reference(canonical tree, config) for every tree."""
  canon = [t.canonical() for t in trees]
  batch, adv = run(name, canon, config)
  cfg = config if config is not None else registry.get(name).config_cls()
  got = node_leaf_per_tree(batch, adv, canon)
  for b, t in enumerate(canon):
    want = np.asarray(reference(t, cfg), np.float64)
    np.testing.assert_allclose(got[b], want, atol=atol, rtol=rtol,
                               err_msg=f"{name}: tree {b} differs from the reference")
  assert np.isfinite(np.asarray(adv.dense(batch))).all()
  return batch, adv
