"""Segment kernels against numpy per group; the reverse discounted scan
against its O(L^2) definition."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tree_rl.tree import segment


def _case(seed, b=3, x=17, g=5):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(b, x)).astype(np.float32)
  ids = rng.integers(-1, g, size=(b, x)).astype(np.int32)  # -1 = padding
  mask = rng.random((b, x)) < 0.8
  return values, ids, mask, g


def _groups(values, ids, mask, g):
  for b in range(values.shape[0]):
    for k in range(g):
      yield b, k, values[b][(ids[b] == k) & mask[b]]


# g = 1 takes the one-segment fast path (plain masked row reductions, no scatter); rows of
# 8 are summed by unrolled adds, rows of 17 by a reduce (segment.UNROLL_ROW_SUM = 16).
@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 5]), st.sampled_from([8, 17]))
def test_reductions_match_numpy(seed, g, x):
  values, ids, mask, g = _case(seed, x=x, g=g)
  args = (jnp.asarray(values), jnp.asarray(ids), g, jnp.asarray(mask))
  out = {
      "sum": segment.segment_sum(*args), "count": segment.segment_count(args[1], g, args[3]),
      "mean": segment.segment_mean(*args), "std0": segment.segment_std(*args, ddof=0),
      "std1": segment.segment_std(*args, ddof=1), "max": segment.segment_max(*args, fill=-7.0),
      "min": segment.segment_min(*args, fill=7.0),
  }
  out = {k: np.asarray(v) for k, v in out.items()}
  for b, k, v in _groups(values, ids, mask, g):
    n = len(v)
    assert out["count"][b, k] == n
    np.testing.assert_allclose(out["sum"][b, k], v.sum(), atol=1e-5)
    np.testing.assert_allclose(out["mean"][b, k], v.mean() if n else 0.0, atol=1e-5)
    np.testing.assert_allclose(out["std0"][b, k], v.std() if n else 0.0, atol=1e-5)
    np.testing.assert_allclose(out["std1"][b, k], v.std(ddof=1) if n > 1 else 0.0, atol=1e-5)
    np.testing.assert_allclose(out["max"][b, k], v.max() if n else -7.0, atol=1e-6)
    np.testing.assert_allclose(out["min"][b, k], v.min() if n else 7.0, atol=1e-6)


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 1]), st.sampled_from([1, 5]),
       st.sampled_from([8, 17]))
def test_zscore_matches_numpy(seed, ddof, g, x):
  values, ids, mask, g = _case(seed, x=x, g=g)
  values[0, :6] = 0.3  # a group of equal values somewhere
  ids[0, :6] = 0
  mask[0, :6] = True
  z = np.asarray(segment.segment_zscore(jnp.asarray(values), jnp.asarray(ids), g,
                                        jnp.asarray(mask), ddof=ddof, eps=1e-6))
  for b in range(values.shape[0]):
    for i in range(values.shape[1]):
      if ids[b, i] < 0 or not mask[b, i]:
        assert z[b, i] == 0
        continue
      v = values[b][(ids[b] == ids[b, i]) & mask[b]]
      sd = v.std(ddof=ddof) if len(v) > ddof else 0.0
      want = 0.0 if sd <= segment.STD_FLOOR else (values[b, i] - v.mean()) / (sd + 1e-6)
      np.testing.assert_allclose(z[b, i], want, atol=1e-4)


def test_gather_and_exact_zero_for_ties():
  per = jnp.array([[1.0, 2.0, 3.0]])
  np.testing.assert_array_equal(segment.gather(per, jnp.array([[2, -1, 0]])), [[3, 0, 1]])
  # 0.1 * 3 / 3 is not exactly 0.1 in float32: the floor keeps the z-score at 0.
  z = segment.segment_zscore(jnp.full((1, 3), 0.1), jnp.zeros((1, 3), jnp.int32), 1,
                             ddof=0, eps=1e-6)
  assert np.asarray(z).tolist() == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("width", [1, 2, 8, 16, 17, 40])
def test_row_sum_both_paths(width):
  x = np.random.default_rng(width).normal(size=(5, width)).astype(np.float32)
  got = segment.row_sum(jnp.asarray(x))
  assert got.shape == (5, 1)
  np.testing.assert_allclose(got[:, 0], x.sum(-1), rtol=1e-5, atol=1e-5)


def test_masked_means():
  rng = np.random.default_rng(0)
  mask = rng.random(300) < 0.6
  a = np.where(mask, rng.normal(size=300), 0.0).astype(np.float32)
  b = (mask & (rng.random(300) < 0.3)).astype(np.float32)
  got = segment.masked_means(jnp.asarray(mask), jnp.asarray(a), jnp.asarray(b))
  np.testing.assert_allclose(got, [a[mask].mean(), b[mask].mean()], rtol=1e-5, atol=1e-6)
  # Entries off the mask do not count, whatever they hold; an empty mask gives 0.
  off = segment.masked_means(jnp.asarray(mask), jnp.asarray(np.where(mask, a, 7.0)))
  np.testing.assert_allclose(off, [a[mask].mean()], rtol=1e-5, atol=1e-6)
  assert [float(v) for v in segment.masked_means(jnp.zeros(4, bool), jnp.ones(4))] == [0.0]
  # One entry (XLA reduces it without the combiner): its own mean, or 0 off the mask.
  for on, want in ((True, 0.5), (False, 0.0)):
    assert float(segment.masked_means(jnp.array([on]), jnp.array([0.5]))[0]) == want
  # All-equal flags average exactly (the metrics' zero_std_frac of 0 and 1).
  assert float(segment.masked_means(jnp.asarray(mask), jnp.asarray(mask))[0]) == 1.0


def _quadratic(x, gamma):
  t = x.shape[-1]
  i = np.arange(t)
  decay = np.where(i[None, :] >= i[:, None], gamma ** np.maximum(i[None, :] - i[:, None], 0), 0.0)
  return x @ decay.T


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2 ** (-1 / 32), 1.0])
def test_discounted_scan_matches_quadratic(gamma):
  x = np.random.default_rng(0).normal(size=(4, 3, 50))
  got = segment.discounted_reverse_cumsum(jnp.asarray(x, jnp.float32), gamma)
  np.testing.assert_allclose(got, _quadratic(x, gamma), rtol=1e-4, atol=1e-4)
  got_axis = segment.discounted_reverse_cumsum(jnp.asarray(np.moveaxis(x, -1, 1), jnp.float32),
                                               gamma, axis=1)
  np.testing.assert_allclose(np.moveaxis(np.asarray(got_axis), 1, -1), _quadratic(x, gamma),
                             rtol=1e-4, atol=1e-4)


def test_discounted_scan_gamma_does_not_recompile():
  f = chex.assert_max_traces(segment.discounted_reverse_cumsum.__wrapped__, n=1)
  import jax
  g = jax.jit(f)
  chex.clear_trace_counter()
  x = jnp.ones((2, 8))
  for gamma in (0.9, 0.95, 0.99):
    g(x, jnp.float32(gamma))
