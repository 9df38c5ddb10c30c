"""TRACE allocators (brute force on small cases, hand examples, invariants, timing) and tree
statistics (eq. 18 targets, eq. 21 effective ratio)."""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import TEST_BUCKETS, examples, general_tree
from tree_rl.algos import trace
from tree_rl.tree import NodeKind, RolloutTree, pack

PROBS = st.one_of(st.sampled_from([0.0, 1e-4, 0.1, 0.3, 0.5, 0.7, 0.95, 1.0]),
                  st.floats(0.0, 1.0))


# ---------------------------------------------------------------------------
# Stage 1: roots
# ---------------------------------------------------------------------------


def test_root_value():
  # 1 - v^m - (1 - v)^m: v = 0.5 -> m = 2: 0.5, m = 3: 0.75, m = 4: 0.875; 0 for m < 2.
  np.testing.assert_allclose(trace.root_value(0.5, [0, 1, 2, 3, 4]),
                             [0, 0, 0.5, 0.75, 0.875])
  np.testing.assert_allclose(trace.root_value([0.0, 1.0, 0.2], 2), [0, 0, 0.32])


def test_allocate_roots_hand_examples():
  # v = [0.5, 0.5], M = 4: [2, 2] is worth 0.5 + 0.5 = 1.0, [4, 0] only 0.875, and [3, 1] is
  # not allowed (m = 1).
  np.testing.assert_array_equal(trace.allocate_roots([0.5, 0.5], 4), [2, 2])
  # Saturated prompts get nothing: v = 0.02 or 0.98 is worth 1 - 0.98^2 - 0.02^2 = 0.0392 at
  # m = 2, while the m = 4 rollouts of the v = 0.5 prompt are worth 0.875 > 0.5 + 0.0392.
  np.testing.assert_array_equal(trace.allocate_roots([0.02, 0.5, 0.98], 4), [0, 4, 0])
  # v = 0 and v = 1 are clipped to 1e-3 (worth ~0.002 at m = 2) and lose to v = 0.5 prompts.
  np.testing.assert_array_equal(trace.allocate_roots([0.0, 0.5, 1.0, 0.5], 4), [0, 2, 0, 2])
  # Constant predictor (cold start), M = 2B: 2s and 3s tie (V(3)/3 = V(2)/2 = v(1 - v)), and
  # the tie goes to coverage: m = 2 for every prompt rather than [3, 3, 0].
  np.testing.assert_array_equal(trace.allocate_roots([0.5] * 3, 6), [2, 2, 2])
  # A cap binds: uncapped, v = [0.5, 0.02] and M = 6 gives [6, 0] (0.969 > 0.875 + 0.039);
  # with at most 4 per prompt the rest must go to the saturated prompt.
  np.testing.assert_array_equal(trace.allocate_roots([0.5, 0.02], 6), [6, 0])
  np.testing.assert_array_equal(trace.allocate_roots([0.5, 0.02], 6, max_per_prompt=4), [4, 2])
  np.testing.assert_array_equal(trace.allocate_roots([0.3, 0.7], 0), [0, 0])


def test_allocate_roots_infeasible():
  with pytest.raises(ValueError, match="exactly 1"):
    trace.allocate_roots([0.5, 0.5], 1)  # m = 1 is not allowed
  with pytest.raises(ValueError, match="exactly 5"):
    trace.allocate_roots([0.5, 0.5, 0.5], 5, max_per_prompt=2)  # only even totals
  with pytest.raises(ValueError, match="exactly 9"):
    trace.allocate_roots([0.5, 0.5], 9, max_per_prompt=4)  # more than B * cap
  with pytest.raises(ValueError, match="probabilities"):
    trace.allocate_roots([0.5, float("nan")], 4)


def brute_force_roots(v, total, cap):
  """All allocations in ({0} U {2..cap})^B with sum = total: (best value, most active
  prompts among the allocations within 1e-12 of the best)."""
  v = np.clip(np.asarray(v, np.float64), trace.EPS, 1 - trace.EPS)
  allowed = [0] + list(range(2, cap + 1))
  scored = []
  for m in itertools.product(allowed, repeat=len(v)):
    if sum(m) == total:
      value = sum(1 - vi**mi - (1 - vi) ** mi for vi, mi in zip(v, m) if mi >= 2)
      scored.append((value, sum(mi > 0 for mi in m)))
  if not scored:
    return None
  best = max(s for s, _ in scored)
  return best, max(a for s, a in scored if s >= best - 1e-12)


@settings(max_examples=examples(300), deadline=None)
@given(v=st.lists(PROBS, min_size=1, max_size=4), total=st.integers(0, 9),
       cap=st.one_of(st.none(), st.integers(2, 6)))
