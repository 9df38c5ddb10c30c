"""Group-relative baselines: GRPO, Dr.GRPO, DAPO, RLOO and ARPO.

The group is every leaf of a tree (one prompt). On a depth-1 tree (G
independent rollouts) this is plain GRPO; on a branched tree it is ARPO's
"GRPO over every leaf". Each leaf's advantage is written on every policy node
of its path; a shared prefix therefore carries a different advantage in each
sequence through it, exactly as when the leaves are flattened.

Standard-deviation convention: verl computes GRPO's std with torch.std, which
is unbiased (ddof=1); the papers do not say. ddof is a config field
(docs/methods/grpo.md#std-convention).

Sources: GRPO, DeepSeekMath (arXiv 2402.03300), §4.1.1 Eq. 3 and the outcome-supervision
advantage of §4.1.2; Dr.GRPO (arXiv 2503.20783), Fig. 1; DAPO (arXiv 2503.14476); RLOO
(Ahmadian et al., arXiv 2402.14740); ARPO (Dong et al., arXiv 2507.19849). tree_rl's
readings: docs/methods/grpo.md (DAPO's: docs/methods/dapo.md).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from tree_rl.algos.registry import (AdvEstimator, Advantages, check_choice,
                                    check_reward_channels, register)
from tree_rl.tree import segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import TreeStructure, structure
from tree_rl.tree.types import Array, Bool, Float, NodeKind


@dataclasses.dataclass(frozen=True)
class CenteredConfig:
  """Shared fields of the estimators that only centre rewards (Dr.GRPO, RLOO)."""

  reward_channels: tuple[str, ...] = ("outcome",)  # summed into the leaf reward

  def __post_init__(self):
    check_reward_channels(type(self).__name__, self.reward_channels)


@dataclasses.dataclass(frozen=True)
class ZScoreConfig(CenteredConfig):
  """Shared fields of the z-scoring estimators (GRPO, DAPO, ARPO, Tree-GRPO,
  TreeRPO). std_ddof: not stated by any of these papers; verl computes the
  std with torch.std, which is unbiased (ddof=1). std_eps: verl's epsilon."""

  std_ddof: int = 1
  std_eps: float = 1e-6

  def __post_init__(self):
    super().__post_init__()
    check_choice(type(self).__name__, "std_ddof", self.std_ddof, (0, 1))
    if self.std_eps < 0:
      raise ValueError(f"{type(self).__name__}.std_eps={self.std_eps} must be >= 0")


def tree_zscore(
    values: Float[Array, "B K"], leaf_valid: Bool[Array, "B K"], *, ddof: int, eps: float,
    center_only: bool = False,
) -> Float[Array, "B K"]:
  """Z-score of per-leaf values over all valid leaves of each tree (one group per tree: a
  masked row reduction)."""
  group = jnp.zeros(values.shape, jnp.int32)
  return segment.segment_zscore(values, group, 1, leaf_valid, ddof=ddof, eps=eps,
                                center_only=center_only)


# ----------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GRPOConfig(ZScoreConfig):
  """GRPO (DeepSeekMath, arXiv 2402.03300): the shared z-score fields, and PORTool's GRPO_fm
  baseline (arXiv 2510.26020, §4.1: "GRPO with the formatting reward").

  format_reward: each leaf's reward also gets the mean, over the steps on its path, of the
    rescaled formatting rubric R_fm = fm_half_range (2 raw - 1) (`path_mean_formatting`).
    PORTool does not give GRPO_fm's scale; tree_rl uses PORTool's own step formatting reward,
    in [-0.25, 0.25] (docs/methods/portool.md#grpo-with-the-formatting-reward).
  fm_half_range: h of R_fm; PORTool's stated range is [-0.25, 0.25].
  """

  format_reward: bool = False
  fm_half_range: float = 0.25

  def __post_init__(self):
    super().__post_init__()
    if not self.fm_half_range > 0:
      raise ValueError(f"GRPOConfig.fm_half_range={self.fm_half_range} must be > 0")


