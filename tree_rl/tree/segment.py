"""Masked segment reductions over group ids, vmapped over trees, and the
reverse discounted scan.

Every reduction takes per-tree rows `values [B, X]`, integer `segment_ids
[B, X]` in [0, G) and an optional boolean `mask [B, X]`, and returns `[B, G]`.
Masked-out entries and negative ids (padding) are routed to an extra dump
segment that is dropped, so `num_segments` stays static. With one segment (a
group that is the whole tree) the reductions are plain masked row reductions,
with no scatter, and rows as narrow as a tree's leaves are summed by unrolled
adds that fuse with the work around them (`row_sum`). Empty segments give
0 for sums, counts, means and stds, and `fill` for max/min.

The standard deviation takes `ddof` explicitly (0 = population, 1 = unbiased)
because the papers disagree (PORTool/AWPO: population; verl's GRPO: unbiased).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tree_rl.tree.types import Array, Bool, Float, Int

# Groups whose standard deviation is at or below this are treated as having
# no spread: their z-scores are exactly 0 (every method's group z-score does; with a
# plain `std + eps` denominator, float round-off in the mean of equal values
# would leak small non-zero advantages).
STD_FLOOR = 1e-6


def _route(segment_ids, mask, num_segments):
  ok = segment_ids >= 0
  if mask is not None:
    ok = ok & mask
  return jnp.where(ok, segment_ids, num_segments), ok


def segment_sum(
    values: Float[Array, "B X"],
    segment_ids: Int[Array, "B X"],
    num_segments: int,
    mask: Bool[Array, "B X"] | None = None,
) -> Float[Array, "B G"]:
  ids, ok = _route(segment_ids, mask, num_segments)
  values = jnp.where(ok, values, 0)
  if num_segments == 1:  # the whole row (a tree's leaves): a reduction, not a scatter
    return values.sum(-1, keepdims=True)
  f = lambda v, i: jax.ops.segment_sum(v, i, num_segments=num_segments + 1)[:num_segments]
  return jax.vmap(f)(values, ids)


def segment_count(
    segment_ids: Int[Array, "B X"],
    num_segments: int,
    mask: Bool[Array, "B X"] | None = None,
) -> Float[Array, "B G"]:
  return segment_sum(jnp.ones(segment_ids.shape, jnp.float32), segment_ids, num_segments, mask)


def segment_mean(values, segment_ids, num_segments, mask=None) -> Float[Array, "B G"]:
  s = segment_sum(values, segment_ids, num_segments, mask)
  c = segment_count(segment_ids, num_segments, mask)
  return s / jnp.maximum(c, 1.0)


# Rows at most this wide (the leaves of a tree) are summed by a chain of adds, not a reduce:
# adds are elementwise, so XLA fuses them with the masking before and the division after,
# where a reduce on CPU is a kernel of its own (a YNNPACK call), each one a pass and a launch.
UNROLL_ROW_SUM = 16


def row_sum(values: Float[Array, "B X"]) -> Float[Array, "B 1"]:
  """Sum of each row ([B, 1]); an unrolled chain of adds for rows of <= UNROLL_ROW_SUM."""
  width = values.shape[-1]
  if width > UNROLL_ROW_SUM:
    return values.sum(-1, keepdims=True)
  out = values[:, :1]
  for j in range(1, width):
    out = out + values[:, j:j + 1]
  return out


def row_moments(values: Float[Array, "B X"], ok: Bool[Array, "B X"], *, ddof: int):
  """Mean and std ([B, 1] each) of each row's entries where `ok`, in the fewest passes (two:
  the mean, then the squared deviations): the one-segment fast path of the mean, std and
  z-score. The std is 0 where a row has <= ddof entries."""
  c, mean, ss = row_stats(values, ok)
  return mean, std_from(c, ss, ddof)


def row_stats(values: Float[Array, "B X"], ok: Bool[Array, "B X"]):
  """(count, mean, sum of squared deviations), [B, 1] each, of each row's entries where
  `ok`: what the std of either ddof, the z-score and the group metrics are made of, so a
  caller needing several of them reduces each row once."""
  c = row_sum(ok.astype(jnp.float32))
  mean = row_sum(jnp.where(ok, values, 0.0)) / jnp.maximum(c, 1.0)
  dev = jnp.where(ok, values - mean, 0.0)
  return c, mean, row_sum(dev * dev)


def std_from(c: Float[Array, "B 1"], ss: Float[Array, "B 1"], ddof: int) -> Float[Array, "B 1"]:
  """The std from `row_stats`' count and squared deviations; 0 where count <= ddof."""
  return jnp.sqrt(jnp.where(c > ddof, ss / jnp.maximum(c - ddof, 1.0), 0.0))


