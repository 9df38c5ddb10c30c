"""Policy-gradient losses on the packed tree: PPO clip with clip-higher and dual clip,
token- or sequence-level ratios, k1/k3 KL to a reference policy and an entropy bonus.

Invariant (tests/algos/losses_test.py): the loss on the packed tree, and its gradient with
respect to the per-token log-probs, equal those of the K flattened root-to-leaf sequences,
in which a token shared by several leaves is counted once per sequence through it, with
that sequence's advantage and weight. Per token t of node n(t) and sequence k through it:

  r_t    = exp(logp_t - behavior_logp_t)                          (token ratio, PPO), or
  r_k    = exp(mean_{t in k, policy} (logp_t - behavior_logp_t))  (sequence ratio, GSPO)
  A_tk   = node_leaf[n(t), k] * token_scale_t                     (APPO's scale; else 1)
  term   = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)   (PPO clip;
                                                              eps_high > eps_low: DAPO)
  term   = min(term, -c A)  where A < 0                       (dual-clip PPO, Ye et al. 2020)
  loss   = sum_t sum_k w_k [t on k] loss_mask_t term_tk       (w_k: derived.sequence_weights)

Sources: PPO's clipped surrogate (arXiv 1707.06347, Eq. 7); DAPO's clip-higher (arXiv
2503.14476, §3.1); GSPO's sequence-level ratio (arXiv 2507.18071); dual-clip PPO (Ye et al.,
"Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", AAAI 2020).

With surrogate="two_term" (PORTool, arXiv 2510.26020, App. B) the estimator's two parts
of A (extras "trajectory_term" and "fork_term") are clipped separately and their terms added:
term = term(A_trj) + term(A_fork), which differs from term(A_trj + A_fork) only where the
parts have opposite signs and the ratio is outside the clip range
(docs/methods/portool.md#surrogate-form).

Exact node-level form. `term` is piecewise linear in A with its only kink at A = 0:

  term = -A+ f+(r) + A- f-(r),   A+- = max(+-A, 0),
  f+(r) = min(r, 1 + eps_high),  f-(r) = max(r, 1 - eps_low), then min(f-(r), c) (dual clip).

With a = node_leaf and s = token_scale, A+ = a+ s+ + a- s- and A- = a- s+ + a+ s-, so the
sum over sequences of w_k A+-_tk factors into [B, N] node sums of w_k a+-[n, k] gathered per
token: the tree loss costs O(N K + L), with no [B, L, K] or [B, K, P] array. At sequence
level the ratio is shared by a sequence's tokens instead, so tokens are summed per node
first ([B, N]) and the per-sequence means are the node sums pushed through leaves_under.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from tree_rl.algos.registry import Advantages, check_choice
from tree_rl.tree import derived, segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import LossAggregation, TreeStructure
from tree_rl.tree.types import Array, Bool, Float

RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k3")
SURROGATES = ("combined", "two_term")
# Keys of the separately clipped advantage parts in Advantages.extras (portool.py).
TWO_TERM_KEYS = ("trajectory_term", "fork_term")
# Key of AWPO's batch clip radius in Advantages.extras (awpo.py; AWPO arXiv 2512.19126 Eq. 29):
# a scalar that is the radius of both sides of the clip when present (AWPO's Eq. 30 clips
# symmetrically at [1 - eps, 1 + eps]). The run config refuses algo.loss.clip_eps_low/high next
# to the awpo estimator, so a configured radius never sits unused
# (docs/methods/awpo.md#clip-radius-and-ratio).
AWPO_CLIP_KEY = "clip_eps"
# Log-ratios (per token, or a sequence's mean) are clamped before exp so that a stale or
# diverged policy cannot overflow the ratio to inf (inf * 0 would turn gradients into NaN);
# exp(20) ~ 5e8 is far past any clip range, so the clamp never changes a real loss.
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Policy-loss settings. Defaults: symmetric PPO clip 0.2, no dual clip, token ratios,
  seq_mean_token_mean aggregation (GRPO), no KL, no entropy bonus.

  clip_eps_low, clip_eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high]; a larger
    eps_high is DAPO's clip-higher. GSPO's sequence ratios use much smaller radii (GSPO,
    arXiv 2507.18071, §5.1: 3e-4 / 4e-4); set them explicitly with ratio_level="sequence".
    Not used with the awpo estimator, whose Eq. 29 radius (Advantages.extras["clip_eps"])
    clips both sides; set AWPOConfig.clip_min/clip_max instead.
  dual_clip_c: None, or c > 1: for A < 0 the per-pair loss is bounded by c |A| (dual-clip PPO).
  ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO/AWPO: one ratio per root-to-leaf
    sequence, the exp of the mean log-ratio of its policy tokens, clipped per sequence).
  aggregation: how the K sequences' token losses are combined (derived.LossAggregation).
  kl_coef, kl_estimator: coefficient of the KL to a reference policy, estimated per token by
    Schulman's k1 = logp - ref or k3 = exp(ref - logp) - (ref - logp) - 1.
  entropy_coef: coefficient of the entropy bonus (subtracted from the loss).
  surrogate: "combined" (one clipped term per pair on the estimator's A, PORTool's Eq. 3)
    or "two_term" (PORTool App. B: its trajectory and fork parts clipped separately; needs
    an estimator that writes them to extras, i.e. portool).
  """

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  dual_clip_c: float | None = None
  ratio_level: str = "token"
  aggregation: LossAggregation | str = LossAggregation.SEQ_MEAN_TOKEN_MEAN  # str: by value
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  surrogate: str = "combined"

  def __post_init__(self):
    def number(name, ok, rule):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
          or not ok(v):
        raise ValueError(f"LossConfig.{name}={v!r} is not valid; it must be {rule}")
      object.__setattr__(self, name, float(v))

    # 1 - eps_low must stay a positive ratio.
    number("clip_eps_low", lambda v: 0.0 <= v < 1.0, "a finite float in [0, 1)")
    number("clip_eps_high", lambda v: v >= 0.0, "a finite float >= 0")
    if self.dual_clip_c is not None:
      number("dual_clip_c", lambda v: v > 1.0, "None or a finite float > 1")
    check_choice("LossConfig", "ratio_level", self.ratio_level, RATIO_LEVELS)
    try:
      object.__setattr__(self, "aggregation", LossAggregation(self.aggregation))
    except ValueError:
      raise ValueError(
          f"LossConfig.aggregation={self.aggregation!r} is not valid; choose one of"
          f" {[m.value for m in LossAggregation]}") from None
    number("kl_coef", lambda v: v >= 0.0, "a finite float >= 0")
    check_choice("LossConfig", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
    number("entropy_coef", lambda v: v >= 0.0, "a finite float >= 0")
    check_choice("LossConfig", "surrogate", self.surrogate, SURROGATES)


def kl_penalty(logp: Float[Array, "*S"], ref_logp: Float[Array, "*S"],
               estimator: str) -> Float[Array, "*S"]:
  """Schulman's per-sample estimators of KL(pi || ref) (http://joschu.net/blog/kl-approx.html).

  k1 = logp - ref (unbiased, high variance, can be negative);
  k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, >= 0).
  """
  check_choice("kl_penalty", "estimator", estimator, KL_ESTIMATORS)
  d = ref_logp - logp
  return -d if estimator == "k1" else jnp.expm1(d) - d


def _surrogate(ratio, w_pos, w_neg, c_pos, c_neg, eps_low, eps_high, dual_c):
  """Pair losses grouped by a shared ratio (a token, or a sequence).

  w_pos / w_neg: summed weight * A+ / A- of the pairs sharing `ratio`; c_pos / c_neg: summed
  weight of the pairs with A > 0 / A < 0. Returns (loss, clipped weight, dual-clipped weight).
  """
  f_pos = jnp.minimum(ratio, 1.0 + eps_high)
  f_neg = jnp.maximum(ratio, 1.0 - eps_low)
  if dual_c is not None:
    f_neg = jnp.minimum(f_neg, dual_c)
  loss = jnp.sum(-w_pos * f_pos + w_neg * f_neg)
  r = jax.lax.stop_gradient(ratio)
  # "Clipped in the direction that matters": the pairs whose gradient the clip removes.
  clipped = jnp.sum(c_pos * (r > 1.0 + eps_high) + c_neg * (r < 1.0 - eps_low))
  dual = jnp.sum(c_neg * (r > dual_c)) if dual_c is not None else None
  return loss, clipped, dual


def _split(x):
  return jnp.maximum(x, 0.0), jnp.maximum(-x, 0.0)


def policy_loss(
    logp: Float[Array, "B L"],
    batch: TreeBatch,
    adv: Advantages,
    config: LossConfig,
    ref_logp: Float[Array, "B L"] | None = None,
    entropy: Float[Array, "B L"] | None = None,
    st: TreeStructure | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
  """Clipped policy-gradient loss of B packed trees (module docstring for the equations).

  Args:
    logp: [B, L] current log-probs of the packed tokens (only loss_mask tokens are used).
    batch: the packed trees; behavior_logp [B, L] are the sampling policy's log-probs.
    adv: advantages (leaf, node or [B, N, K] values: Advantages.dense), leaf_mask [B, K]
      (trained sequences), token_scale
      [B, L] or None (ones); extras[AWPO_CLIP_KEY] (scalar), when present, is the radius of
      both sides of the clip in place of config.clip_eps_low/high (AWPO Eq. 29-30).
    config: LossConfig (static under jit).
    ref_logp: [B, L] reference-policy log-probs; required when kl_coef > 0.
    entropy: [B, L] per-token policy entropies; required when entropy_coef > 0.
    st: derived.structure(batch), when the caller already has it.

  Returns:
    (loss, metrics). loss = pg_loss + kl_coef * sum_t w_t kl_t - entropy_coef * sum_t w_t H_t
    with w_t = derived.token_loss_weights (the sum of the weights of t's copies). Metrics are
    scalars; clip_frac, dual_clip_frac, approx_kl (k3 of the behavior policy against the
    current one, per token), kl_ref, entropy and ratio_mean are means over the trained
    (token, sequence) pairs weighted like the loss; ratio_max is their largest ratio.
  """
  if config.kl_coef > 0 and ref_logp is None:
    raise ValueError(f"LossConfig.kl_coef={config.kl_coef} > 0 needs ref_logp")
  if config.entropy_coef > 0 and entropy is None:
    raise ValueError(f"LossConfig.entropy_coef={config.entropy_coef} > 0 needs entropy")
  st = st or derived.structure(batch)
  eps_low, eps_high = config.clip_eps_low, config.clip_eps_high
  if AWPO_CLIP_KEY in adv.extras:
    eps_low = eps_high = jax.lax.stop_gradient(adv.extras[AWPO_CLIP_KEY])
  n_nodes = batch.parent.shape[1]
  node = batch.node_of_token
  mask = batch.loss_mask & (node >= 0)
  maskf = mask.astype(jnp.float32)
  # Masked before exp: padding and prompt/env log-probs may be anything.
  delta = jnp.where(mask, logp - batch.behavior_logp, 0.0)  # [B, L] log-ratios

  w = derived.sequence_weights(batch, config.aggregation, adv.leaf_mask, st)  # [B, K]
  under = st.leaves_under.astype(jnp.float32)  # [B, N, K]
  # Entries off a leaf's path are ignored whatever the estimator wrote there.
  on_path = lambda x: jnp.where(st.leaves_under, x, 0.0)
  a_pos, a_neg = _split(on_path(adv.dense(st)))  # [B, N, K]
  # Clip metrics count pairs by the sign of their whole advantage.
  is_pos = (a_pos > 0).astype(jnp.float32)
  is_neg = (a_neg > 0).astype(jnp.float32)
  if config.surrogate == "two_term":
    missing = [k for k in TWO_TERM_KEYS if k not in adv.extras]
    if missing:
      raise ValueError(f"LossConfig.surrogate='two_term' needs advantage parts {missing} in"
                       " Advantages.extras; only the portool estimator writes them")
    # The surrogate is linear in (A+, A-) for a fixed ratio: clipping each part on its
    # own is summing the parts' positive and negative halves.
    parts = [_split(on_path(adv.extras[k])) for k in TWO_TERM_KEYS]
    a_pos, a_neg = sum(p for p, _ in parts), sum(n for _, n in parts)
  scale = adv.token_scale_or_ones(logp.shape)
  s_pos, s_neg = _split(jnp.where(mask, scale, 0.0))  # [B, L]
  sgn_pos = (s_pos > 0).astype(jnp.float32)
  sgn_neg = (s_neg > 0).astype(jnp.float32)
  tok_w = derived.token_loss_weights(batch, config.aggregation, adv.leaf_mask, st)  # [B, L]
  total_w = tok_w.sum()

  if config.ratio_level == "token":
    ratio = jnp.exp(jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, L]
    wk = under * w[:, None, :]  # [B, N, K]: w_k [n on k]

    def per_token(x):  # sum_k w_k x[n, k] for each token's node n -> [B, L]
      return segment.gather(jnp.einsum("bnk,bnk->bn", wk, x), node)

    p_pos, p_neg = per_token(a_pos), per_token(a_neg)
    q_pos, q_neg = per_token(is_pos), per_token(is_neg)
    w_pos = s_pos * p_pos + s_neg * p_neg
    w_neg = s_pos * p_neg + s_neg * p_pos
    c_pos = maskf * (sgn_pos * q_pos + sgn_neg * q_neg)
    c_neg = maskf * (sgn_pos * q_neg + sgn_neg * q_pos)
    pair_w, pair_ratio = tok_w, ratio
  else:
    def node_sum(x):  # sum over each node's tokens -> [B, N]
      return segment.segment_sum(x, node, n_nodes, mask)

    def per_seq(x, y):  # sum_n [n on k] x[n, k] y[n] -> [B, K]
      return jnp.einsum("bnk,bn->bk", under * x, y)

    lens = st.path_policy_tokens.astype(jnp.float32)
    mean_delta = per_seq(jnp.ones_like(under), node_sum(delta)) / jnp.maximum(lens, 1.0)
    ratio = jnp.exp(jnp.clip(mean_delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, K]
    sp, sn = node_sum(s_pos), node_sum(s_neg)
    cp, cn = node_sum(sgn_pos), node_sum(sgn_neg)
    w_pos = w * (per_seq(a_pos, sp) + per_seq(a_neg, sn))
    w_neg = w * (per_seq(a_neg, sp) + per_seq(a_pos, sn))
    c_pos = w * (per_seq(is_pos, cp) + per_seq(is_neg, cn))
    c_neg = w * (per_seq(is_neg, cp) + per_seq(is_pos, cn))
    pair_w, pair_ratio = w * lens, ratio  # a sequence's ratio stands for its |y_k| pairs

  pg, clipped, dual = _surrogate(ratio, w_pos, w_neg, c_pos, c_neg, eps_low, eps_high,
                                 config.dual_clip_c)

  def mean(x):  # weighted mean over the trained pairs (0 when there are none)
    return jnp.where(total_w > 0, x / jnp.maximum(total_w, 1e-30), 0.0)

  def token_mean(x):
    return mean(jnp.sum(tok_w * jax.lax.stop_gradient(x)))

  loss = pg
  r_sg = jax.lax.stop_gradient(pair_ratio)
  metrics = {
      "pg_loss": jax.lax.stop_gradient(pg),
      "clip_frac": mean(clipped),
      "approx_kl": token_mean(jnp.expm1(delta) - delta),  # k3, behavior vs current
      "ratio_mean": mean(jnp.sum(pair_w * r_sg)),
      "ratio_max": jnp.max(jnp.where(pair_w > 0, r_sg, 0.0)),
  }
  if dual is not None:
    metrics["dual_clip_frac"] = mean(dual)
  if ref_logp is not None:
    # Inputs masked first: exp of a garbage padding log-prob would give NaN gradients.
    kl = kl_penalty(jnp.where(mask, logp, 0.0), jnp.where(mask, ref_logp, 0.0),
                    config.kl_estimator)
    metrics["kl_ref"] = token_mean(kl)
    if config.kl_coef > 0:
      loss = loss + config.kl_coef * jnp.sum(tok_w * kl)
  if entropy is not None:
    ent = jnp.where(mask, entropy, 0.0)
    metrics["entropy"] = token_mean(ent)
    if config.entropy_coef > 0:
      loss = loss - config.entropy_coef * jnp.sum(tok_w * ent)
  return loss, metrics
