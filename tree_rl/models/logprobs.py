"""Per-token log-probs and entropies of a decoder on a packed tree.

Token t is scored from the hidden state of the token before it in its own
sequence (`derived.prev_token_index`): inside a node that is t - 1, at a
node's first token it is the parent's last token. The vocabulary projection
runs in chunks of packed tokens under `jax.checkpoint`, so the `[B, L, V]`
logits are never materialised (V = 49k-152k makes them the largest tensor of
the step). With blockwise attention, an eager call checks the model's static
key-block bound against the batch (`check_attention_bound`: raises if too small);
under jit the steps return the same test as a device-side count
(`tree_rl.models.attention.attention_overflow`) that the host reads after the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tree_rl.models.attention import TreeMask, check_attention_bound
from tree_rl.models.decoder import Decoder
from tree_rl.tree import derived
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.types import Array, Float, Int


def chunked_logprobs(
    h: Float[Array, "B L D"], head: Float[Array, "D V"], targets: Int[Array, "B L"], chunk: int
) -> tuple[Float[Array, "B L"], Float[Array, "B L"]]:
  """log softmax(h @ head)[target] and the entropy, `chunk` tokens at a time."""
  b, l, d = h.shape
  chunk = min(chunk, l)
  pad = -l % chunk
  hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  tp = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (l + pad) // chunk
  hs = jnp.moveaxis(hp.reshape(b, n, chunk, d), 1, 0)
  ts = jnp.moveaxis(tp.reshape(b, n, chunk), 1, 0)

  @jax.checkpoint
  def one(args):
    hc, tc = args
    logits = jnp.einsum("bcd,dv->bcv", hc, head.astype(hc.dtype),
                        preferred_element_type=jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, jnp.maximum(tc, 0)[..., None], axis=-1)[..., 0]
    p = jnp.exp(logits - logz[..., None])
    ent = logz - (p * logits).sum(-1)
    return tgt - logz, ent

  lp, ent = lax.map(one, (hs, ts))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :l]
  return unchunk(lp), unchunk(ent)


def tree_logprobs(
    model: Decoder, batch: TreeBatch, st: derived.TreeStructure | None = None, chunk: int = 512,
    policy_only: bool = False,
) -> tuple[Float[Array, "B L"], Float[Array, "B L"]]:
  """`[B, L]` log-probs and entropies of every packed token given its context.

  0 where a token has no context (the root's first token) and on padding.
  `policy_only`: score the policy tokens only (0 elsewhere), which is all a loss
  reads. With `batch.max_loss_tokens` known, the vocabulary projection then runs
  on that many gathered tokens per row instead of all L (prompts and tool replies
  are most of a tool-use tree).
  """
  st = derived.structure(batch) if st is None else st
  tree = TreeMask(batch.node_of_token, st.ancestor)
  check_attention_bound(tree, model.attention_config)
  h = model.hidden(batch.tokens, batch.positions, tree)
  prev = derived.prev_token_index(batch)
  ok = prev >= 0
  p, l = batch.max_loss_tokens, batch.tokens.shape[1]
  if not (policy_only and 0 < p < l):
    h_prev = jnp.take_along_axis(h, jnp.maximum(prev, 0)[..., None], axis=1)
    lp, ent = chunked_logprobs(h_prev, model.head(), batch.tokens, chunk)
    if policy_only:
      ok = ok & batch.loss_mask
    return jnp.where(ok, lp, 0.0), jnp.where(ok, ent, 0.0)
  # Each row's policy tokens first, in order (a stable sort), then the first p.
  idx = jnp.argsort((~batch.loss_mask).astype(jnp.int32), axis=1, stable=True)[:, :p]
  take = lambda x: jnp.take_along_axis(x, idx, axis=1)
  h_sel = jnp.take_along_axis(h, jnp.maximum(take(prev), 0)[..., None], axis=1)
  lp, ent = chunked_logprobs(h_sel, model.head(), take(batch.tokens), chunk)
  keep = take(ok & batch.loss_mask)
  scatter = jax.vmap(lambda x, i: jnp.zeros((l,), x.dtype).at[i].set(x))
  return scatter(jnp.where(keep, lp, 0.0), idx), scatter(jnp.where(keep, ent, 0.0), idx)


def sequence_logprobs(
    model: Decoder, tokens: Int[Array, "B T"], valid: Array, chunk: int = 512
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  """Plain causal sequences: log p(tokens[t] | tokens[:t]) for t >= 1 (0 at t = 0)."""
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
  tree = TreeMask.causal(valid)
  check_attention_bound(tree, model.attention_config)
  h = model.hidden(tokens, positions, tree)
  h_prev = jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))
  lp, ent = chunked_logprobs(h_prev, model.head(), tokens, chunk)
  ok = valid & (jnp.arange(tokens.shape[1])[None, :] > 0)
  return jnp.where(ok, lp, 0.0), jnp.where(ok, ent, 0.0)
