"""Tree attention as fused Pallas kernels, forward and backward (flash style).

The packed layout (`tree_rl.tree.batch`) is depth-first: node n's subtree is the
node range [n, subtree_end[n]), and every node's tokens follow its ancestors'. So
key j is visible to query i iff

    node(j) <= node(i) < subtree_end[node(j)]   and   j <= i,

an elementwise test on three per-token vectors (the query's node, the key's node
and the key's subtree end), which is the exact mask the kernels apply inside a
block. Which (query block, key block) pairs hold any visible pair is known from
the same vectors: the nodes of a block are a contiguous range, so key block kb
<= qb is visible from query block qb iff the largest subtree end among kb's keys
exceeds the smallest node among qb's queries (`block_lists`).

Three kernels, each over the visible pairs only, so the work is the visible pairs,
not L^2:

* forward: per query block, an online softmax over its visible key blocks; it
  saves the log-sum-exp for the backward pass;
* dq: per query block, over the same key blocks;
* dk, dv: per key block, over the query blocks that see it and the G query heads
  that share its kv head (GQA), so dk and dv are written once per kv head.

Scores, softmax statistics and accumulators are f32 whatever the input dtype (bf16
inputs: bf16 products with f32 accumulation).

This module holds the GPU (Triton) kernels: a grid over (row, head, block) whose
programs loop over their block's visible partners with a dynamic trip count. The
pair lists are computed inside jit from the tree (an O(B nb^2) pass) with one
static width (nb, every block), so no bound is fitted to a batch and nothing
recompiles when the trees change. The TPU (Mosaic) kernels, which walk a static
grid of pair slots instead, are in `pallas_attention_tpu`; `pallas_tree_attention`
picks one set when the program is lowered (`lax.platform_dependent`).

On a CPU the kernels run only with `interpret=True` (tests);
`tree_rl.models.attention.attention` picks interpret mode on a CPU, and a CPU run
that asks for `model.attention="pallas"` is refused at start-up
(`tree_rl.config_types.ModelSpec.check_backend`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tree_rl.models import pallas_attention_tpu
from tree_rl.tree.types import Array, Float, Int

KERNEL_NAMES = ("tree_attention_fwd", "tree_attention_dq", "tree_attention_dkv")
_NEG = -1e30  # finite "minus infinity" (matches tree_rl.models.attention)


# ------------------------------------------------------------------- pair lists


def token_vectors(node_of_token: Int[Array, "B L"], subtree_end: Int[Array, "B N"]
                  ) -> tuple[Int[Array, "B L"], Int[Array, "B L"]]:
  """(node, end) per token: its node (-1 on padding) and its node's subtree end (-1 on
  padding), so key j is visible to query i iff node[j] <= node[i] < end[j] and j <= i."""
  safe = jnp.maximum(node_of_token, 0)
  end = jnp.take_along_axis(subtree_end, safe, axis=1)
  valid = node_of_token >= 0
  return (jnp.where(valid, node_of_token, -1).astype(jnp.int32),
          jnp.where(valid, end, -1).astype(jnp.int32))


def block_lists(node: Int[Array, "B L"], end: Int[Array, "B L"], block: int
                ) -> tuple[Int[Array, "B Q W"], Int[Array, "B Q"], Int[Array, "B K W"],
                           Int[Array, "B K"]]:
  """Visible block pairs of each row, as lists per query block and per key block.

  Returns (kv_list, kv_count, q_list, q_count): kv_list[b, qb, :kv_count[b, qb]] are
  the key blocks query block qb sees, ascending; q_list[b, kb, :q_count[b, kb]] the
  query blocks that see key block kb. W = nb = L / block; unused entries repeat the
  last used one (so a GPU kernel's next load stays in cache).
  """
  b, l = node.shape
  nb = l // block
  nodes = node.reshape(b, nb, block)
  big = jnp.iinfo(jnp.int32).max
  q_min = jnp.where(nodes >= 0, nodes, big).min(-1)  # [B, nb]: smallest node of a block
  k_max = end.reshape(b, nb, block).max(-1)  # [B, nb]: largest subtree end (-1: padding)
  causal = jnp.arange(nb)[:, None] >= jnp.arange(nb)[None, :]
  vis = (k_max[:, None, :] > q_min[:, :, None]) & causal  # [B, qb, kb]

  def listed(v):  # [B, R, nb] -> ascending True indices first, count
    count = v.sum(-1).astype(jnp.int32)
    order = jnp.argsort(~v, axis=-1, stable=True).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    used = jnp.arange(nb)[None, None, :] < count[..., None]
    return jnp.where(used, order, last), count

  kv_list, kv_count = listed(vis)
  q_list, q_count = listed(vis.swapaxes(1, 2))
  return kv_list, kv_count, q_list, q_count


# ------------------------------------------------------------------- kernels


def _mask(q_pos, q_node, k_pos, k_node, k_end):
  """[bq, bk] exact tree mask of a (query block, key block) pair."""
  return ((k_node[None, :] <= q_node[:, None]) & (q_node[:, None] < k_end[None, :])
          & (k_pos[None, :] <= q_pos[:, None]))


def _fwd_kernel(list_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref,
                o_ref, lse_ref, *, block, scale, precision):
  qb = pl.program_id(2)
  q = q_ref[...]
  q_node = qn_ref[...]
  q_pos = qb * block + jnp.arange(block)
  d = q.shape[-1]

  def body(j, carry):
    acc, mx, den = carry
    kb = list_ref[j]
    ks = pl.ds(pl.multiple_of(kb * block, block), block)
    k, v = k_ref[ks, :], v_ref[ks, :]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
    mask = _mask(q_pos, q_node, kb * block + jnp.arange(block), kn_ref[ks], ke_ref[ks])
    s = jnp.where(mask, s, _NEG)
    new_mx = jnp.maximum(mx, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - new_mx[:, None]), 0.0)
    corr = jnp.exp(mx - new_mx)
    acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, new_mx, den * corr + p.sum(-1)

  init = (jnp.zeros((block, d), jnp.float32), jnp.full((block,), _NEG, jnp.float32),
          jnp.zeros((block,), jnp.float32))
  acc, mx, den = lax.fori_loop(0, count_ref[...], body, init)
  seen = den > 0  # a query with no visible key (padding) outputs 0
  o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, den, 1.0)[:, None],
                         0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, mx + jnp.log(jnp.where(seen, den, 1.0)), -_NEG)


def _dq_kernel(list_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, block, scale, precision):
  qb = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_node = qn_ref[...]
  q_pos = qb * block + jnp.arange(block)

  def body(j, dq):
    kb = list_ref[j]
    ks = pl.ds(pl.multiple_of(kb * block, block), block)
    k, v = k_ref[ks, :], v_ref[ks, :]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
    mask = _mask(q_pos, q_node, kb * block + jnp.arange(block), kn_ref[ks], ke_ref[ks])
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dp = plgpu.dot(do, v, trans_b=True, precision=precision)
    ds = p * (dp - delta[:, None]) * scale
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

  dq = lax.fori_loop(0, count_ref[...], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(list_ref, count_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, ke_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, block, groups, scale, precision):
  kb = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  k_node, k_end = kn_ref[...], ke_ref[...]
  k_pos = kb * block + jnp.arange(block)

  def body(j, carry):  # j runs over (listed query block, query head of the group) pairs
    dk, dv = carry
    qb, g = list_ref[lax.div(j, groups)], lax.rem(j, groups)  # j >= 0
    qs = pl.ds(pl.multiple_of(qb * block, block), block)
    q, do = q_ref[qs, g, :], do_ref[qs, g, :]
    lse, delta = lse_ref[g, qs], delta_ref[g, qs]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
    mask = _mask(qb * block + jnp.arange(block), qn_ref[qs], k_pos, k_node, k_end)
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
    dp = plgpu.dot(do, v, trans_b=True, precision=precision)
    ds = p * (dp - delta[:, None]) * scale
    return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision), dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, count_ref[...] * groups, body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------- GPU calls


def _params(interpret: bool, head_dim: int):
  if interpret:
    return None
  return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _precision(dtype):
  # f32 inputs: full f32 products (no TF32), so f32 runs match the reference.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _common_specs(l: int, block: int):
  """Specs of the per-(row, block) pair list and count, and the per-row key vectors."""
  return [
      pl.BlockSpec((None, None, l // block), lambda b, h, i: (b, i, 0)),  # list
      pl.BlockSpec((None, None), lambda b, h, i: (b, i)),  # count
  ], pl.BlockSpec((None, l), lambda b, h, i: (b, 0))


def _gpu_forward(q, k, v, node, end, *, block, interpret):
  b, l, h, d = q.shape
  hk = k.shape[2]
  g, nb = h // hk, l // block
  kv_list, kv_count, _, _ = block_lists(node, end, block)
  lists, row = _common_specs(l, block)
  kernel = functools.partial(_fwd_kernel, block=block, scale=1.0 / math.sqrt(d),
                             precision=_precision(q.dtype))
  q_spec = pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, l, None, d), lambda bi, hi, i: (bi, 0, lax.div(hi, g), 0))
  return pl.pallas_call(
      kernel, grid=(b, h, nb),
      in_specs=lists + [q_spec, kv_spec, kv_spec,
                        pl.BlockSpec((None, block), lambda bi, hi, i: (bi, i)), row, row],
      out_specs=[q_spec, pl.BlockSpec((None, None, block), lambda bi, hi, i: (bi, hi, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, l), jnp.float32)],
      compiler_params=_params(interpret, d), interpret=interpret, name=KERNEL_NAMES[0],
  )(kv_list, kv_count, q, k, v, node, node, end)


def _gpu_backward(q, k, v, node, end, out, lse, do, *, block, interpret):
  kv_list, kv_count, q_list, q_count = block_lists(node, end, block)
  b, l, h, d = q.shape
  hk = k.shape[2]
  g, nb = h // hk, l // block
  scale, precision = 1.0 / math.sqrt(d), _precision(q.dtype)
  delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), do.astype(jnp.float32))
  list_specs, row = _common_specs(l, block)
  q_spec = pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, l, None, d), lambda bi, hi, i: (bi, 0, lax.div(hi, g), 0))
  stat_spec = pl.BlockSpec((None, None, block), lambda bi, hi, i: (bi, hi, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block=block, scale=scale, precision=precision),
      grid=(b, h, nb),
      in_specs=list_specs + [q_spec, kv_spec, kv_spec,
                             pl.BlockSpec((None, block), lambda bi, hi, i: (bi, i)), row, row,
                             q_spec, stat_spec, stat_spec],
      out_specs=q_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(interpret, d), interpret=interpret, name=KERNEL_NAMES[1],
  )(kv_list, kv_count, q, k, v, node, node, end, do, lse, delta)

  # dk, dv: grid over kv heads; q, do and the statistics of the G heads sharing one.
  qg = q.reshape(b, l, hk, g, d)
  dog = do.reshape(b, l, hk, g, d)
  lse_g, delta_g = lse.reshape(b, hk, g, l), delta.reshape(b, hk, g, l)
  qg_spec = pl.BlockSpec((None, l, None, g, d), lambda bi, hi, i: (bi, 0, hi, 0, 0))
  kb_spec = pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0))
  stat_g = pl.BlockSpec((None, None, g, l), lambda bi, hi, i: (bi, hi, 0, 0))
  blk = pl.BlockSpec((None, block), lambda bi, hi, i: (bi, i))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block=block, groups=g, scale=scale, precision=precision),
      grid=(b, hk, nb),
      in_specs=list_specs + [qg_spec, kb_spec, kb_spec, row, blk, blk, qg_spec, stat_g, stat_g],
      out_specs=[kb_spec, kb_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(interpret, d), interpret=interpret, name=KERNEL_NAMES[2],
  )(q_list, q_count, qg, k, v, node, node, end, dog, lse_g, delta_g)
  return dq, dk, dv


# ------------------------------------------------------------------- dispatch


def _pad_tokens(x, pad: int, axis: int, value=0):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _tpu_geometry(l: int, block: int, max_kv_blocks: int) -> tuple[int, int, int]:
  """(TPU block, token padding, bound): Mosaic wants a key-side row block of a multiple of
  128 lanes, so the block is rounded up to one and L padded to a multiple of it; a bound
  fitted for another block size no longer applies (0: every causal pair)."""
  tb = -(-block // 128) * 128
  return tb, -l % tb, max_kv_blocks if tb == block else 0


def _tpu_forward(q, k, v, node, end, *, block, max_kv_blocks, interpret):
  l = q.shape[1]
  tb, pad, bound = _tpu_geometry(l, block, max_kv_blocks)
  if pad:
    q, k, v = (_pad_tokens(x, pad, 1) for x in (q, k, v))
    node, end = _pad_tokens(node, pad, 1, -1), _pad_tokens(end, pad, 1, -1)
  out, lse = pallas_attention_tpu.forward(q, k, v, node, end, block=tb, max_kv_blocks=bound,
                                          interpret=interpret)
  return out[:, :l], lse[..., :l]


def _tpu_backward(q, k, v, node, end, out, lse, do, *, block, max_kv_blocks, interpret):
  l = q.shape[1]
  tb, pad, bound = _tpu_geometry(l, block, max_kv_blocks)
  if pad:
    q, k, v, out, do = (_pad_tokens(x, pad, 1) for x in (q, k, v, out, do))
    node, end = _pad_tokens(node, pad, 1, -1), _pad_tokens(end, pad, 1, -1)
    lse = _pad_tokens(lse, pad, 2)
  grads = pallas_attention_tpu.backward(q, k, v, node, end, out, lse, do, block=tb,
                                        max_kv_blocks=bound, interpret=interpret)
  return tuple(x[:, :l] for x in grads)


def _dispatch(gpu, tpu, backend, *args):
  if backend == "gpu":
    return gpu(*args)
  if backend == "tpu":
    return tpu(*args)
  # The platform is chosen when the program is lowered (jax.export for CUDA or TPU too).
  return lax.platform_dependent(*args, tpu=tpu, default=gpu)


def _forward(q, k, v, node, end, block, backend, max_kv_blocks, interpret):
  gpu = functools.partial(_gpu_forward, block=block, interpret=interpret)
  tpu = functools.partial(_tpu_forward, block=block, max_kv_blocks=max_kv_blocks,
                          interpret=interpret)
  return _dispatch(gpu, tpu, backend, q, k, v, node, end)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attend(q, k, v, node, end, block, backend, max_kv_blocks, interpret):
  return _forward(q, k, v, node, end, block, backend, max_kv_blocks, interpret)[0]


def _attend_fwd(q, k, v, node, end, block, backend, max_kv_blocks, interpret):
  out, lse = _forward(q, k, v, node, end, block, backend, max_kv_blocks, interpret)
  return out, (q, k, v, node, end, out, lse)


def _attend_bwd(block, backend, max_kv_blocks, interpret, res, do):
  q, k, v, node, end, out, lse = res
  gpu = functools.partial(_gpu_backward, block=block, interpret=interpret)
  tpu = functools.partial(_tpu_backward, block=block, max_kv_blocks=max_kv_blocks,
                          interpret=interpret)
  dq, dk, dv = _dispatch(gpu, tpu, backend, q, k, v, node, end, out, lse, do)
  zero = lambda x: jnp.zeros(x.shape, jax.dtypes.float0)
  return dq, dk, dv, zero(node), zero(end)


_attend.defvjp(_attend_fwd, _attend_bwd)


BACKENDS = ("auto", "gpu", "tpu")


def pallas_tree_attention(
    q: Float[Array, "B L H Dh"], k: Float[Array, "B L Hk Dh"], v: Float[Array, "B L Hk Dh"],
    node_of_token: Int[Array, "B L"], subtree_end: Int[Array, "B N"], block: int,
    interpret: bool = False, backend: str = "auto", max_kv_blocks: int = 0,
) -> Float[Array, "B L H Dh"]:
  """Tree attention of a depth-first packed batch, fused (differentiable in q, k, v).

  Equals `tree_rl.models.attention.dense_attention` (a query with no visible key
  gives 0). L must be a multiple of `block` (a power of two >= 16, Triton's smallest
  dot); a head dim that is not a power of two is zero-padded to one for the kernels.

  backend: "gpu" (Triton), "tpu" (Mosaic, `pallas_attention_tpu`) or "auto": chosen
  when the program is lowered (`lax.platform_dependent`: TPU on a TPU, Triton else).
  max_kv_blocks: the TPU kernels' static pair bound (`pallas_attention_tpu`; 0: every
  causal pair); the GPU kernels need none.
  """
  b, l, h, d = q.shape
  if l % block:
    raise ValueError(f"packed length L={l} must be a multiple of the attention block {block}")
  if block < 16 or block & (block - 1):
    raise ValueError(f"pallas attention block={block} must be a power of two >= 16")
  if h % k.shape[2]:
    raise ValueError(f"{h} query heads do not split into {k.shape[2]} kv heads")
  if backend not in BACKENDS:
    raise ValueError(f"pallas attention backend={backend!r}; choose one of {BACKENDS}")
  pad = (1 << max(d - 1, 0).bit_length()) - d  # to a power of two (Triton block shapes)
  if pad:
    widen = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad)))
    # The kernel scales by 1/sqrt(its head dim): pre-scale q so the scores are unchanged.
    q = widen(q * jnp.asarray(math.sqrt((d + pad) / d), q.dtype))
    k, v = widen(k), widen(v)
  node, end = token_vectors(node_of_token, subtree_end)
  out = _attend(q, k, v, node, end, block, backend, max_kv_blocks, interpret)
  return out[..., :d] if pad else out
