"""Tree attention as Pallas Mosaic kernels (TPU): forward, dq and dk/dv.

The same math as the Triton kernels of `tree_rl.models.pallas_attention` (read that
module first), laid out as a TPU wants it. A TPU kernel's grid is static and each
grid step moves one block per operand into VMEM, so instead of a loop with a
dynamic trip count the grid walks a flat list of (query block, key block) pairs,
P slots per row, prefetched into SMEM as scalars (the pattern of JAX's splash
attention):

* forward and dq walk the pairs query-block-major: consecutive slots of one query
  block accumulate into VMEM scratch, and its output is written at its last slot;
* dk/dv walk them key-block-major, each slot adding the G query heads that share
  the kv head.

Every block holds a pair with itself (padding blocks too, fully masked), so every
output block is written. Unused slots repeat the row's last pair, so they fetch
nothing new, and are skipped. P is a static bound: all nb (nb + 1) / 2 causal
pairs by default, or nb * max_kv_blocks + nb when the caller fitted max_kv_blocks
to the batch (`tree_rl.models.attention.fit_attention`); a batch with more pairs
than slots gives NaN, never a partial softmax.

Arrays are head-major ([B, H, L, Dh]) so a block's last two dims are (block, Dh);
per-token vectors are [B, L, 1] (query side, a column) or [B, 1, L] (key side, a
row), so block must be a multiple of 128. These kernels lower to Mosaic on any
host (`tree_rl.lowering`) and are tested in interpret mode; they have not run on
a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG = -1e30
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def pair_slots(nb: int, max_kv_blocks: int) -> int:
  """P: every causal pair, or the fitted bound's pairs plus one self pair per block."""
  causal = nb * (nb + 1) // 2
  return causal if max_kv_blocks <= 0 else min(causal, nb * max_kv_blocks + nb)


def pair_lists(node, end, block: int, slots: int):
  """Flat (query block, key block) pair lists of each row, query-major and key-major.

  Returns (q_major, k_major, overflow): q_major is (q_blk [B, P], k_blk [B, P], count
  [B]), k_major (k_blk, q_blk, count) sorted by key block, and overflow whether some row
  has more pairs than P slots.
  """
  b, l = node.shape
  nb = l // block
  nodes = node.reshape(b, nb, block)
  big = jnp.iinfo(jnp.int32).max
  q_min = jnp.where(nodes >= 0, nodes, big).min(-1)
  k_max = end.reshape(b, nb, block).max(-1)
  causal = jnp.arange(nb)[:, None] >= jnp.arange(nb)[None, :]
  vis = ((k_max[:, None, :] > q_min[:, :, None]) & causal) | jnp.eye(nb, dtype=bool)

  def flat(v):  # [B, nb, nb] -> row-major slots of the True pairs
    count = v.reshape(b, -1).sum(-1).astype(jnp.int32)
    (idx,) = jax.vmap(lambda x: jnp.nonzero(x, size=slots, fill_value=-1))(v.reshape(b, -1))
    last = jnp.take_along_axis(idx, jnp.clip(count - 1, 0, slots - 1)[:, None], axis=1)
    idx = jnp.where(idx >= 0, idx, last).astype(jnp.int32)
    return idx // nb, idx % nb, jnp.minimum(count, slots)

  overflow = vis.reshape(b, -1).sum(-1).max() > slots
  return flat(vis), flat(vis.swapaxes(1, 2)), overflow


def _mask(qb, kb, block, q_node, k_node, k_end):
  """[bq, bk] tree mask: q_node a [bq, 1] column, k_node and k_end [1, bk] rows."""
  q_pos = qb * block + lax.broadcasted_iota(jnp.int32, (block, block), 0)
  k_pos = kb * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
  return (k_node <= q_node) & (q_node < k_end) & (k_pos <= q_pos)


def _slot(major_ref, count_ref, slots: int):
  """(b, p, count, first, last) of the grid step at row b, slot p: the row's used slots,
  and whether p is the first and the last slot of its output block (`major_ref` lists
  each slot's block in the order the grid walks them; slots past `count` repeat the row's
  last pair)."""
  b, p = pl.program_id(0), pl.program_id(2)
  count, block = count_ref[b], major_ref[b, p]
  first = (p == 0) | (major_ref[b, jnp.maximum(p - 1, 0)] != block)
  last = (p == count - 1) | (major_ref[b, jnp.minimum(p + 1, slots - 1)] != block)
  return b, p, count, first, last