def masked_means(mask: Bool[Array, "..."], *xs: Array) -> tuple[Float[Array, ""], ...]:
  """The mean of each x over the entries where `mask` (0 where it is empty), scalars.

  One variadic reduce carries the count and the sums, and alongside them each mean,
  recomputed from the merged sums at every step (so it is sum / max(count, 1) whatever the
  order). The reduce thus yields the means themselves: one kernel for all of them, where
  sums then a division per mean are a kernel per mean (XLA does not fuse consumers into a
  reduce). The divisions are off the reduce's dependency chain (the sums)."""
  k = len(xs)
  masked = tuple(jnp.where(mask, x, 0).astype(jnp.float32) for x in xs)
  # Each entry is a partial result in its own right (count 0 or 1, sum = mean = x): XLA may
  # take an entry as is, without the combiner (a reduce over one tree is a reshape).
  ops = (mask.astype(jnp.float32),) + masked + masked

  def merge(a, b):
    n = a[0] + b[0]
    sums = tuple(u + v for u, v in zip(a[1:k + 1], b[1:k + 1]))
    return (n,) + sums + tuple(s / jnp.maximum(n, 1.0) for s in sums)

  zero = jnp.zeros((), jnp.float32)
  out = lax.reduce(ops, (zero,) * len(ops), merge, tuple(range(mask.ndim)))
  return tuple(out[k + 1:])


def segment_std(values, segment_ids, num_segments, mask=None, *, ddof: int) -> Float[Array, "B G"]:
  """Two-pass standard deviation; 0 for groups with count <= ddof."""
  if num_segments == 1:
    return row_moments(values, _route(segment_ids, mask, 1)[1], ddof=ddof)[1]
  mean = segment_mean(values, segment_ids, num_segments, mask)
  dev = values - gather(mean, segment_ids)
  ss = segment_sum(dev * dev, segment_ids, num_segments, mask)
  c = segment_count(segment_ids, num_segments, mask)
  var = jnp.where(c > ddof, ss / jnp.maximum(c - ddof, 1.0), 0.0)
  return jnp.sqrt(var)


def segment_max(values, segment_ids, num_segments, mask=None, fill=0.0) -> Float[Array, "B G"]:
  ids, ok = _route(segment_ids, mask, num_segments)
  values = jnp.where(ok, values, -jnp.inf)
  if num_segments == 1:
    out = values.max(-1, keepdims=True)
  else:
    f = lambda v, i: jax.ops.segment_max(v, i, num_segments=num_segments + 1)[:num_segments]
    out = jax.vmap(f)(values, ids)
  return jnp.where(jnp.isfinite(out), out, fill)


def segment_min(values, segment_ids, num_segments, mask=None, fill=0.0) -> Float[Array, "B G"]:
  return -segment_max(-values, segment_ids, num_segments, mask, fill=-fill)


def gather(per_segment: Float[Array, "B G"], segment_ids: Int[Array, "B X"]) -> Float[Array, "B X"]:
  """Broadcasts per-segment values back to elements (0 for negative ids)."""
  if per_segment.shape[1] == 1:
    return jnp.where(segment_ids >= 0, per_segment, 0)
  safe = jnp.clip(segment_ids, 0, per_segment.shape[1] - 1)
  out = jnp.take_along_axis(per_segment, safe, axis=1)
  return jnp.where(segment_ids >= 0, out, 0)


def segment_zscore(
    values: Float[Array, "B X"],
    segment_ids: Int[Array, "B X"],
    num_segments: int,
    mask: Bool[Array, "B X"] | None = None,
    *,
    ddof: int,
    eps: float = 1e-6,
    center_only: bool = False,
) -> Float[Array, "B X"]:
  """(x - mean_g) / (std_g + eps) within each group; 0 where masked.

  A group whose std is <= STD_FLOOR (all values equal, or a single member)
  gives exactly 0. `center_only=True` returns x - mean_g (Dr.GRPO). A non-finite value
  makes its group's normalised z-scores NaN (`pack` refuses non-finite rewards).
  """
  if num_segments == 1:
    ok = _route(segment_ids, mask, 1)[1]
    c, mean, ss = row_stats(values, ok)
    std = std_from(c, ss, ddof)
  else:
    mean = gather(segment_mean(values, segment_ids, num_segments, mask), segment_ids)
    std = gather(segment_std(values, segment_ids, num_segments, mask, ddof=ddof), segment_ids)
    ok = segment_ids >= 0
    if mask is not None:
      ok = ok & mask
  dev = jnp.where(ok, values - mean, 0.0)
  if center_only:  # the same exact-zero rule for ties as the normalised form
    return jnp.where(std > STD_FLOOR, dev, 0.0)
  # One scale per group, 1 / (std + eps), or 0 through an infinite denominator where there
  # is no spread: the std, the floor test and the reciprocal are then one per-row kernel,
  # and the element-wise pass only multiplies (XLA:CPU turns the division into this anyway).
  return dev * (1.0 / jnp.where(std > STD_FLOOR, std + eps, jnp.inf))


@functools.partial(jax.jit, static_argnames=("axis",))
def discounted_reverse_cumsum(
    x: Float[Array, "... T"], gamma: float | Float[Array, ""], axis: int = -1
) -> Float[Array, "... T"]:
  """S_t = x_t + gamma * S_{t+1}, S_T = 0: a reverse scan in O(T) time and
  memory linear in T (APPO's future value Omega, eq. 4, in log space).

  `gamma` is traced (an array), so changing it does not recompile.
  """
  x = jnp.moveaxis(x, axis, 0)
  gamma = jnp.asarray(gamma, x.dtype)

  def step(carry, xt):
    s = xt + gamma * carry
    return s, s

  _, out = lax.scan(step, jnp.zeros_like(x[0]), x, reverse=True)
  return jnp.moveaxis(out, 0, axis)
