"""The shared update step: PPO epochs x minibatches over packed trees, one jit.

    state, metrics = update_step(state, batch, rng)

`make_update_step(config, optimizer)` returns the pure function; the trainer
jits it once per shape bucket with the state donated (`jit_update_step`).
Inside, `lax.scan` runs `num_epochs x num_minibatches` optimizer steps over
minibatches of whole trees (a tree is never split: its advantages and
per-token weights are defined over all its leaves). Methods differ only in
the advantages and the loss settings: advantages come in precomputed, or as a
registered estimator name; estimators that read the current policy (APPO's
future value uses pi_theta of the minibatch, arXiv 2606.12384 §3.2, Eq. 4) run inside each
minibatch on stop-gradient log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from tree_rl.algos import registry
from tree_rl.algos.losses import LossConfig, policy_loss
from tree_rl.algos.registry import Advantages
from tree_rl.models.decoder import Decoder, LoRAParam
from tree_rl.models.attention import OVERFLOW_METRIC, TreeMask, attention_overflow
from tree_rl.models.logprobs import tree_logprobs
from tree_rl.tree import derived
from tree_rl.tree.batch import TreeBatch


@dataclasses.dataclass(frozen=True)
class PPOConfig:
  loss: LossConfig = LossConfig()
  estimator: str | None = "grpo"  # None: advantages are passed to update_step
  estimator_config: Any = None  # the estimator's config (paper defaults when None)
  num_epochs: int = 1
  num_minibatches: int = 1
  logprob_chunk: int = 512  # packed tokens per vocabulary-projection chunk

  def __post_init__(self):
    if self.estimator is not None:
      registry.get(self.estimator)  # fails listing the registered names
    if self.num_epochs < 1 or self.num_minibatches < 1:
      raise ValueError(f"num_epochs={self.num_epochs} and num_minibatches="
                       f"{self.num_minibatches} must be >= 1")


@flax.struct.dataclass
class TrainState:
  """Everything the update step changes, as one donated pytree.

  `params` are the optimised variables (LoRA adapters when LoRA is on, all
  nnx.Params otherwise); `frozen` the rest of the model; `ref` the reference
  policy's params for a KL penalty (None without one).
  """

  graphdef: Any = flax.struct.field(pytree_node=False)
  params: Any
  frozen: Any
  opt_state: Any
  step: Any  # int32 scalar (Any: sharding trees mirror this struct)
  ref: Any = None

  def model(self, params=None) -> Decoder:
    return nnx.merge(self.graphdef, self.params if params is None else params, self.frozen)


def trainable_filter(model: Decoder):
  return LoRAParam if model.lora is not None else nnx.Param


def init_state(model: Decoder, optimizer: optax.GradientTransformation, with_ref: bool = False
               ) -> TrainState:
  graphdef, params, frozen = nnx.split(model, trainable_filter(model), ...)
  ref = None
  if with_ref:  # LoRA: the reference is the base model (adapters zeroed); else a copy
    ref = jax.tree.map(lambda x: x if model.lora is None else jnp.zeros_like(x), params)
  return TrainState(graphdef=graphdef, params=params, frozen=frozen,
                    opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32), ref=ref)


def _take_trees(batch: TreeBatch, idx: jax.Array) -> TreeBatch:
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)


def _global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def advantages_per_minibatch(config: PPOConfig) -> bool:
  """True when the estimator reads the current policy (APPO: log-probs and entropies), so
  that `update_step` computes each mini-batch's advantages from that mini-batch alone, with
  the policy of the moment (no statistic spans the mini-batches)."""
  return config.estimator is not None and bool(registry.get(config.estimator).inputs)


def make_update_step(config: PPOConfig, optimizer: optax.GradientTransformation):
  """The pure `update_step(state, batch, rng, advantages=None) -> (state, metrics)`."""
  entry = registry.get(config.estimator) if config.estimator is not None else None
  est_config = None
  if entry is not None:
    est_config = config.estimator_config or entry.config_cls()
  policy_inputs = entry is not None and bool(entry.inputs)

  def advantages_for(batch, logp=None, entropy=None) -> Advantages:
    inputs = {}
    if "logp" in entry.inputs:
      inputs["logp"] = logp
    if "entropy" in entry.inputs:
      inputs["entropy"] = entropy
    return entry.fn(batch, est_config, **inputs)

  def loss_fn(params, state: TrainState, mb: TreeBatch, adv: Advantages | None):
    model = state.model(params)
    st = derived.structure(mb)
    logp, ent = tree_logprobs(model, mb, st, chunk=config.logprob_chunk, policy_only=True)
    if adv is None:  # policy-dependent estimator (APPO): current policy, no gradient
      adv = advantages_for(mb, lax.stop_gradient(logp), lax.stop_gradient(ent))
    ref_logp = None
    if config.loss.kl_coef > 0:
      ref_logp, _ = tree_logprobs(state.model(state.ref), mb, st, chunk=config.logprob_chunk,
                                  policy_only=True)
      ref_logp = lax.stop_gradient(ref_logp)
    loss, metrics = policy_loss(logp, mb, adv, config.loss, ref_logp=ref_logp, entropy=ent, st=st)
    metrics = dict(metrics, loss=loss, **{f"adv/{k}": v for k, v in adv.metrics.items()})
    return loss, metrics

  def update_step(state: TrainState, batch: TreeBatch, rng: jax.Array,
                  advantages: Advantages | None = None):
    b = batch.tokens.shape[0]
    nmb = config.num_minibatches
    if b % nmb:
      raise ValueError(f"{b} trees do not split into num_minibatches={nmb}")
    if advantages is None and entry is None:
      raise ValueError("PPOConfig.estimator is None: pass advantages to update_step")
    if advantages is None and not policy_inputs:
      advantages = advantages_for(batch)  # once, over the whole batch (group statistics)
    rng = jax.random.fold_in(rng, state.step)
    perms = jax.vmap(lambda k: jax.random.permutation(k, b))(
        jax.random.split(rng, config.num_epochs)).reshape(config.num_epochs * nmb, b // nmb)

    def one(state: TrainState, idx):
      mb = _take_trees(batch, idx)
      adv = None if advantages is None else jax.tree.map(lambda x: jnp.take(x, idx, axis=0)
                                                         if x.ndim and x.shape[0] == b else x,
                                                         advantages)
      grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params, state, mb, adv)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics.update(l2_grads=_global_norm(grads), l2_updates=_global_norm(updates),
                     l2_params=_global_norm(params))
      return state.replace(params=params, opt_state=opt_state), metrics

    new, metrics = lax.scan(one, state, perms)
    # Blockwise attention's backstop, read by the host after the step (raise_on_overflow).
    st = derived.structure(batch)
    overflow = attention_overflow(TreeMask(batch.node_of_token, st.ancestor),
                                  state.model(state.params).attention_config)
    # A step with a non-finite loss, gradient norm or parameter (an update that made a weight
    # NaN or inf) in any mini-batch is skipped whole: the pre-step state is kept (`skipped`
    # = 1; the trainer counts and bounds them).
    finite = (jnp.all(jnp.isfinite(metrics["loss"])) & jnp.all(jnp.isfinite(metrics["l2_grads"]))
              & jnp.all(jnp.isfinite(metrics["l2_params"])))
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["skipped"] = (~finite).astype(jnp.float32)
    metrics[OVERFLOW_METRIC] = overflow
    keep = lambda n, o: jnp.where(finite, n, o)
    state = state.replace(params=jax.tree.map(keep, new.params, state.params),
                          opt_state=jax.tree.map(keep, new.opt_state, state.opt_state))
    return state.replace(step=state.step + 1), metrics

  return update_step


def jit_update_step(config: PPOConfig, optimizer: optax.GradientTransformation,
                    state_shardings=None, batch_shardings=None):
  """`update_step` under jit with the state donated (one compile per bucket)."""
  fn = make_update_step(config, optimizer)
  kw = {}
  if state_shardings is not None:
    kw = dict(in_shardings=(state_shardings, batch_shardings, None),
              out_shardings=(state_shardings, None))
  return jax.jit(fn, donate_argnums=0, **kw)