def _fwd_kernel(qb_ref, kb_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref,
                o_ref, lse_ref, m_scr, l_scr, acc_scr, *, block, scale, slots):
  b, p, count, first, last = _slot(qb_ref, count_ref, slots)
  qb, kb = qb_ref[b, p], kb_ref[b, p]

  @pl.when(first)
  def _():
    m_scr[...] = jnp.full_like(m_scr, _NEG)
    l_scr[...] = jnp.zeros_like(l_scr)
    acc_scr[...] = jnp.zeros_like(acc_scr)

  @pl.when(p < count)
  def _():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    mask = _mask(qb, kb, block, qn_ref[...], kn_ref[...], ke_ref[...])
    s = jnp.where(mask, s, _NEG)
    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p_ = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m_prev - m_new)
    l_scr[...] = l_scr[...] * corr + p_.sum(axis=1, keepdims=True)
    acc_scr[...] = acc_scr[...] * corr + lax.dot_general(
        p_.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    m_scr[...] = m_new

  @pl.when(last & (p < count))
  def _():
    den = l_scr[...]
    seen = den > 0
    safe = jnp.where(seen, den, 1.0)
    o_ref[...] = jnp.where(seen, acc_scr[...] / safe, 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_scr[...] + jnp.log(safe), -_NEG)


def _dq_kernel(qb_ref, kb_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref,
               do_ref, lse_ref, delta_ref, dq_ref, acc_scr, *, block, scale, slots):
  b, p, count, first, last = _slot(qb_ref, count_ref, slots)
  qb, kb = qb_ref[b, p], kb_ref[b, p]

  @pl.when(first)
  def _():
    acc_scr[...] = jnp.zeros_like(acc_scr)

  @pl.when(p < count)
  def _():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    mask = _mask(qb, kb, block, qn_ref[...], kn_ref[...], ke_ref[...])
    p_ = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    ds = p_ * (dp - delta_ref[...]) * scale
    acc_scr[...] += lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)

  @pl.when(last & (p < count))
  def _():
    dq_ref[...] = acc_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(kb_ref, qb_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, block, groups,
                scale, slots):
  b, p, count, first, last = _slot(kb_ref, count_ref, slots)
  kb, qb = kb_ref[b, p], qb_ref[b, p]

  @pl.when(first)
  def _():
    dk_scr[...] = jnp.zeros_like(dk_scr)
    dv_scr[...] = jnp.zeros_like(dv_scr)

  @pl.when(p < count)
  def _():
    k, v = k_ref[...], v_ref[...]
    mask = _mask(qb, kb, block, qn_ref[...], kn_ref[...], ke_ref[...])
    for g in range(groups):  # the query heads sharing this kv head
      q, do = q_ref[g], do_ref[g]
      s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
      p_ = jnp.where(mask, jnp.exp(s - lse_ref[g]), 0.0)
      dv_scr[...] += lax.dot_general(p_.astype(do.dtype), do, _TN,
                                     preferred_element_type=jnp.float32)
      dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
      ds = p_ * (dp - delta_ref[g]) * scale
      dk_scr[...] += lax.dot_general(ds.astype(q.dtype), q, _TN,
                                     preferred_element_type=jnp.float32)

  @pl.when(last & (p < count))
  def _():
    dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _params(interpret: bool):
  if interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _vectors(node, end):
  """Query-side columns [B, L, 1] and key-side rows [B, 1, L]."""
  return node[:, :, None], node[:, None, :], end[:, None, :]


def forward(q, k, v, node, end, *, block, max_kv_blocks, interpret):
  """(out [B, L, H, Dh], lse [B, H, L] f32) of the tree attention."""
  b, l, h, d = q.shape
  hk = k.shape[2]
  g, nb = h // hk, l // block
  slots = pair_slots(nb, max_kv_blocks)
  (qb, kb, count), _, overflow = pair_lists(node, end, block, slots)
  qn, kn, ke = _vectors(node, end)
  qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # head-major
  tile = lambda f: pl.BlockSpec((None, None, block, d), f)
  q_map = lambda bi, hi, p, qb, kb, c: (bi, hi, qb[bi, p], 0)
  kv_map = lambda bi, hi, p, qb, kb, c: (bi, lax.div(hi, g), kb[bi, p], 0)
  in_specs = [
      tile(q_map), tile(kv_map), tile(kv_map),
      pl.BlockSpec((None, block, 1), lambda bi, hi, p, qb, kb, c: (bi, qb[bi, p], 0)),
      pl.BlockSpec((None, 1, block), lambda bi, hi, p, qb, kb, c: (bi, 0, kb[bi, p])),
      pl.BlockSpec((None, 1, block), lambda bi, hi, p, qb, kb, c: (bi, 0, kb[bi, p])),
  ]
  out_specs = [tile(q_map), pl.BlockSpec((None, None, block, 1), q_map)]
  out, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, block=block, scale=1.0 / math.sqrt(d), slots=slots),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, h, slots), in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((block, 1), jnp.float32),
                          pltpu.VMEM((block, 1), jnp.float32),
                          pltpu.VMEM((block, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((b, h, l, d), q.dtype),
                 jax.ShapeDtypeStruct((b, h, l, 1), jnp.float32)],
      compiler_params=_params(interpret), interpret=interpret, name="tree_attention_fwd_tpu",
  )(qb, kb, count, qh, kh, vh, qn, kn, ke)
  out = jnp.where(overflow, jnp.nan, out.transpose(0, 2, 1, 3))  # dropped pairs: poison
  return out, lse[..., 0]


