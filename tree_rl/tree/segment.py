"""Masked segment reductions over group ids, vmapped over trees, and the
reverse discounted scan.

Every reduction takes per-tree rows `values [B, X]`, integer `segment_ids
[B, X]` in [0, G) and an optional boolean `mask [B, X]`, and returns `[B, G]`.
Masked-out entries and negative ids (padding) are routed to an extra dump
segment that is dropped, so `num_segments` stays static. With one segment (a
group that is the whole tree) the reductions are plain masked row reductions,
with no scatter. Empty segments give
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


def row_moments(values: Float[Array, "B X"], ok: Bool[Array, "B X"], *, ddof: int):
  """Mean and std ([B, 1] each) of each row's entries where `ok`, in the fewest passes (two:
  the mean, then the squared deviations): the one-segment fast path of the mean, std and
  z-score. The std is 0 where a row has <= ddof entries."""
  c = ok.sum(-1, keepdims=True).astype(jnp.float32)
  mean = jnp.where(ok, values, 0).sum(-1, keepdims=True) / jnp.maximum(c, 1.0)
  dev = jnp.where(ok, values - mean, 0)
  var = jnp.where(c > ddof, (dev * dev).sum(-1, keepdims=True) / jnp.maximum(c - ddof, 1.0), 0.0)
  return mean, jnp.sqrt(var)


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
  gives exactly 0. `center_only=True` returns x - mean_g (Dr.GRPO).
  """
  if num_segments == 1:
    ok = _route(segment_ids, mask, 1)[1]
    mean, std = row_moments(values, ok, ddof=ddof)
  else:
    mean = gather(segment_mean(values, segment_ids, num_segments, mask), segment_ids)
    std = gather(segment_std(values, segment_ids, num_segments, mask, ddof=ddof), segment_ids)
    ok = segment_ids >= 0
    if mask is not None:
      ok = ok & mask
  if center_only:
    z = values - mean
    # Same exact-zero rule for ties as the normalised form.
    z = jnp.where(std > STD_FLOOR, z, 0.0)
  else:
    z = jnp.where(std > STD_FLOOR, (values - mean) / (std + eps), 0.0)
  return jnp.where(ok, z, 0.0)


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
