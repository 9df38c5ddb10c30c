"""Tree attention: token i sees token j iff node(j) is an ancestor-or-self of
node(i) and j <= i (the packed layout of `tree_rl.tree.batch`), so one forward
pass over a packed tree gives every root-to-leaf sequence its own causal context.

Three implementations with identical results:

* `dense`: the `[L, L]` mask. Simple and fastest for short trees, but its cost
  grows with L^2 including every cross-branch pair that is masked out.
* `blockwise`: queries and keys are cut into blocks of `block` packed tokens;
  only the (query block, key block) pairs with at least one visible token pair
  are computed, nb pairs per scan step (a row has nb * `max_kv_blocks` pair
  slots, a static bound computed on the host by `max_visible_blocks`), with an
  online softmax (flash-attention style) and a rematerialised step, so compute
  and memory follow the visible pairs (about L x path length) instead of L^2.
* `pallas`: the same visible-pairs-only online softmax as one fused kernel per
  pass, forward and backward (`tree_rl.models.pallas_attention`), for GPUs. It
  needs no static bound: each query block loops over its own visible key blocks.
  On a CPU it runs only in Pallas' interpret mode (tests).

Blockwise's static bound must hold every visible pair of the batch, or pairs would
be dropped. So every caller fits it to each batch on the host (`fit_attention`;
`AttentionFitter` keeps one model graph, hence one compile, per bound), and a
bound that is still too small is never silently wrong: `blockwise_attention`
returns NaN for such a batch, and the jitted steps return `attention_overflow`, a
device-side count the host reads after the step (`raise_on_overflow` raises
naming the batch shape and the needed and given bounds).

A plain causal batch is the special case of one node per row
(`TreeMask.causal`).
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from tree_rl.models.pallas_attention import pallas_tree_attention
from tree_rl.tree.batch import max_visible_blocks
from tree_rl.tree.types import Array, Bool, Float, Int

ATTENTION_IMPLS = ("dense", "blockwise", "pallas")
_NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


@flax.struct.dataclass
class TreeMask:
  """What attention needs to know about the tree: token ownership and ancestry."""

  node_of_token: Int[Array, "B L"]  # -1 on padding
  ancestor: Bool[Array, "B N N"]  # [b, n, m]: m is an ancestor-or-self of n

  @staticmethod
  def causal(valid: Bool[Array, "B L"]) -> "TreeMask":
    """One node per row: ordinary causal attention over the valid tokens."""
    b = valid.shape[0]
    return TreeMask(jnp.where(valid, 0, -1).astype(jnp.int32), jnp.ones((b, 1, 1), bool))

  def query_rows(self) -> Bool[Array, "B L N"]:
    """[b, i, m]: node m is visible from token i (False on padding)."""
    node = jnp.maximum(self.node_of_token, 0)
    rows = jnp.take_along_axis(self.ancestor, node[:, :, None], axis=1)
    return rows & (self.node_of_token >= 0)[:, :, None]

  def subtree_end(self) -> Int[Array, "B N"]:
    """[b, m]: one past m's last descendant. In the depth-first packed layout m's
    subtree is the node range [m, subtree_end[m]), so its size is the number of nodes
    m is an ancestor-or-self of (padding nodes: an empty range)."""
    n = self.ancestor.shape[1]
    return (jnp.arange(n) + self.ancestor.sum(1)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  impl: str = "dense"
  block: int = 128
  # blockwise only: static bound on a row's visible (query block, key block) pairs per
  # query block, i.e. nb * max_kv_blocks pair slots per row (see max_visible_blocks);
  # callers refit it to each batch (fit_attention, AttentionFitter).
  max_kv_blocks: int = 0
  # pallas: max_kv_blocks > 0 bounds the TPU kernels' pair slots (fitted per batch like
  # blockwise's); 0 (GPUs, whose kernels loop over each block's own pairs) is every pair.
  # interpret: run the kernels in Pallas' interpret mode; None: iff JAX's default backend
  # is the CPU (tests). Lowering for a GPU or TPU from a CPU host (jax.export) sets False.
  interpret: bool | None = None

  def __post_init__(self):
    if self.impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention impl={self.impl!r}; choose one of {ATTENTION_IMPLS}")
    if self.impl == "blockwise" and self.max_kv_blocks < 1:
      raise ValueError("blockwise attention needs max_kv_blocks >= 1 (see max_visible_blocks)")

  @property
  def bounded(self) -> bool:
    """Whether a static key-block bound is fitted to each batch (`fit_attention`)."""
    return self.impl == "blockwise" or (self.impl == "pallas" and self.max_kv_blocks > 0)


def _visible(rows: Bool[Array, "B Lq N"], key_node: Int[Array, "B Lk"]) -> Bool[Array, "B Lq Lk"]:
  """rows[b, i, node(j)] for every key j; False where node(j) is -1."""
  safe = jnp.maximum(key_node, 0)
  vis = jnp.take_along_axis(rows, jnp.broadcast_to(safe[:, None, :], rows.shape[:2] + safe.shape[1:]),
                            axis=2)
  return vis & (key_node >= 0)[:, None, :]


def _grouped(q: Float[Array, "B L H Dh"], num_kv: int):
  b, l, h, d = q.shape
  return q.reshape(b, l, num_kv, h // num_kv, d)


def dense_attention(
    q: Float[Array, "B L H Dh"], k: Float[Array, "B L Hk Dh"], v: Float[Array, "B L Hk Dh"],
    tree: TreeMask,
) -> Float[Array, "B L H Dh"]:
  """Softmax attention under the full `[L, L]` tree mask (GQA by head groups)."""
  l = q.shape[1]
  mask = _visible(tree.query_rows(), tree.node_of_token)
  mask &= jnp.arange(l)[None, :, None] >= jnp.arange(l)[None, None, :]
  qg = _grouped(q, k.shape[2])
  s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(q.shape[-1])
  s = jnp.where(mask[:, None, None], s, _NEG)
  p = jax.nn.softmax(s, axis=-1)
  p = jnp.where(mask[:, None, None], p, 0.0)  # rows with no visible key -> 0
  out = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v)
  return out.reshape(q.shape)


def _visible_blocks(tree: TreeMask, block: int) -> Bool[Array, "B Q K"]:
  """[b, qb, kb]: key block kb <= qb holds a token visible from some token of query block qb
  (a token of an ancestor-or-self node of one of qb's tokens)."""
  b, l = tree.node_of_token.shape
  nb, n = l // block, tree.ancestor.shape[1]
  node = tree.node_of_token.reshape(b, nb, block)
  present = (jax.nn.one_hot(node, n, dtype=jnp.float32)).max(2)  # [B, nb, N]; -1 -> none
  anc = tree.ancestor.astype(jnp.float32)
  vis = jnp.einsum("bqn,bnm,bkm->bqk", present, anc, present) > 0
  return vis & (jnp.arange(nb)[None, :, None] >= jnp.arange(nb)[None, None, :])


def kv_block_pairs(tree: TreeMask, block: int, max_kv_blocks: int
                   ) -> tuple[Int[Array, "B P"], Int[Array, "B P"], Bool[Array, ""]]:
  """Every visible (query block, key block) pair of each row, in row-major order.

  P = nb * max_kv_blocks pair slots per row (nb = L / block): the static bound is
  on the mean number of visible key blocks per query block, so short-context query
  blocks do not pay for the longest one. Returns the query and key block of each
  slot (-1 on unused slots) and whether some row has more pairs than slots (then the
  bound was too small and results would be wrong: callers must check it).
  """
  vis = _visible_blocks(tree, block)
  b, nb, _ = vis.shape
  slots = nb * max_kv_blocks
  flat = vis.reshape(b, nb * nb)
  overflow = flat.sum(-1).max() > slots
  (idx,) = jax.vmap(lambda v: jnp.nonzero(v, size=slots, fill_value=-1))(flat)
  q_blk = jnp.where(idx >= 0, idx // nb, -1)
  k_blk = jnp.where(idx >= 0, idx % nb, -1)
  return q_blk.astype(jnp.int32), k_blk.astype(jnp.int32), overflow


# Static bounds blockwise attention is fitted to: the smallest one that holds a batch's
# visible pairs is used, so a run compiles once per (token bucket, bound) while a step
# computes little more than the visible pairs.
KV_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def fit_attention(config: AttentionConfig, node_of_token: np.ndarray, parent: np.ndarray,
                  subtree_end: np.ndarray | None = None) -> AttentionConfig:
  """`config` with the tightest `KV_LADDER` bound that holds a packed batch (host, exact).

  node_of_token `[B, L]` and parent `[B, N]` as in TreeBatch. The bound is at least
  `max_visible_blocks` (so no pair is dropped) and at most nb = L / block (every
  block: `blockwise_attention` caps it there anyway). Unbounded configs (dense, Pallas
  on a GPU) are returned as is.
  """
  if not config.bounded:
    return config
  l = node_of_token.shape[1]
  _check_length(config, l)
  return fit_bound(config, l, max_visible_blocks(node_of_token, parent, config.block,
                                                 subtree_end))


def fit_bound(config: AttentionConfig, length: int, need: int) -> AttentionConfig:
  """`config` (bounded) with the tightest `KV_LADDER` bound of at least `need` blocks (a
  batch's `max_visible_blocks`), at most nb = length / block."""
  _check_length(config, length)
  bound = next((m for m in KV_LADDER if m >= need), need)
  return dataclasses.replace(config, max_kv_blocks=min(bound, length // config.block))


def _check_length(config: AttentionConfig, length: int) -> None:
  if length % config.block:
    raise ValueError(f"packed length L={length} must be a multiple of the attention block "
                     f"{config.block}")


class AttentionFitter:
  """The graph of a model with blockwise attention fitted to each batch's bound.

  The bound is static (it sets the attention scan's length), so it lives in the
  model's graph (`model.attention_config`): `graphdef(batch)` gives the graphdef
  for the batch's bound, one cached graphdef per distinct bound, so a jit that
  takes it as static compiles once per (shape, bound). The graphdef fits the
  model's state whatever filters split it (`nnx.merge(fitter.graphdef(batch), *states)`).
  Only shapes are kept, not the weights.

  The bound of a batch shape [B, L] only grows: a batch gets the largest bound fitted
  so far at its shape when that holds it (else its own `fit_attention` bound, which then
  becomes the shape's). A bound above the need adds only empty pair slots, whose
  masked terms are exact zeros, so the values and gradients are bitwise those of the
  tight bound (tests/algos/ppo_test.py), and a shape whose trees' bounds wobble compiles
  once instead of once per bound (a 30-layer update step: ~6 s on a CPU).
  """

  def __init__(self, model: nnx.Module):
    self.base: AttentionConfig = model.attention_config
    graphdef, state = nnx.split(model)
    self._graphdef = graphdef
    self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    self.graphs = {self.base: graphdef}
    self.bounds: dict[tuple[int, ...], int] = {}  # the largest bound fitted per [B, L]

  def config(self, batch, kv_blocks: int = 0) -> AttentionConfig:
    """The attention config of a TreeBatch: its `fit_attention` bound, or the larger one
    its shape already has. `kv_blocks`: the batch's `max_visible_blocks` at this model's
    block when the caller has it (`tree.batch.pack_sound` computes it on the host);
    without it (0) the bound is computed from the batch's arrays, read to the host."""
    if not self.base.bounded:
      return self.base
    if kv_blocks:
      fitted = fit_bound(self.base, batch.tokens.shape[1], kv_blocks)
    else:
      fitted = fit_attention(self.base, np.asarray(batch.node_of_token),
                             np.asarray(batch.parent), np.asarray(batch.subtree_end))
    shape = tuple(batch.tokens.shape)
    bound = max(fitted.max_kv_blocks, self.bounds.get(shape, 0))
    self.bounds[shape] = bound
    return dataclasses.replace(fitted, max_kv_blocks=bound)

  def graphdef(self, batch, kv_blocks: int = 0):
    """The model's graphdef with `config(batch, kv_blocks)` (cached per bound)."""
    attn = self.config(batch, kv_blocks)
    if attn not in self.graphs:
      model = nnx.merge(self._graphdef, self._abstract)
      model.attention_config = attn
      self.graphs[attn] = nnx.graphdef(model)
    return self.graphs[attn]


OVERFLOW_METRIC = "attention/overflow_pairs"


def attention_overflow(tree: TreeMask, config: AttentionConfig) -> Int[Array, ""]:
  """Device-side backstop: the most visible (query block, key block) pairs of any row
  when that is more than a blockwise bound's nb * max_kv_blocks slots hold, else 0.

  A jitted step returns it (as `OVERFLOW_METRIC`) and the host passes it to
  `raise_on_overflow` after the step, so no host callback sits in the program (one
  cannot be lowered for another platform, e.g. by `jax.export` for CUDA from a CPU).
  Constant 0, with nothing traced, unless the attention is blockwise with a bound
  below nb (a bound of nb or more holds every pair).
  """
  (_, length), block = tree.node_of_token.shape, config.block
  nb = length // block
  given = min(config.max_kv_blocks, nb)
  if config.impl != "blockwise" or given >= nb:
    return jnp.zeros((), jnp.int32)
  most = _visible_blocks(tree, block).sum((1, 2)).max().astype(jnp.int32)
  return jnp.where(most > nb * given, most, 0)


def raise_on_overflow(pairs, shape: tuple[int, int], config: AttentionConfig) -> None:
  """Host side of `attention_overflow`: raises naming the batch shape, the pairs and the
  needed and given bounds when `pairs` (read back after a step) is non-zero."""
  pairs = int(np.asarray(pairs))
  if not pairs:
    return
  (b, length), block = shape, config.block
  nb = length // block
  raise ValueError(
      f"blockwise attention: packed batch [B={b}, L={length}] has a row with {pairs} visible "
      f"(query block, key block) pairs with block {block}, which needs max_kv_blocks >= "
      f"{-(-pairs // nb)}, but the model's bound is {min(config.max_kv_blocks, nb)}; fit the "
      f"bound to each batch (tree_rl.models.attention.fit_attention / AttentionFitter)")


def check_attention_bound(tree: TreeMask, config: AttentionConfig) -> None:
  """`raise_on_overflow(attention_overflow(...))` when called eagerly (outside jit);
  under a trace it adds nothing: a jitted step returns `attention_overflow` instead
  (blockwise attention's output is NaN for such a batch either way)."""
  pairs = attention_overflow(tree, config)
  if not isinstance(pairs, jax.core.Tracer):
    raise_on_overflow(pairs, tree.node_of_token.shape, config)


def blockwise_attention(
    q: Float[Array, "B L H Dh"], k: Float[Array, "B L Hk Dh"], v: Float[Array, "B L Hk Dh"],
    tree: TreeMask, block: int, max_kv_blocks: int,
) -> Float[Array, "B L H Dh"]:
  """Tree attention over the visible (query block, key block) pairs only (online softmax).

  The pairs of a row (`kv_block_pairs`) are visited nb at a time, so each scan step
  costs what one key block per query block would; a step's pairs are folded into
  their query blocks' running max, denominator and output by scatter (a query block
  may own several pairs of a step). Cost O(visible pairs * block^2), bounded by
  O(L * max_kv_blocks * block); each scan step is rematerialised in the backward
  pass, so memory is O(L) per layer. A batch with more visible pairs than slots
  gets NaN everywhere (never a silently partial softmax); `attention_overflow`
  is the loud form of the same test.
  """
  b, l, h, d = q.shape
  hk = k.shape[2]
  if l % block:
    raise ValueError(f"packed length L={l} must be a multiple of the attention block {block}")
  nb = l // block
  g = h // hk
  # A bound above the number of blocks is just "all of them" (short buckets).
  m = min(max_kv_blocks, nb)
  q_blk, k_blk, overflow = kv_block_pairs(tree, block, m)  # [B, nb * m]
  rows = tree.query_rows().reshape(b, nb, block, -1)  # [B, nb, bq, N]
  qg = _grouped(q, hk).reshape(b, nb, block, hk, g, d)
  kb = k.reshape(b, nb, block, hk, d)
  vb = v.reshape(b, nb, block, hk, d)
  node_b = tree.node_of_token.reshape(b, nb, block)
  scale = 1.0 / math.sqrt(d)
  bi = jnp.arange(b)[:, None]

  @jax.checkpoint
  def step(carry, pair):  # pair: ([B, nb], [B, nb]) query and key block of nb slots
    acc, mx, den = carry
    qi, ki = pair
    used = qi >= 0
    qs, ks = jnp.maximum(qi, 0), jnp.maximum(ki, 0)
    qq, rq = qg[bi, qs], rows[bi, qs]  # [B, C, bq, ...]
    kk, vv, kn = kb[bi, ks], vb[bi, ks], node_b[bi, ks]  # [B, C, bk, ...]
    vis = jnp.take_along_axis(
        rq, jnp.broadcast_to(jnp.maximum(kn, 0)[:, :, None, :], (b, nb, block, block)), axis=3)
    q_pos = qs[:, :, None] * block + jnp.arange(block)
    k_pos = ks[:, :, None] * block + jnp.arange(block)
    mask = vis & (kn >= 0)[:, :, None, :] & used[:, :, None, None]
    mask &= k_pos[:, :, None, :] <= q_pos[:, :, :, None]
    s = jnp.einsum("bnqkgd,bnskd->bnkgqs", qq, kk, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, :, None, None], s, _NEG)
    new_mx = mx.at[bi, qs].max(s.max(-1))  # [B, nb, hk, g, bq]
    p = jnp.where(mask[:, :, None, None], jnp.exp(s - new_mx[bi, qs][..., None]), 0.0)
    corr = jnp.exp(mx - new_mx)
    den = (den * corr).at[bi, qs].add(p.sum(-1))
    pv = jnp.einsum("bnkgqs,bnskd->bnkgqd", p.astype(vv.dtype), vv,
                    preferred_element_type=jnp.float32)
    acc = (acc * corr[..., None]).at[bi, qs].add(pv)
    return (acc, new_mx, den), None

  init = (jnp.zeros((b, nb, hk, g, block, d), jnp.float32),
          jnp.full((b, nb, hk, g, block), _NEG, jnp.float32),
          jnp.zeros((b, nb, hk, g, block), jnp.float32))
  pairs = (q_blk.reshape(b, m, nb).swapaxes(0, 1), k_blk.reshape(b, m, nb).swapaxes(0, 1))
  (acc, _, den), _ = lax.scan(step, init, pairs)
  out = acc / jnp.maximum(den, 1e-30)[..., None]  # rows with no visible key -> 0
  out = jnp.moveaxis(out, 4, 2)  # [B, nb, bq, hk, g, d]
  out = jnp.where(overflow, jnp.nan, out)  # pairs were dropped: poison, never partial
  return out.reshape(b, l, h, d).astype(q.dtype)


def attention(q, k, v, tree: TreeMask, config: AttentionConfig):
  if config.impl == "dense":
    return dense_attention(q, k, v, tree)
  if config.impl == "pallas":
    interpret = (jax.default_backend() == "cpu" if config.interpret is None
                 else config.interpret)
    return pallas_tree_attention(q, k, v, tree.node_of_token, tree.subtree_end(), config.block,
                                 interpret=interpret, max_kv_blocks=config.max_kv_blocks)
  return blockwise_attention(q, k, v, tree, config.block, config.max_kv_blocks)


def cached_attention(
    q: Float[Array, "W T H Dh"], k_cache: Float[Array, "R Hk NB Dh B"],
    v_cache: Float[Array, "R Hk NB B Dh"], q_slot: Int[Array, "W T"],
    rows: Int[Array, "W"] | None = None,
) -> Float[Array, "W T H Dh"]:
  """Attention of new tokens over a per-row, tiled KV cache (the sampler's path).

  Work row w reads cache row rows[w] (row w without `rows`), which holds one
  linear context in slots 0..; the query at slot `q_slot[w, t]` sees slots
  0..q_slot[w, t] (its own key included, which the caller wrote before
  calling). The cache is cut into blocks of B slots (`KVCache`): block j of
  every row is `cache[:, :, j]`, its work rows are gathered, and a kv head's G
  query heads times T tokens meet it as one [G*T, Dh] x [Dh, B] product and
  one [G*T, B] x [B, Dh] product back, with an online softmax across blocks.
  Only blocks up to the highest query slot are visited: the loop's trip count
  is dynamic, so a decode step costs O(context length), not O(S).
  """
  w, t, h, d = q.shape
  hk, nb, b = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
  g = h // hk
  # [W, Hk, G*T, Dh]: query (g, t) of kv head k at index g*T + t.
  qg = _grouped(q, hk).transpose(0, 2, 3, 1, 4).reshape(w, hk, g * t, d)
  qs = jnp.broadcast_to(q_slot[:, None, :], (w, g, t)).reshape(w, 1, g * t, 1)
  scale = 1.0 / math.sqrt(d)

  def take(cache, j):  # block j of every work row: [W, Hk, Dh, B] keys, [W, Hk, B, Dh] values
    if rows is None:
      return lax.dynamic_index_in_dim(cache, j, axis=2, keepdims=False)
    return cache[rows, :, j]

  def body(j, carry):
    m, l, acc = carry
    kb, vb = take(k_cache, j), take(v_cache, j)
    sc = jnp.einsum("wkqd,wkdn->wkqn", qg, kb.astype(q.dtype),
                    preferred_element_type=jnp.float32) * scale
    mask = (j * b + jnp.arange(b))[None, None, None, :] <= qs
    sc = jnp.where(mask, sc, _NEG)
    m_new = jnp.maximum(m, sc.max(-1))
    p = jnp.where(mask, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum("wkqn,wknd->wkqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

  n_blocks = jnp.minimum(jnp.max(q_slot) // b + 1, nb)  # blocks holding slots 0..max(q_slot)
  init = (jnp.full((w, hk, g * t), _NEG, jnp.float32), jnp.zeros((w, hk, g * t), jnp.float32),
          jnp.zeros((w, hk, g * t, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, n_blocks, body, init)
  out = acc / jnp.maximum(l, 1e-30)[..., None]  # no visible key -> 0
  out = out.reshape(w, hk, g, t, d).transpose(0, 3, 1, 2, 4)
  return out.reshape(w, t, h, d).astype(q.dtype)