def backward(q, k, v, node, end, out, lse, do, *, block, max_kv_blocks, interpret):
  """(dq, dk, dv) of the tree attention, from the forward's output and lse."""
  b, l, h, d = q.shape
  hk = k.shape[2]
  g, nb = h // hk, l // block
  scale = 1.0 / math.sqrt(d)
  slots = pair_slots(nb, max_kv_blocks)
  (qb, kb, qcount), (kb2, qb2, kcount), _ = pair_lists(node, end, block, slots)
  qn, kn, ke = _vectors(node, end)
  delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), do.astype(jnp.float32))
  stats = lse[..., None], delta[..., None]  # [B, H, L, 1]
  qh, kh, vh, doh = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
  params = _params(interpret)

  q_map = lambda bi, hi, p, qb, kb, c: (bi, hi, qb[bi, p], 0)
  kv_map = lambda bi, hi, p, qb, kb, c: (bi, lax.div(hi, g), kb[bi, p], 0)
  tile = lambda f: pl.BlockSpec((None, None, block, d), f)
  col = lambda f: pl.BlockSpec((None, None, block, 1), f)
  q_vec = pl.BlockSpec((None, block, 1), lambda bi, hi, p, qb, kb, c: (bi, qb[bi, p], 0))
  k_vec = pl.BlockSpec((None, 1, block), lambda bi, hi, p, qb, kb, c: (bi, 0, kb[bi, p]))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block=block, scale=scale, slots=slots),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, h, slots),
          in_specs=[tile(q_map), tile(kv_map), tile(kv_map), q_vec, k_vec, k_vec, tile(q_map),
                    col(q_map), col(q_map)],
          out_specs=tile(q_map), scratch_shapes=[pltpu.VMEM((block, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
      compiler_params=params, interpret=interpret, name="tree_attention_dq_tpu",
  )(qb, kb, qcount, qh, kh, vh, qn, kn, ke, doh, *stats)

  # Key-major: the grid's head axis is the kv head; the G query heads come as one block.
  k_map = lambda bi, hi, p, kb, qb, c: (bi, hi, kb[bi, p], 0)
  qg_map = lambda bi, hi, p, kb, qb, c: (bi, hi, qb[bi, p], 0)
  group = lambda last: pl.BlockSpec((None, g, block, last), qg_map)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block=block, groups=g, scale=scale, slots=slots),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3, grid=(b, hk, slots),
          in_specs=[group(d), tile(k_map), tile(k_map),
                    pl.BlockSpec((None, block, 1), lambda bi, hi, p, kb, qb, c: (bi, qb[bi, p], 0)),
                    pl.BlockSpec((None, 1, block), lambda bi, hi, p, kb, qb, c: (bi, 0, kb[bi, p])),
                    pl.BlockSpec((None, 1, block), lambda bi, hi, p, kb, qb, c: (bi, 0, kb[bi, p])),
                    group(d), group(1), group(1)],
          out_specs=[tile(k_map), tile(k_map)],
          scratch_shapes=[pltpu.VMEM((block, d), jnp.float32),
                          pltpu.VMEM((block, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(kh.shape, k.dtype), jax.ShapeDtypeStruct(vh.shape, v.dtype)],
      compiler_params=params, interpret=interpret, name="tree_attention_dkv_tpu",
  )(kb2, qb2, kcount, qh, kh, vh, qn, kn, ke, doh, *stats)
  back = lambda x: x.transpose(0, 2, 1, 3)
  return back(dq), back(dk), back(dv)