def path_mean_formatting(batch: TreeBatch, half_range: float) -> Float[Array, "B K"]:
  """Mean over the steps on each leaf's path of R_fm = half_range (2 raw - 1), where raw is
  the step's formatting rubric in node channel "format"; 0 on padding leaves.

  A step is a policy node with no policy child: the agent loop records a step's rubric on
  the last node it sampled for it, and a strategy that forks inside a step (APPO, random)
  leaves the step's earlier tokens in policy nodes whose children continue the step. Node
  m is on leaf k's path iff m <= leaf_node[k] < subtree_end[m] (`TreeBatch.subtree_end`).
  """
  n = batch.parent.shape[1]
  is_policy = batch.node_kind == NodeKind.POLICY
  parent = jnp.where(batch.parent >= 0, batch.parent, n)  # the root's -1: dropped below
  has_policy_child = jax.vmap(lambda p, pol: jnp.zeros(n, bool).at[p].max(pol, mode="drop"))(
      parent, is_policy)
  is_step = is_policy & ~has_policy_child
  idx = jnp.arange(n)[None, :, None]
  leaf = batch.leaf_node[:, None, :]
  on_path = (idx <= leaf) & (leaf < batch.subtree_end[:, :, None]) & is_step[:, :, None]
  r_fm = half_range * (2.0 * batch.node_rewards("format") - 1.0)
  total = jnp.einsum("bn,bnk->bk", r_fm, on_path.astype(r_fm.dtype))
  count = on_path.sum(1)
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


@register(AdvEstimator.GRPO, GRPOConfig)
def grpo_advantages(batch: TreeBatch, config: GRPOConfig) -> Advantages:
  """A_k = (R_k - mean_G R) / (std_G R + eps) over the leaves of each tree.

  DeepSeekMath (arXiv 2402.03300) §4.1.2, outcome supervision: every token of
  rollout k gets A_k.
  """
  valid = batch.leaf_node >= 0  # a leaf value needs no tree structure
  r = batch.leaf_rewards(*config.reward_channels)
  if config.format_reward:  # GRPO_fm
    r = r + path_mean_formatting(batch, config.fm_half_range)
  a = tree_zscore(r, valid, ddof=config.std_ddof, eps=config.std_eps)
  return Advantages.from_leaf_values(valid, a, metrics=_group_metrics(r, valid))


def _group_metrics(r: Float[Array, "B K"], leaf_valid: Bool[Array, "B K"]) -> dict:
  """Mean reward and the fraction of trees with no reward spread (population std at most
  STD_FLOOR), over the non-empty trees. The row statistics are the z-score's own
  (`row_stats`; jit computes them once), both figures come out of one reduce over the trees
  (`masked_means`), and the spread test compares the sum of squared deviations with
  count * STD_FLOOR^2: the std test without a division and a square root per tree."""
  c, mean, ss = segment.row_stats(r, leaf_valid)
  tree_ok = c[:, 0] > 0
  flat = tree_ok & (ss[:, 0] <= c[:, 0] * segment.STD_FLOOR**2)
  reward_mean, zero_std_frac = segment.masked_means(tree_ok, mean[:, 0], flat)
  return {"reward_mean": reward_mean, "zero_std_frac": zero_std_frac}


# ----------------------------------------------------------------------------
# Dr.GRPO
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DrGRPOConfig(CenteredConfig):
  """Dr.GRPO: rewards are centred, never divided by a std."""


@register(AdvEstimator.DR_GRPO, DrGRPOConfig)
def dr_grpo_advantages(batch: TreeBatch, config: DrGRPOConfig) -> Advantages:
  """A_k = R_k - mean_G R: no std normalisation (Dr.GRPO, arXiv 2503.20783, Fig. 1).

  The other half of Dr.GRPO, a constant (not per-sequence) length
  normaliser, is the loss aggregation `seq_mean_token_sum`.
  """
  valid = batch.leaf_node >= 0
  r = batch.leaf_rewards(*config.reward_channels)
  a = tree_zscore(r, valid, ddof=0, eps=0.0, center_only=True)
  return Advantages.from_leaf_values(valid, a, metrics=_group_metrics(r, valid))


# ----------------------------------------------------------------------------
# DAPO
# ----------------------------------------------------------------------------