def test_allocate_roots_matches_brute_force(v, total, cap):
  eff_cap = total if cap is None else min(cap, total)
  want = brute_force_roots(v, total, eff_cap)
  if want is None:
    with pytest.raises(ValueError):
      trace.allocate_roots(v, total, cap)
    return
  m = trace.allocate_roots(v, total, cap)
  assert m.sum() == total
  assert all(mi == 0 or 2 <= mi <= eff_cap for mi in m)
  vc = np.clip(np.asarray(v), trace.EPS, 1 - trace.EPS)
  value = trace.root_value(vc, m).sum()
  assert value >= want[0] - 1e-9
  assert (m > 0).sum() == want[1]
  np.testing.assert_array_equal(trace.allocate_roots(v, total, cap), m)  # deterministic


def test_allocate_roots_large_is_fast_and_valid():
  rng = np.random.default_rng(0)
  v = rng.beta(0.5, 0.5, size=512)  # many near 0 or 1, like a trained predictor's
  start = time.perf_counter()
  m = trace.allocate_roots(v, 1024)
  elapsed = time.perf_counter() - start
  assert elapsed < 20.0, f"allocate_roots took {elapsed:.1f} s for B=512, M=1024"
  assert m.sum() == 1024 and set(np.unique(m)) <= {0} | set(range(2, 1025))
  # Saturated prompts are skipped: none with v < 0.05 or v > 0.95 is active.
  assert (m[(v < 0.05) | (v > 0.95)] == 0).all()
  # No single move of two rollouts from one prompt to another (keeping m in the allowed
  # set) improves the objective: a local check of the DP's global optimum.
  vc = np.clip(v, trace.EPS, 1 - trace.EPS)
  base = trace.root_value(vc, m).sum()
  for i, j in [(i, j) for i in np.flatnonzero(m >= 4)[:20] for j in range(0, 512, 7) if i != j]:
    m2 = m.copy()
    m2[i] -= 2
    m2[j] += 2
    assert trace.root_value(vc, m2).sum() <= base + 1e-9


# ---------------------------------------------------------------------------
# Stage 2: prefixes
# ---------------------------------------------------------------------------


def test_flip_and_prefix_value():
  # A success through a prefix predicted at 0.2 repeats with q = 0.2 (flips with 0.8);
  # a failure through a prefix predicted at 0.8 repeats with q = 1 - 0.8 = 0.2.
  np.testing.assert_allclose(trace.flip_probability([1.0, 0.0, 1.0], [0.2, 0.8, 0.9]),
                             [0.2, 0.2, 0.9])
  np.testing.assert_allclose(trace.flip_probability(1.0, 1.0), 1 - trace.EPS)  # clipped
  np.testing.assert_allclose(trace.flip_probability(0.5, 0.9), 0.5)  # F1 reward interpolates
  np.testing.assert_allclose(trace.prefix_value([0.5, 0.5, 0.2], [0, 2, 1]), [0, 0.75, 0.8])


def test_allocate_prefixes_hand_examples():
  # q = [0.2, 0.9, 0.5], budget 5. Marginal gains q^K (1 - q): anchor 0: 0.8, 0.16, 0.032;
  # anchor 1: 0.1, 0.09, ...; anchor 2: 0.5, 0.25, 0.125, 0.0625. The five largest are
  # 0.8 (a0), 0.5 (a2), 0.25 (a2), 0.16 (a0), 0.125 (a2) -> K = [2, 0, 3], value
  # (1 - 0.04) + 0 + (1 - 0.125) = 1.835.
  k = trace.allocate_prefixes([0.2, 0.9, 0.5], 5)
  np.testing.assert_array_equal(k, [2, 0, 3])
  assert trace.prefix_value([0.2, 0.9, 0.5], k).sum() == pytest.approx(1.835)
  # Ties go to the lowest index: equal q -> round-robin from anchor 0.
  np.testing.assert_array_equal(trace.allocate_prefixes([0.5] * 3, 4), [2, 1, 1])
  np.testing.assert_array_equal(trace.allocate_prefixes([0.3, 0.4], 0), [0, 0])
  np.testing.assert_array_equal(trace.allocate_prefixes([], 0), np.zeros(0))
  with pytest.raises(ValueError, match="fall back"):
    trace.allocate_prefixes([], 3)
  with pytest.raises(ValueError, match="probabilities"):
    trace.allocate_prefixes([1.5], 3)


@settings(max_examples=examples(300), deadline=None)
@given(q=st.lists(PROBS, min_size=1, max_size=4), budget=st.integers(0, 7))
def test_allocate_prefixes_matches_brute_force(q, budget):
  k = trace.allocate_prefixes(q, budget)
  assert k.sum() == budget and (k >= 0).all()
  best = max(
      sum(1 - qa**ka for qa, ka in zip(q, ks))
      for ks in itertools.product(range(budget + 1), repeat=len(q)) if sum(ks) == budget)
  assert trace.prefix_value(q, k).sum() == pytest.approx(best, abs=1e-12)


# ---------------------------------------------------------------------------
# Tree statistics
# ---------------------------------------------------------------------------


def policy(tree, parent):
  return tree.add_node(parent, NodeKind.POLICY, [5], logprobs=[-1.0])


