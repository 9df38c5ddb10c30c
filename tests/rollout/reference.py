"""The engines' oracle in tests: tree_rl's own decoder, full forward passes padded to a
fixed length (one compile per length), for greedy decoding and per-token log-probs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tree_rl.models.attention import TreeMask
from tree_rl.models.logprobs import sequence_logprobs


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ref_logits(pad, graphdef, state, tokens, valid):
  model = nnx.merge(graphdef, state)
  return model.logits(tokens, jnp.arange(pad)[None], TreeMask.causal(valid))


@functools.partial(jax.jit, static_argnums=0)
def _ref_logprobs(graphdef, state, tokens, valid):
  return sequence_logprobs(nnx.merge(graphdef, state), tokens, valid)


def _padded(seq, pad):
  if len(seq) > pad:
    raise ValueError(f"{len(seq)} tokens do not fit the reference length {pad}")
  x = np.zeros((1, pad), np.int32)
  x[0, :len(seq)] = seq
  return jnp.asarray(x), jnp.asarray(np.arange(pad)[None] < len(seq))


def argmax_decode(model, ctx, n, pad=64):
  """Greedy decoding by recomputing the full forward pass at every step."""
  graphdef, state = nnx.split(model)
  seq = list(ctx)
  for _ in range(n):
    logits = _ref_logits(pad, graphdef, state, *_padded(seq, pad))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return tuple(seq[len(ctx):])


def policy_logprobs(model, ctx, gen, pad=64):
  """(log-probs, entropies) of `gen` after `ctx` under `model`."""
  graphdef, state = nnx.split(model)
  lp, ent = _ref_logprobs(graphdef, state, *_padded(tuple(ctx) + tuple(gen), pad))
  n = len(ctx) + len(gen)
  return np.asarray(lp[0, len(ctx):n]), np.asarray(ent[0, len(ctx):n])


def log_distributions(model, ctx, gen, pad=64):
  """`[len(gen), V]` log-softmax of the logits that predict each token of `gen`."""
  graphdef, state = nnx.split(model)
  logits = _ref_logits(pad, graphdef, state, *_padded(tuple(ctx) + tuple(gen), pad))
  n = len(ctx)
  return np.asarray(jax.nn.log_softmax(logits[0, n - 1:n - 1 + len(gen)], axis=-1))
