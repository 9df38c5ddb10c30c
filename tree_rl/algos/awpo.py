"""AWPO advantages: variance-aware gating of outcome and mixed rewards, difficulty weighting and
the batch clip radius (AWPO, arXiv 2512.19126, §3.2, Eqs. 21-29 and Algorithm 1).

A group is the set of all valid leaves of one tree. For the paper's setting (K responses to
one prompt) that is a depth-1 tree and the group is exactly the paper's. On a deeper tree all
root-to-leaf sequences of the tree form one group, like GRPO over the leaves of a tree; the
paper has no tree form, and one group per set of sibling continuations would be a different
estimator (docs/methods/awpo.md#group-on-a-tree). Every leaf gets one sequence-level advantage,
shared by all policy tokens of its path (`Advantages.from_leaf_values`), so a prefix shared
by several leaves gets each leaf's advantage in that leaf's sequence.

Per group g with rewards R_out (sum of `reward_channels`) and R_mix = R_out + R_reason:

  mean_*, sd_*   population statistics, 1/K                                 (eqs. 21-23)
  gate_g  = sd_mix / (sd_out + sd_mix + eps_std)                              (eq. 24)
  w_g     = 1[mean_out < R_out_max] * 1[gate_g < eps_mix] * gate_g            (eq. 25)
  A_*     = (R_* - mean_*) / (sd_* + eps_adv)                                 (eq. 26)
  d_g     = alpha_prio if tau_low < mean_out < tau_high else alpha_base       (eq. 27)
  A_hyper = d_g * ((1 - w_g) * A_out + w_g * A_mix)                           (eq. 28)
  clip_eps = clip_min + (1 - w_bar) * (clip_max - clip_min),  w_bar = mean_g w_g   (eq. 29)

A standard deviation at or below `segment.STD_FLOOR` counts as exactly 0 (no spread), in the
gate as in the z-scores: float round-off in the mean of equal rewards must not turn an
outcome-saturated group (sd_out = 0) into one with a small gate, or leak tiny advantages.

clip_eps is the only clip radius of an AWPO run (Eq. 30 and Algorithm 1 clip at
[1 - eps_B, 1 + eps_B]): `losses.policy_loss` reads it from extras for both sides of the clip,
and the typed run config refuses `algo.loss.clip_eps_low/high` next to this estimator. It
clips whatever ratio the loss is set to (`LossConfig.ratio_level`), so clip_min and clip_max
must be on that ratio's scale (docs/methods/awpo.md#clip-radius-and-ratio, #radius-scale).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tree_rl.algos import registry
from tree_rl.algos.registry import AdvEstimator, Advantages
from tree_rl.tree import segment
from tree_rl.tree.batch import TreeBatch


@dataclasses.dataclass(frozen=True)
class AWPOConfig:
  """AWPO hyperparameters. The paper gives no numeric values; every default below is our
  starting value, not the paper's (docs/methods/awpo.md#hyperparameters).

  clip_min, clip_max: the range of the Eq. 29 radius. The defaults are PPO's token-ratio
  scale (LossConfig.ratio_level="token"). With ratio_level="sequence" (one length-normalised
  ratio per sequence) the radii must be set on that much smaller scale: the run config
  refuses the defaults there, and configs/awpo.py sets 2e-4 and 4e-4
  (docs/methods/awpo.md#radius-scale).
  """

  # Leaf channels summed into R_out (eq. 14). The host already writes format + execution
  # match into "outcome" (tree_rl.rewards.awpo_outcome_reward).
  reward_channels: tuple[str, ...] = ("outcome",)
  # Leaf channel holding the judge score R_reason in [0, 1] (eq. 20). A non-finite value
  # marks a missing judge score (its group falls back to the outcome alone).
  reasoning_channel: str = "reasoning"
  eps_adv: float = 1e-6  # verl's GRPO epsilon; eq. 26 stabiliser.
  eps_std: float = 1e-6  # eq. 24 stabiliser.
  eps_mix: float = 0.7  # admits sd_mix < 2.33 sd_out. >= 1 disables the cap.
  r_out_max: float = 2.0  # the theoretical max of R_out = S_format + S_exec (eqs. 14-19).
  tau_low: float = 1.2  # difficulty band on the [0, 2] R_out scale.
  tau_high: float = 1.8
  alpha_base: float = 1.0
  alpha_prio: float = 1.5
  clip_min: float = 0.1  # token-ratio scale (see the docstring).
  clip_max: float = 0.2  # standard PPO 0.2.
  # Ablations (paper Table 5; our readings: docs/methods/awpo.md#ablations):
  # False -> d_g = 1 ("removes eq. 27").
  difficulty_weighting: bool = True
  # False -> w_g = 1: A = d_g * A_mix ("removes the first term of eq. 28"), and every group
  # counts w_g = 1 in the clip radius (the mixed reward is used in full), giving clip_min.
  # A group with a missing judge score still falls back to w_g = 0 (docs/methods/awpo.md).
  variance_gating: bool = True
  # False -> the "w/o dynamic clipping" ablation: a fixed radius clip_max (the paper does not
  # state the fixed value; our choice), and clip_min is unused (the run config refuses it).
  dynamic_clip: bool = True

  def __post_init__(self):
    registry.check_reward_channels("AWPOConfig", self.reward_channels)
    if not isinstance(self.reasoning_channel, str):
      raise ValueError(
          f"AWPOConfig.reasoning_channel must be a channel name, got {self.reasoning_channel!r}")
    if self.reasoning_channel in self.reward_channels:
      raise ValueError(
          f"AWPOConfig.reasoning_channel {self.reasoning_channel!r} is also in"
          f" reward_channels {self.reward_channels}; R_mix would count it twice")
    for name in ("eps_adv", "eps_std", "eps_mix"):
      if not getattr(self, name) > 0:
        raise ValueError(f"AWPOConfig.{name} must be > 0, got {getattr(self, name)}")
    if not self.tau_low < self.tau_high:
      raise ValueError(
          f"AWPOConfig.tau_low ({self.tau_low}) must be < tau_high ({self.tau_high})")
    if not self.alpha_prio > self.alpha_base > 0:
      raise ValueError(
          "AWPOConfig needs alpha_prio > alpha_base > 0 (AWPO Eq. 27), got"
          f" alpha_base={self.alpha_base}, alpha_prio={self.alpha_prio}")
    for name in ("difficulty_weighting", "variance_gating", "dynamic_clip"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"AWPOConfig.{name} must be True or False, got {getattr(self, name)!r}")
    # Without dynamic clipping clip_min is never read, so only clip_max is checked then.
    if self.dynamic_clip and not 0 <= self.clip_min <= self.clip_max:
      raise ValueError(
          "AWPOConfig needs 0 <= clip_min <= clip_max, got"
          f" clip_min={self.clip_min}, clip_max={self.clip_max}")
    if not 0 <= self.clip_max < 1:  # 1 - clip_max must stay a positive ratio
      raise ValueError(f"AWPOConfig.clip_max={self.clip_max} must be in [0, 1)")


@registry.register(AdvEstimator.AWPO, AWPOConfig)
def awpo_advantages(batch: TreeBatch, config: AWPOConfig) -> Advantages:
  """AWPO eqs. 21-29 with one group per tree (all of its leaves).

  Args:
    batch: B trees; leaf rewards in `config.reward_channels` and `config.reasoning_channel`.
    config: AWPOConfig (static under jit).

  Returns:
    Advantages with leaf_values [B, K] = A_hyper of leaf k (on the policy nodes of its path);
    extras: "clip_eps" (scalar, eq. 29, computed once per rollout batch: the radius of every
    PPO epoch and minibatch on it; the loss clips at [1 - clip_eps, 1 + clip_eps]),
    "gate" [B] (eq. 24), "w" [B] (eq. 25; the w_g used, 1 without gating), "d" [B]
    (eq. 27), all 0 for padding trees;
    metrics: w_bar, clip_eps, mean gate and the fractions of valid groups with sd_out = 0,
    w > 0, d = alpha_prio and a missing judge score.
  """
  leaf_ok = batch.leaf_node >= 0  # [B, K]; a per-leaf value needs no tree structure
  tree_ok = leaf_ok.any(-1)  # [B]; padding trees have no leaves
  # One segment per tree: id 0 on valid leaves, -1 (dropped) on padding leaves.
  gid = jnp.where(leaf_ok, 0, -1)

  def stats(x):  # population mean and std per tree, [B]
    mean = segment.segment_mean(x, gid, 1)[:, 0]
    sd = segment.segment_std(x, gid, 1, ddof=0)[:, 0]
    return mean, jnp.where(sd > segment.STD_FLOOR, sd, 0.0)

  def zscore(x):  # eq. 26; exactly 0 for a group without spread
    return segment.segment_zscore(x, gid, 1, ddof=0, eps=config.eps_adv)

  r_out = batch.leaf_rewards(*config.reward_channels)  # [B, K]
  # A non-finite judge score is missing. It is filled with the mean of the group's
  # present scores (any finite value would do: such a group gets w_g = 0 below, and only
  # its A_mix, which is then multiplied by 0, sees the fill; a NaN times 0 is still NaN).
  r_reason = batch.leaf_rewards(config.reasoning_channel)
  present = leaf_ok & jnp.isfinite(r_reason)
  missing = (leaf_ok & ~present).any(-1)  # [B]
  fill = segment.segment_mean(jnp.where(present, r_reason, 0.0), gid, 1, present)  # [B, 1]
  r_reason = jnp.where(present, r_reason, fill)
  r_mix = r_out + r_reason  # eq. 20

  mean_out, sd_out = stats(r_out)
  _, sd_mix = stats(r_mix)
  gate = sd_mix / (sd_out + sd_mix + config.eps_std)  # eq. 24
  if config.variance_gating:
    w = jnp.where((mean_out < config.r_out_max) & (gate < config.eps_mix), gate, 0.0)  # eq. 25
  else:
    w = jnp.ones_like(gate)  # the mixed reward alone, and w_g = 1 in the clip radius
  # A group with a missing judge score falls back to the outcome-only advantage.
  w = jnp.where(missing | ~tree_ok, 0.0, w)
  gate = jnp.where(tree_ok, gate, 0.0)

  # Strict inequalities (eq. 27): a mean exactly on a band edge gets alpha_base.
  in_band = (config.tau_low < mean_out) & (mean_out < config.tau_high)
  if config.difficulty_weighting:
    d = jnp.where(in_band, config.alpha_prio, config.alpha_base)  # eq. 27
  else:
    d = jnp.ones_like(mean_out)
  d = jnp.where(tree_ok, d, 0.0)

  a_out, a_mix = zscore(r_out), zscore(r_mix)  # [B, K]
  a_hyper = d[:, None] * ((1.0 - w[:, None]) * a_out + w[:, None] * a_mix)  # eq. 28

  # Eq. 29 over the rollout batch's groups (Algorithm 1: 1/G, groups not samples).
  n_groups = jnp.maximum(tree_ok.sum(), 1).astype(jnp.float32)
  w_bar = w.sum() / n_groups
  if config.dynamic_clip:
    clip_eps = config.clip_min + (1.0 - w_bar) * (config.clip_max - config.clip_min)
  else:
    clip_eps = jnp.asarray(config.clip_max, jnp.float32)

  def frac(x):
    return (x & tree_ok).sum().astype(jnp.float32) / n_groups

  metrics = {
      "awpo/w_bar": w_bar,
      "awpo/clip_eps": clip_eps,
      "awpo/gate_mean": gate.sum() / n_groups,
      "awpo/frac_sd_out_zero": frac(sd_out == 0.0),
      "awpo/frac_w_pos": frac(w > 0.0),
      # d_g = alpha_prio exactly on in-band groups (none when the weighting is off).
      "awpo/frac_d_prio": frac(in_band & config.difficulty_weighting),
      "awpo/frac_judge_missing": frac(missing),
  }
  extras = {"clip_eps": clip_eps, "gate": gate, "w": w, "d": d}
  return Advantages.from_leaf_values(
      leaf_ok, a_hyper, metrics=metrics, extras=extras)