# DAPO's own lengths (arXiv 2503.14476, §4.1): 16,384 expected tokens plus a 4,096-token soft
# punishment buffer, so L_max = 20,480 and L_cache / L_max = 1/5.
PAPER_MAX_RESPONSE_TOKENS = 20480
PAPER_OVERLONG_BUFFER_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class DAPOConfig(ZScoreConfig):
  """DAPO (arXiv 2503.14476): GRPO z-scores of the outcome plus the soft overlong punishment
  of §3.4, Eq. 13 (`overlong_penalty`), with L_max = max_response_tokens and L_cache =
  overlong_buffer_tokens; |y| is the number of policy tokens on a root-to-leaf path.

  The paper's L_max = 20480, L_cache = 4096 only matter where responses can reach 16,384
  tokens. A training run does not use these defaults as they stand: `RunConfig.
  estimator_config()` derives L_max from the run's response budget B (the most policy tokens
  a root-to-leaf path can hold: turns x rollout.max_new_tokens, capped by
  rollout.max_context_tokens), L_max = min(20480, B), and L_cache = L_max * 4096 / 20480
  (rounded, >= 1), so the paper's numbers stand where B >= 20480 and the penalty always
  starts at 4/5 of what a response can hold. A value set in algo.estimator_kwargs wins, but
  one whose penalty could never fire (L_max - L_cache >= B) fails at start-up.
  docs/methods/dapo.md#overlong-lengths-from-the-response-budget has the derivation.

  overlong_shaping: apply R_length (False: plain GRPO rewards; the lengths must then be unset).
  max_response_tokens: L_max; |y| > L_max gets -1.
  overlong_buffer_tokens: L_cache; None -> round(L_max * 4096 / 20480), at least 1.
  overlong_penalty: scale of R_length (1: the paper's, -1 at L_max); > 0.
  """

  overlong_shaping: bool = True
  max_response_tokens: int = PAPER_MAX_RESPONSE_TOKENS
  overlong_buffer_tokens: int | None = None
  overlong_penalty: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    if self.max_response_tokens < 1:
      raise ValueError(f"DAPOConfig.max_response_tokens={self.max_response_tokens} must be >= 1")
    if self.overlong_buffer_tokens is None:  # DAPO's proportion, L_cache / L_max = 1/5
      object.__setattr__(self, "overlong_buffer_tokens", max(1, round(
          self.max_response_tokens * PAPER_OVERLONG_BUFFER_TOKENS / PAPER_MAX_RESPONSE_TOKENS)))
    if not 0 < self.overlong_buffer_tokens <= self.max_response_tokens:
      raise ValueError(
          f"DAPOConfig.overlong_buffer_tokens={self.overlong_buffer_tokens} must be in"
          f" (0, max_response_tokens={self.max_response_tokens}]"
      )
    if not self.overlong_penalty > 0:
      raise ValueError(f"DAPOConfig.overlong_penalty={self.overlong_penalty} must be > 0 (turn "
                       f"the shaping off with overlong_shaping=False)")


def overlong_penalty(
    length: Float[Array, "B K"], max_tokens: int, buffer_tokens: int
) -> Float[Array, "B K"]:
  """DAPO's soft overlong punishment R_length(y) (arXiv 2503.14476, §3.4, Eq. 13).

  0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the
  buffer; -1 beyond L_max. |y| counts the policy tokens of the sequence.
  """
  free = max_tokens - buffer_tokens
  inside = (free - length) / buffer_tokens
  return jnp.where(length <= free, 0.0, jnp.where(length <= max_tokens, inside, -1.0))


@register(AdvEstimator.DAPO, DAPOConfig)
def dapo_advantages(batch: TreeBatch, config: DAPOConfig) -> Advantages:
  """GRPO z-scores of R_k + R_length(y_k) (DAPO).

  Clip-higher (eps_low 0.2, eps_high 0.28) and token-mean aggregation are
  loss settings; dynamic sampling is `dapo_keep_mask`, applied to the groups
  before they are batched.
  """
  st = structure(batch)
  r = batch.leaf_rewards(*config.reward_channels)
  if config.overlong_shaping:
    length = st.path_policy_tokens.astype(jnp.float32)
    r = r + config.overlong_penalty * jnp.where(
        st.leaf_valid,
        overlong_penalty(length, config.max_response_tokens, config.overlong_buffer_tokens), 0.0)
  a = tree_zscore(r, st.leaf_valid, ddof=config.std_ddof, eps=config.std_eps)
  metrics = _group_metrics(r, st.leaf_valid)
  metrics["keep_frac"] = dapo_keep_mask(batch, config, st).mean()
  return Advantages.from_leaf_values(st.leaf_valid, a, metrics=metrics)


