"""Supervised fine-tuning on trees: the warm start every paper begins RL from.

The loss is the mean negative log-likelihood of the policy tokens of the packed
trees (`loss_mask`): prompt and env tokens (tool replies, template glue) are
context only, exactly as in the RL loss.

A step whose loss, gradient norm or new parameters are not finite (an update that made a
weight NaN or inf) is skipped, as the RL update step skips one: the state before it is kept
and `sft/skipped` is 1 (the SFT loop warns and counts them, `phases.sft_warm_start`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tree_rl.algos.ppo import TrainState, _global_norm
from tree_rl.models.attention import OVERFLOW_METRIC, TreeMask, attention_overflow
from tree_rl.models.logprobs import tree_logprobs
from tree_rl.tree import derived
from tree_rl.tree.batch import TreeBatch


def make_sft_step(optimizer: optax.GradientTransformation, logprob_chunk: int = 512):
  """`sft_step(state, batch) -> (state, metrics)`; jit it with the state donated.

  A step with a non-finite loss, gradient norm or new parameter returns the state it was
  given (parameters and optimizer state) with metrics["sft/skipped"] = 1.
  """

  def sft_step(state: TrainState, batch: TreeBatch):
    mask = batch.loss_mask.astype(jnp.float32)

    def loss_fn(params):
      lp, _ = tree_logprobs(state.model(params), batch, chunk=logprob_chunk, policy_only=True)
      return -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"sft/loss": loss, "sft/l2_grads": optax.global_norm(grads),
               "sft/l2_params": _global_norm(params), "sft/tokens": mask.sum()}
    # Blockwise attention's backstop, read by the host after the step (raise_on_overflow).
    tree = TreeMask(batch.node_of_token, derived.structure(batch).ancestor)
    metrics[OVERFLOW_METRIC] = attention_overflow(tree, state.model(params).attention_config)
    # Non-finite: the step is skipped whole, the state before it kept.
    finite = (jnp.isfinite(loss) & jnp.isfinite(metrics["sft/l2_grads"])
              & jnp.isfinite(metrics["sft/l2_params"]))
    metrics["sft/skipped"] = (~finite).astype(jnp.float32)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return state.replace(params=jax.tree.map(keep, params, state.params),
                         opt_state=jax.tree.map(keep, opt_state, state.opt_state)), metrics

  return sft_step


def jit_sft_step(optimizer: optax.GradientTransformation, logprob_chunk: int = 512,
                 state_shardings=None, batch_shardings=None):
  """`sft_step` under jit with the state donated; with shardings (`tree_rl.placement`) the
  state keeps its layout in and out and the batch's trees split over the mesh."""
  kw = {}
  if state_shardings is not None:
    kw = dict(in_shardings=(state_shardings, batch_shardings),
              out_shardings=(state_shardings, None))
  return jax.jit(make_sft_step(optimizer, logprob_chunk), donate_argnums=0, **kw)


def order_by_system_prompt(tasks: list, n: int) -> list:
  """`tasks` reordered so that consecutive runs of `n` share a system prompt where they can
  (SFT merges a step's trajectories below their shared prompt prefix) while successive
  runs rotate through the prompts: each prompt's tasks are cut into runs of `n`, and the
  runs are interleaved round-robin (prompts in order of first appearance)."""
  groups: dict[str, list] = {}
  for t in tasks:
    first = t.messages[0] if t.messages else {}
    groups.setdefault(first.get("content", "") if first.get("role") == "system" else "", []
                      ).append(t)
  runs = [[g[i:i + n] for i in range(0, len(g), n)] for g in groups.values()]
  return [t for k in range(max(map(len, runs))) for g in runs if k < len(g) for t in g[k]]