def hand_tree():
  """root -> p1 -> {p2 (r=1), env e -> p3 -> {p4 (r=0), p5 (r=0)}}; root -> p6 (r=1)."""
  tree = RolloutTree.new([1])
  p1 = policy(tree, 0)
  p2 = policy(tree, p1)
  e = tree.add_node(p1, NodeKind.ENV, [6])
  p3 = policy(tree, e)
  p4, p5 = policy(tree, p3), policy(tree, p3)
  p6 = policy(tree, 0)
  for node, r in ((p2, 1.0), (p4, 0.0), (p5, 0.0), (p6, 1.0)):
    tree.add_leaf(node, {"outcome": r})
  return tree


def test_backed_up_targets_hand_tree():
  # Preorder: 0 root, 1 p1, 2 p2, 3 e, 4 p3, 5 p4, 6 p5, 7 p6.
  # n_y: leaves 1; p3 = e = 2; p1 = 1 + 2 = 3; root = 3 + 1 = 4.
  # V_hat: p3 = e = 0; p1 = (1 * 1 + 2 * 0) / 3 = 1/3 (TreeRPO's child mean would give 1/2);
  # root = (3 * 1/3 + 1 * 1) / 4 = 0.5 = mean of the four leaf rewards.
  batch = pack([hand_tree()], dataclasses.replace(TEST_BUCKETS, trees=(2,)))
  n_y, v_hat = trace.backed_up_targets(batch)
  np.testing.assert_array_equal(np.asarray(n_y)[0, :8], [4, 3, 1, 2, 2, 1, 1, 1])
  np.testing.assert_allclose(np.asarray(v_hat)[0, :8], [0.5, 1 / 3, 1, 0, 0, 0, 0, 1], atol=1e-7)
  assert (np.asarray(n_y)[0, 8:] == 0).all() and (np.asarray(n_y)[1] == 0).all()
  assert (np.asarray(v_hat)[0, 8:] == 0).all() and (np.asarray(v_hat)[1] == 0).all()


def eq18(tree: RolloutTree):
  """Eq. 18 as written, bottom-up over children (canonical tree: children after parents)."""
  kids = tree.children()
  reward = {leaf.node: leaf.rewards["outcome"] for leaf in tree.leaves}
  n = [0] * len(tree.nodes)
  v = [0.0] * len(tree.nodes)
  for y in range(len(tree.nodes) - 1, -1, -1):
    if not kids[y]:
      n[y], v[y] = 1, reward[y]
    else:
      n[y] = sum(n[c] for c in kids[y])
      v[y] = sum(n[c] * v[c] for c in kids[y]) / n[y]
  return n, v


@settings(max_examples=examples(60), deadline=None)
@given(trees=st.lists(general_tree(outcomes=(0.0, 0.25, 1.0)), min_size=4, max_size=4))
def test_backed_up_targets_match_eq18(trees):
  canon = [t.canonical() for t in trees]
  batch = pack(canon, TEST_BUCKETS)
  n_y, v_hat = (np.asarray(x) for x in trace.backed_up_targets(batch))
  ratio = float(trace.effective_ratio(batch))
  for b, t in enumerate(canon):
    n, v = eq18(t)
    np.testing.assert_array_equal(n_y[b, :len(n)], n)
    np.testing.assert_allclose(v_hat[b, :len(v)], v, atol=1e-6)
    rewards = [leaf.rewards["outcome"] for leaf in t.leaves]
    assert n_y[b, 0] == len(t.leaves)
    assert v_hat[b, 0] == pytest.approx(np.mean(rewards), abs=1e-6)
  mixed = [len({leaf.rewards["outcome"] for leaf in t.leaves}) > 1 for t in canon]
  assert ratio == pytest.approx(np.mean(mixed))


def flat(rewards):
  tree = RolloutTree.new([1])
  for r in rewards:
    tree.add_leaf(policy(tree, 0), {"outcome": r})
  return tree


def test_effective_ratio_hand_trees():
  # Mixed: [0, 1] and the hand tree (1, 0, 0, 1); not mixed: [1, 1] and a single leaf.
  # 2 of 4 valid trees -> 0.5; the two padding trees of the bucket do not count.
  trees = [flat([0.0, 1.0]), flat([1.0, 1.0]), flat([0.0]), hand_tree()]
  batch = pack(trees, dataclasses.replace(TEST_BUCKETS, trees=(6,)))
  assert float(trace.effective_ratio(batch)) == pytest.approx(0.5)
  # Continuous rewards: any spread counts (Var > 0 works for F1 rewards;
  # docs/methods/trace.md#non-binary-rewards).
  batch = pack([flat([0.3, 0.31]), flat([0.5, 0.5])], TEST_BUCKETS)
  assert float(trace.effective_ratio(batch)) == pytest.approx(0.5)
  # Other channels are read by name.
  tree = flat([1.0, 1.0])
  for leaf, f in zip(tree.leaves, (0.2, 0.4)):
    leaf.rewards["format"] = f
  batch = pack([tree], TEST_BUCKETS)
  assert float(trace.effective_ratio(batch)) == 0.0
  assert float(trace.effective_ratio(batch, channel="format")) == 1.0