def dapo_keep_mask(
    batch: TreeBatch, config: DAPOConfig | None = None, st: TreeStructure | None = None
) -> Bool[Array, "B"]:
  """DAPO dynamic sampling: keep a group (tree) iff its rewards are not all
  equal (0 < accuracy < 1 for binary rewards). Padding trees are dropped.

  Uses the outcome channels only, before length shaping, as DAPO filters on
  accuracy.
  """
  config = config or DAPOConfig()
  st = st or structure(batch)
  r = batch.leaf_rewards(*config.reward_channels)
  ids = jnp.zeros(r.shape, jnp.int32)
  hi = segment.segment_max(r, ids, 1, st.leaf_valid)[:, 0]
  lo = segment.segment_min(r, ids, 1, st.leaf_valid)[:, 0]
  return st.leaf_valid.any(-1) & (hi - lo > segment.STD_FLOOR)


# ----------------------------------------------------------------------------
# RLOO
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RLOOConfig(CenteredConfig):
  """RLOO: a leave-one-out mean baseline, no std."""


@register(AdvEstimator.RLOO, RLOOConfig)
def rloo_advantages(batch: TreeBatch, config: RLOOConfig) -> Advantages:
  """A_k = R_k - mean_{j != k} R_j = G/(G-1) * (R_k - mean R) (REINFORCE
  leave-one-out, Ahmadian et al., arXiv 2402.14740). 0 for a group of one
  (docs/methods/grpo.md#rloo-group-of-one)."""
  valid = batch.leaf_node >= 0
  r = batch.leaf_rewards(*config.reward_channels)
  g = valid.sum(-1, keepdims=True).astype(jnp.float32)
  centered = tree_zscore(r, valid, ddof=0, eps=0.0, center_only=True)
  a = jnp.where(g > 1, centered * g / jnp.maximum(g - 1, 1.0), 0.0)
  return Advantages.from_leaf_values(valid, a, metrics=_group_metrics(r, valid))


# ----------------------------------------------------------------------------
# ARPO
# ----------------------------------------------------------------------------


class Attribution(str, enum.Enum):
  SOFT = "soft"  # each sequence keeps its own advantage on shared tokens
  HARD = "hard"  # a shared token gets the mean advantage of the leaves below it


@dataclasses.dataclass(frozen=True)
class ARPOConfig(ZScoreConfig):
  attribution: str = "soft"  # ARPO's default advantage attribution

  def __post_init__(self):
    super().__post_init__()
    check_choice("ARPOConfig", "attribution", self.attribution, [a.value for a in Attribution])


@register(AdvEstimator.ARPO, ARPOConfig)
def arpo_advantages(batch: TreeBatch, config: ARPOConfig) -> Advantages:
  """GRPO over every leaf of the tree (ARPO, Dong et al., arXiv 2507.19849).

  soft: shared-prefix tokens carry each sequence's own advantage (the loss
  then sums the copies); hard: shared tokens get the mean of the advantages
  of the leaves below them, so every copy agrees
  (docs/methods/grpo.md#arpo-advantage-attribution).
  """
  valid = batch.leaf_node >= 0
  r = batch.leaf_rewards(*config.reward_channels)
  a = tree_zscore(r, valid, ddof=config.std_ddof, eps=config.std_eps)
  metrics = _group_metrics(r, valid)
  if config.attribution == Attribution.SOFT:
    return Advantages.from_leaf_values(valid, a, metrics=metrics)
  st = structure(batch)
  under = st.leaves_under.astype(jnp.float32)
  node_mean = jnp.einsum("bnk,bk->bn", under, a) / jnp.maximum(under.sum(-1), 1.0)
  return Advantages.from_node_values(valid, node_mean, metrics=metrics)
