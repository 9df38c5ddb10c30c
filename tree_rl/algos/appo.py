"""APPO: Agentic Procedural Policy Optimization (specs/appo.md).

Three pieces, all jitted kernels over a packed TreeBatch:

1. The future value Omega (APPO Eq. 4) of every token of an initial rollout,
   a gamma-discounted sum of the log-ratios log(pi_theta / pi_old) of the token
   and every later token of its root-to-leaf sequence, exponentiated.
2. The Branching Score BS = Z(clip(Omega)) * Z(ent) (Eq. 5), z-scored within
   each initial rollout, and the top-B branch-point selection (spec §2.4).
3. The registered estimator: the dual-group base advantage (Eq. 6, three
   readings, spec §2.7) on the initial rollouts' policy tokens, and the
   future-aware token scale 1 + b * clip(Omega, c_lo, c_hi) (Eq. 7, §2.8), so
   that the loss sees A = A_base * (1 + b * A_fut).

Tree layout. Leaves tagged INIT are the N initial rollouts (the only trained
sequences); leaves tagged BRANCH are the continuations resampled from them.
A branch shares exactly the nodes of its parent rollout that lie above the
node it hangs from, so the coverage S(n, i) of Eq. 6 ("branches whose shared
prefix contains position i") is structural: it is the set of BRANCH leaves
below the node of token i. Whether a branch at position p shares positions
< p (paper, `branch_prefix="exclusive"`) or <= p (public code, "inclusive")
is decided when the tree is built, by where the branch node hangs; the kernel
needs no flag for it. In a valid APPO tree every non-root node lies on at
most one INIT leaf's path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tree_rl.algos import registry
from tree_rl.algos.registry import AdvEstimator, Advantages, check_choice
from tree_rl.tree import derived, segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import TreeStructure
from tree_rl.tree.types import Array, Bool, Float, Int, LeafTag

# The log of Omega is clamped to +-20 before exp so that long runs of large
# log-ratios cannot overflow (spec E15; the authors' code does the same).
LOG_FUTURE_CLAMP = 20.0
# Token-level z-scores (Eq. 5) are 0 when the rollout's std is below this
# (spec §2.4 item 4). Reward z-scores use segment.STD_FLOOR like every other
# estimator.
BS_STD_FLOOR = 1e-8

BASE_ADV_MODES = ("literal", "avg_flowback", "code_sum")
BS_MODES = ("bs", "entropy", "future")
FIRST_MINIBATCH_FALLBACKS = ("entropy", "skip_branching")


@dataclasses.dataclass(frozen=True)
class APPOConfig:
  """APPO advantage options; defaults follow specs/appo.md §3.4."""

  n_init: int = 4  # N, "initial sampling size" (spec §3.1, STATED).
  budget: int = 16  # M, "global rollout size" (spec §3.1, STATED); B = M/N - 1 = 3.
  tau_half: float = 32.0  # half-life of the decay, gamma = 2^(-1/tau) (spec §2.3, STATED).
  fut_clip: tuple[float, float] = (1.0, 1.2)  # [c_lo, c_hi] (spec §2.8, STATED: implementation).
  b: float = 0.5  # weight of the future-aware term (spec §3.1, STATED).
  base_adv_mode: str = "avg_flowback"  # Eq. 6 reading (spec §2.7, SUGGESTION).
  dual_group: bool = True  # False = the "w/o dual-group" pooled ablation (spec §2.7).
  bs_mode: str = "bs"  # "bs" (Eq. 5) | "entropy" (ablation, §4.3) | "future" (App. D).
  bs_require_both_positive: bool = True  # sign filter (spec §2.4 item 2, SUGGESTION).
  first_minibatch_fallback: str = "entropy"  # spec §2.4 item 5 (SUGGESTION).
  std_ddof: int = 0  # population std (spec §2.4 item 4, SUGGESTION; paper NOT STATED).
  std_eps: float = 1e-6  # reward z-score denominator eps (spec §3.4; paper NOT STATED).
  outcome_channel: str = "outcome"  # leaf reward channel of R_n (NOT STATED, our choice).

  def __post_init__(self):
    if not isinstance(self.n_init, int) or self.n_init < 1:
      raise ValueError(f"APPOConfig.n_init must be an int >= 1, got {self.n_init!r}")
    if not isinstance(self.budget, int) or self.budget < self.n_init:
      raise ValueError(
          f"APPOConfig.budget must be an int >= n_init={self.n_init}, got {self.budget!r}")
    if self.budget % self.n_init:
      raise ValueError(
          f"APPOConfig.budget={self.budget} must be a multiple of n_init={self.n_init}"
          " (M = (B + 1) * N at L = 1, spec §2.5)")
    if not math.isfinite(self.tau_half) or self.tau_half <= 0:
      raise ValueError(f"APPOConfig.tau_half must be finite and > 0, got {self.tau_half!r}")
    if len(tuple(self.fut_clip)) != 2:
      raise ValueError(f"APPOConfig.fut_clip must be (c_lo, c_hi), got {self.fut_clip!r}")
    lo, hi = (float(x) for x in self.fut_clip)
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= hi):
      raise ValueError(
          f"APPOConfig.fut_clip must satisfy 0 < c_lo <= c_hi (finite), got {self.fut_clip!r}")
    # A tuple keeps the config hashable (it is a static jit argument).
    object.__setattr__(self, "fut_clip", (lo, hi))
    if not math.isfinite(self.b) or self.b < 0:
      raise ValueError(f"APPOConfig.b must be finite and >= 0, got {self.b!r}")
    check_choice("APPOConfig", "base_adv_mode", self.base_adv_mode, BASE_ADV_MODES)
    check_choice("APPOConfig", "bs_mode", self.bs_mode, BS_MODES)
    check_choice("APPOConfig", "first_minibatch_fallback", self.first_minibatch_fallback,
                  FIRST_MINIBATCH_FALLBACKS)
    if not isinstance(self.dual_group, bool):
      raise ValueError(f"APPOConfig.dual_group must be a bool, got {self.dual_group!r}")
    if not isinstance(self.bs_require_both_positive, bool):
      raise ValueError(
          "APPOConfig.bs_require_both_positive must be a bool, got"
          f" {self.bs_require_both_positive!r}")
    if self.std_ddof not in (0, 1):
      raise ValueError(f"APPOConfig.std_ddof must be 0 or 1, got {self.std_ddof!r}")
    if not math.isfinite(self.std_eps) or self.std_eps < 0:
      raise ValueError(f"APPOConfig.std_eps must be finite and >= 0, got {self.std_eps!r}")
    if not isinstance(self.outcome_channel, str) or not self.outcome_channel:
      raise ValueError(
          f"APPOConfig.outcome_channel must be a channel name, got {self.outcome_channel!r}")

  @property
  def gamma(self) -> float:
    """Token decay of Eq. 4, gamma = 2^(-1/tau_half) (0.97857 at tau_half = 32)."""
    return 2.0 ** (-1.0 / self.tau_half)

  @property
  def num_branches(self) -> int:
    """B, branch points per initial rollout at L = 1: M = (B + 1) N (spec §2.5)."""
    return self.budget // self.n_init - 1


class BranchingScore(NamedTuple):
  """Per initial-rollout path arrays, `[B, K, P]` (P = batch.max_path_len).

  Index [b, k, p] is position p of leaf k's root-to-leaf sequence (prompt
  included); rows of non-INIT leaves and invalid positions are all 0/False.
  """

  bs: Float[Array, "B K P"]  # Branching Score (Eq. 5, or its ablation / fallback)
  z_fut: Float[Array, "B K P"]  # Z(clip(Omega, c_lo, c_hi); H_n)
  z_ent: Float[Array, "B K P"]  # Z(ent; H_n)
  valid: Bool[Array, "B K P"]  # candidate branch positions


# ----------------------------------------------------------------------------
# Future value (Eq. 4)
# ----------------------------------------------------------------------------


def _init_leaves(batch: TreeBatch, st: TreeStructure) -> Bool[Array, "B K"]:
  return st.leaf_valid & (batch.leaf_tag == int(LeafTag.INIT))


def _init_path_log_future(
    batch: TreeBatch, st: TreeStructure, logp: Float[Array, "B L"], config: APPOConfig
) -> tuple[Int[Array, "B K P"], Float[Array, "B K P"]]:
  """Packed index and clamped log-Omega of every position of every INIT path.

  x_i = log rho_i = logp_i - behavior_logp_i on policy tokens and 0 on prompt
  and env tokens, which still age the discount (distances count raw positions,
  spec §2.3 / A9). S_i = x_i + gamma S_{i+1} is one reverse scan per path;
  the zero padding past a path's end leaves S unchanged.
  """
  k = batch.leaf_node.shape[1]
  leaf_ids = jnp.where(_init_leaves(batch, st), jnp.arange(k)[None, :], -1)
  idx = derived.path_token_index(batch, st, leaf_ids, batch.max_path_len)
  log_rho = jnp.where(batch.loss_mask, logp - batch.behavior_logp, 0.0)
  x = derived.gather_tokens(log_rho, idx, 0.0)
  s = segment.discounted_reverse_cumsum(x, config.gamma, axis=-1)
  return idx, jnp.clip(s, -LOG_FUTURE_CLAMP, LOG_FUTURE_CLAMP)


def _exclusive_init_tokens(
    batch: TreeBatch, st: TreeStructure, is_init: Bool[Array, "B K"]
) -> Bool[Array, "B L"]:
  """Tokens on exactly one INIT leaf's path (every non-root token of a valid tree)."""
  per_node = (st.leaves_under & is_init[:, None, :]).sum(-1)  # [B, N]
  node = jnp.maximum(batch.node_of_token, 0)
  per_tok = jnp.take_along_axis(per_node, node, axis=1)
  return (per_tok == 1) & (batch.node_of_token >= 0)


def _scatter_paths(values: Float[Array, "B K P"], idx: Int[Array, "B K P"], l: int
                   ) -> Float[Array, "B L"]:
  """Sums path values back onto packed tokens (index -1 is dropped)."""
  b = values.shape[0]
  flat_idx = jnp.where(idx >= 0, idx, l).reshape(b, -1)  # l is out of range -> dropped
  flat_val = values.reshape(b, -1)
  return jax.vmap(lambda v, i: jnp.zeros((l,), v.dtype).at[i].add(v, mode="drop"))(
      flat_val, flat_idx)


def future_value(
    batch: TreeBatch,
    logp: Float[Array, "B L"],
    config: APPOConfig,
    st: TreeStructure | None = None,
) -> Float[Array, "B L"]:
  """Future value Omega of every token of an initial rollout (APPO Eq. 4).

    Omega_{n,i} = exp( clamp( sum_{i' >= i} gamma^{i'-i} log rho_{n,i'}, -20, 20 ) )
    log rho_{n,i'} = logp_{i'} - behavior_logp_{i'} on policy tokens, 0 otherwise

  The sum runs along the root-to-leaf sequence of the INIT leaf through the
  token, to its end, across turns; env tokens contribute 0 but count in the
  distance i' - i (spec §2.3). Each INIT path is gathered to `[B, K, P]` with
  `derived.path_token_index` (whose token-to-path masks are `[B, L, K]`),
  scanned once and scattered back; nothing is `[B, L, L]` or `[B, L, N]`.

  Args:
    batch: packed trees (`[B, L]` tokens).
    logp: `[B, L]` log-probs of the sampled tokens under the current policy.
    config: gamma comes from `config.tau_half`.
    st: precomputed `derived.structure(batch)` (optional).

  Returns:
    `[B, L]` Omega on tokens that lie on exactly one INIT path (in a valid
    APPO tree: every token of an initial rollout below the prompt), and 1 on
    every other token (shared prompt, branch-only tokens, padding).
  """
  st = derived.structure(batch) if st is None else st
  idx, log_fut = _init_path_log_future(batch, st, logp, config)
  excl = _exclusive_init_tokens(batch, st, _init_leaves(batch, st))
  log_tok = _scatter_paths(log_fut, idx, batch.tokens.shape[1])
  return jnp.exp(jnp.where(excl, log_tok, 0.0))


# ----------------------------------------------------------------------------
# Branching Score (Eq. 5) and branch-point selection (spec §2.4)
# ----------------------------------------------------------------------------


def _masked_zscore(
    v: Float[Array, "B K P"], m: Bool[Array, "B K P"], ddof: int
) -> tuple[Float[Array, "B K P"], Bool[Array, "B K"]]:
  """Z over the valid positions of each row; 0 when the row's std < 1e-8.

  Values are shifted by the row's valid maximum first: z-scores are
  shift-invariant, and a row of equal values then has deviations exactly 0,
  so float round-off in the mean cannot pass the tiny 1e-8 floor.
  Returns the z-scores and whether the row had ~zero std.
  """
  n = m.sum(-1)
  ref = jnp.max(jnp.where(m, v, -jnp.inf), axis=-1)
  ref = jnp.where(n > 0, ref, 0.0)[..., None]
  d = jnp.where(m, v - ref, 0.0)
  mean = d.sum(-1, keepdims=True) / jnp.maximum(n, 1)[..., None]
  dev = jnp.where(m, d - mean, 0.0)
  var = jnp.where(n > ddof, (dev * dev).sum(-1) / jnp.maximum(n - ddof, 1), 0.0)
  std = jnp.sqrt(var)
  ok = std >= BS_STD_FLOOR
  z = jnp.where(m & ok[..., None], dev / jnp.where(ok, std, 1.0)[..., None], 0.0)
  return z, ~ok


def _branching_paths(
    batch: TreeBatch,
    idx: Int[Array, "B K P"],
    log_fut: Float[Array, "B K P"],
    entropy: Float[Array, "B L"],
    config: APPOConfig,
    token_mask: Bool[Array, "B L"] | None,
) -> tuple[BranchingScore, Bool[Array, "B K"]]:
  """BranchingScore plus the per-rollout first-minibatch fallback flag."""
  cand = batch.loss_mask if token_mask is None else batch.loss_mask & token_mask
  valid = derived.gather_tokens(cand, idx, False) & (idx >= 0)
  lo, hi = config.fut_clip
  clip_omega = jnp.clip(jnp.exp(log_fut), lo, hi)
  ent = derived.gather_tokens(entropy, idx, 0.0)
  z_fut, fut_flat = _masked_zscore(clip_omega, valid, config.std_ddof)
  z_ent, _ = _masked_zscore(ent, valid, config.std_ddof)
  if config.bs_mode == "bs":
    bs = z_fut * z_ent
  elif config.bs_mode == "entropy":
    bs = z_ent
  else:
    bs = z_fut
  # When clip(Omega) has ~zero std over a rollout (always in the first
  # mini-batch, where pi_theta = pi_old and Omega == 1; spec E1/E2), Z(clip
  # Omega) is 0 and Eq. 5 ranks nothing: fall back per rollout (§2.4 item 5).
  has_valid = valid.any(-1)
  fell_back = fut_flat & has_valid & (config.bs_mode != "entropy")
  fb = fell_back[..., None]
  if config.first_minibatch_fallback == "entropy":
    bs = jnp.where(fb, z_ent, bs)
  else:
    bs = jnp.where(fb, 0.0, bs)
    valid = valid & ~fb
  zero = lambda x: jnp.where(valid, x, 0.0)
  return BranchingScore(zero(bs), zero(z_fut), zero(z_ent), valid), fell_back


def branching_score(
    batch: TreeBatch,
    logp: Float[Array, "B L"],
    entropy: Float[Array, "B L"],
    config: APPOConfig,
    token_mask: Bool[Array, "B L"] | None = None,
    st: TreeStructure | None = None,
) -> BranchingScore:
  """Branching Score of every position of every initial rollout (APPO Eq. 5).

    BS_{n,i} = Z(clip(Omega_{n,i}, c_lo, c_hi); H_n) * Z(ent_{n,i}; H_n)
    Z(v_i; H_n) = (v_i - mean_valid(v)) / std_valid(v),  := 0 if std < 1e-8

  Statistics are per INIT rollout H_n over its valid positions: its policy
  (loss-mask) tokens, optionally restricted further by `token_mask` (e.g. the
  rollout strategy's whitespace/punctuation/EOS filter, spec §2.4 item 1).
  `bs_mode="entropy"` gives BS = Z(ent), `"future"` gives BS = Z(clip Omega).
  Fallback (spec §2.4 item 5): for a rollout whose clip(Omega) has ~zero std,
  `"entropy"` sets BS := Z(ent); `"skip_branching"` sets BS := 0 and marks
  every position invalid.

  Args:
    batch: packed trees.
    logp: `[B, L]` current-policy log-probs of the sampled tokens.
    entropy: `[B, L]` current-policy token entropies (Eq. 3); read on valid
      positions only.
    config: clip range, std ddof, bs_mode and fallback.
    token_mask: optional `[B, L]` extra candidate filter.
    st: precomputed `derived.structure(batch)` (optional).

  Returns:
    BranchingScore of `[B, K, P]` arrays indexed by (tree, leaf, position in
    the leaf's root-to-leaf sequence); all zero/False off INIT rows.
  """
  st = derived.structure(batch) if st is None else st
  idx, log_fut = _init_path_log_future(batch, st, logp, config)
  out, _ = _branching_paths(batch, idx, log_fut, entropy, config, token_mask)
  return out


def select_branch_points(
    bs: Float[Array, "B K P"],
    z_fut: Float[Array, "B K P"],
    z_ent: Float[Array, "B K P"],
    valid: Bool[Array, "B K P"],
    num_branches: int,
    require_both_positive: bool = True,
) -> Int[Array, "B K R"]:
  """Top-B branch points of every rollout by Branching Score (spec §2.4, E3, E4).

  Order: with `require_both_positive`, valid positions with Z(clip Omega) > 0
  and Z(ent) > 0 first, by BS descending; then the remaining valid positions
  by raw BS descending (ties: lower position first). When a rollout has fewer
  than `num_branches` valid positions the best ones are repeated cyclically
  (several continuations from one point keep M fixed); a rollout with none
  gets -1. `num_branches` and `require_both_positive` must be static.

  Returns:
    `[B, K, num_branches]` offsets into the root-to-leaf sequences, best first.
  """
  p = bs.shape[-1]
  if num_branches <= 0:
    return jnp.zeros(bs.shape[:-1] + (0,), jnp.int32)
  kk = min(num_branches, p)  # lax.top_k needs k <= P; cycling never reads past kk
  strong = valid & (z_fut > 0) & (z_ent > 0) if require_both_positive else jnp.zeros_like(valid)
  weak = valid & ~strong
  _, top_strong = lax.top_k(jnp.where(strong, bs, -jnp.inf), kk)
  _, top_weak = lax.top_k(jnp.where(weak, bs, -jnp.inf), kk)
  n_strong = strong.sum(-1, keepdims=True)
  n_valid = valid.sum(-1, keepdims=True)
  j = jnp.arange(num_branches)
  src = j % jnp.maximum(n_valid, 1)  # [B, K, R]: rank of the point to use
  from_strong = jnp.take_along_axis(top_strong, jnp.clip(src, 0, kk - 1), axis=-1)
  from_weak = jnp.take_along_axis(top_weak, jnp.clip(src - n_strong, 0, kk - 1), axis=-1)
  pos = jnp.where(src < n_strong, from_strong, from_weak)
  return jnp.where(n_valid > 0, pos, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Dual-group base advantage (Eq. 6)
# ----------------------------------------------------------------------------


class _Groups(NamedTuple):
  z_init: Float[Array, "B K"]  # INIT leaves vs the init (or pooled) group, 0 elsewhere
  z_branch: Float[Array, "B K"]  # BRANCH leaves vs the branch (or pooled) group
  z_init_vs_branch: Float[Array, "B K"]  # INIT rewards vs branch stats (literal mode)
  n_init: Float[Array, "B"]
  n_branch: Float[Array, "B"]
  init_flat: Bool[Array, "B"]  # the init group's std is ~0
  branch_flat: Bool[Array, "B"]


def _stats(r: Float[Array, "B K"], mask: Bool[Array, "B K"], ddof: int):
  ids = jnp.where(mask, 0, -1)  # one group per tree
  mean = segment.segment_mean(r, ids, 1)[:, 0]
  std = segment.segment_std(r, ids, 1, ddof=ddof)[:, 0]
  return mean, std, segment.segment_count(ids, 1)[:, 0]


def _groups(batch: TreeBatch, st: TreeStructure, config: APPOConfig) -> _Groups:
  r = batch.leaf_rewards(config.outcome_channel)
  is_init = _init_leaves(batch, st)
  is_branch = st.leaf_valid & (batch.leaf_tag == int(LeafTag.BRANCH))
  mu_i, sd_i, n_i = _stats(r, is_init, config.std_ddof)
  mu_b, sd_b, n_b = _stats(r, is_branch, config.std_ddof)
  if not config.dual_group:
    # "w/o dual-group": one pooled mean and std over all M rollouts (§2.7).
    mu_i, sd_i, _ = _stats(r, is_init | is_branch, config.std_ddof)
    mu_b, sd_b = mu_i, sd_i

  def z(mu, sd):
    # (R - mu) / (sd + eps), exactly 0 for a group without spread.
    ok = (sd > segment.STD_FLOOR)[:, None]
    return jnp.where(ok, (r - mu[:, None]) / (sd[:, None] + config.std_eps), 0.0)

  return _Groups(
      z_init=jnp.where(is_init, z(mu_i, sd_i), 0.0),
      z_branch=jnp.where(is_branch, z(mu_b, sd_b), 0.0),
      z_init_vs_branch=jnp.where(is_init, z(mu_b, sd_b), 0.0),
      n_init=n_i, n_branch=n_b,
      init_flat=sd_i <= segment.STD_FLOOR, branch_flat=sd_b <= segment.STD_FLOOR)


def dual_group_zscores(
    batch: TreeBatch, config: APPOConfig, st: TreeStructure | None = None
) -> tuple[Float[Array, "B K"], Float[Array, "B K"]]:
  """z_I of the INIT leaves and z_B of the BRANCH leaves (spec §2.7).

    z_I(n) = (R_n - mu_I) / (sigma_I + eps),  z_B(b) = (R_b - mu_B) / (sigma_B + eps)

  each 0 when its group's std is ~0 and on leaves of the other tag. With
  `dual_group=False` both use the pooled mean and std of all M rollouts.
  """
  st = derived.structure(batch) if st is None else st
  g = _groups(batch, st, config)
  return g.z_init, g.z_branch


def _coverage(st: TreeStructure, is_branch: Bool[Array, "B K"], z_branch: Float[Array, "B K"]):
  """|S(n)| and sum_{b in S(n)} z_B(b) per node: BRANCH leaves below node n."""
  cover = (st.leaves_under & is_branch[:, None, :]).astype(jnp.float32)  # [B, N, K]
  return cover.sum(-1), jnp.einsum("bnk,bk->bn", cover, z_branch)


def base_advantages(
    batch: TreeBatch, config: APPOConfig, st: TreeStructure | None = None
) -> Float[Array, "B N K"]:
  """Dual-group base advantage A_base of every policy node on every INIT path (Eq. 6).

  With S(n) the BRANCH leaves below node n (the branches whose shared prefix
  contains node n's tokens) and zB(n) = mean_{b in S(n)} z_B(b):

    literal:       A = 1/2 [ (R_n - mu_I)/sigma_I + (R_n - mu_B)/sigma_B ]   (z_I if no branch)
    avg_flowback:  A = 1/2 [ z_I(n) + zB(node) ]  if S(node) != {}, else z_I(n)
    code_sum:      A = z_I(n) + zB(node)          if S(node) != {}, else z_I(n)

  Returns:
    `[B, N, K]`: A_base[b, node, k] for policy nodes on INIT leaf k's path,
    0 on prompt/env nodes, off-path nodes, BRANCH leaves and padding.
  """
  st = derived.structure(batch) if st is None else st
  return _base_advantages(batch, st, config, _groups(batch, st, config))


def _base_advantages(batch, st, config, g: _Groups) -> Float[Array, "B N K"]:
  is_init = _init_leaves(batch, st)
  is_branch = st.leaf_valid & (batch.leaf_tag == int(LeafTag.BRANCH))
  z_i = g.z_init[:, None, :]  # [B, 1, K]
  if config.base_adv_mode == "literal":
    # Averaging over the non-empty groups only: with no branch at all Eq. 6
    # has a single group and reduces to z_I (our choice, NOT STATED).
    both = 0.5 * (g.z_init + g.z_init_vs_branch)
    adv = jnp.where((g.n_branch > 0)[:, None], both, g.z_init)[:, None, :]
  else:
    n_cov, z_sum = _coverage(st, is_branch, g.z_branch)
    z_b = (z_sum / jnp.maximum(n_cov, 1.0))[:, :, None]  # [B, N, 1]
    covered = (n_cov > 0)[:, :, None]
    mixed = 0.5 * (z_i + z_b) if config.base_adv_mode == "avg_flowback" else z_i + z_b
    adv = jnp.where(covered, mixed, z_i)
  on = st.leaves_under & st.is_policy[:, :, None] & is_init[:, None, :]
  return jnp.where(on, adv, 0.0)


# ----------------------------------------------------------------------------
# The registered estimator
# ----------------------------------------------------------------------------


def _safe_mean(x, mask, weight=None) -> Float[Array, ""]:
  """Mean of x over mask (optionally weighted); 0 when the mask is empty."""
  w = mask.astype(jnp.float32) * (1.0 if weight is None else weight)
  return ((x * w).sum() / jnp.maximum(w.sum(), 1e-9)).astype(jnp.float32)


@registry.register(AdvEstimator.APPO, APPOConfig, inputs=("logp", "entropy"))
def appo_advantages(
    batch: TreeBatch,
    config: APPOConfig,
    *,
    logp: Float[Array, "B L"],
    entropy: Float[Array, "B L"],
) -> Advantages:
  """APPO advantages: A_{n,i} = A_base_{n,i} * (1 + b * A_fut_{n,i}) (Eqs. 6-7).

    A_fut_{n,i} = clip(Omega_{n,i}, c_lo, c_hi)   (Eq. 7; Omega from Eq. 4)

  Only the INIT rollouts are trained (`leaf_mask`); branches enter through the
  dual-group statistics and, for `avg_flowback`/`code_sum`, through the
  coverage of the prefix they share. `entropy` feeds the Branching Score
  logs; the branch points themselves are chosen by the rollout strategy with
  `branching_score` and `select_branch_points`.

  Args:
    batch: packed APPO trees (leaf_tag INIT / BRANCH).
    config: APPOConfig.
    logp: `[B, L]` log-probs of the sampled tokens under the current
      mini-batch policy pi_theta (behavior_logp holds pi_old's).
    entropy: `[B, L]` current-policy token entropies.

  Returns:
    Advantages with node_leaf `[B, N, K]` = A_base on INIT paths (0 for
    BRANCH leaves), token_scale `[B, L]` = 1 + b * A_fut on the INIT paths'
    policy tokens (stop-gradient; 1 elsewhere), leaf_mask = INIT leaves, the
    spec §4.2 LOG metrics, and extras["omega"] `[B, L]`.
  """
  st = derived.structure(batch)
  is_init = _init_leaves(batch, st)
  is_branch = st.leaf_valid & (batch.leaf_tag == int(LeafTag.BRANCH))
  g = _groups(batch, st, config)
  node_leaf = _base_advantages(batch, st, config, g)

  idx, log_fut = _init_path_log_future(batch, st, logp, config)
  excl = _exclusive_init_tokens(batch, st, is_init)
  omega = jnp.exp(jnp.where(excl, _scatter_paths(log_fut, idx, batch.tokens.shape[1]), 0.0))
  omega = lax.stop_gradient(omega)  # A_fut is a constant weight (spec §2.8)
  lo, hi = config.fut_clip
  scaled = excl & batch.loss_mask
  token_scale = jnp.where(scaled, 1.0 + config.b * jnp.clip(omega, lo, hi), 1.0)

  # --- spec §4.2 LOG metrics --------------------------------------------------
  score, fell_back = _branching_paths(batch, idx, log_fut, entropy, config, None)
  has_valid = score.valid.any(-1) | fell_back
  tree_has_init = g.n_init > 0
  tree_has_branch = g.n_branch > 0
  n_cov, _ = _coverage(st, is_branch, g.z_branch)
  on_init = (st.leaves_under & is_init[:, None, :]).any(-1) & st.is_policy  # [B, N]
  r = batch.leaf_rewards(config.outcome_channel)
  metrics = {
      "omega_mean": _safe_mean(omega, scaled),
      "fut_clip_frac": _safe_mean((omega < lo) | (omega > hi), scaled),
      "fallback_frac": _safe_mean(fell_back, has_valid),
      "z_init_zero_std_rate": _safe_mean(g.init_flat, tree_has_init),
      "z_branch_zero_std_rate": _safe_mean(g.branch_flat, tree_has_branch),
      # mean |S(n, i)| over the policy tokens of the initial rollouts
      "coverage_mean": _safe_mean(n_cov, on_init, weight=st.node_policy_tokens),
      "reward_mean_init": _safe_mean(r, is_init),
      "reward_mean_branch": _safe_mean(r, is_branch),
  }
  if config.num_branches > 0:
    points = select_branch_points(score.bs, score.z_fut, score.z_ent, score.valid,
                                  config.num_branches, config.bs_require_both_positive)
    picked = jnp.maximum(points, 0)
    both = (jnp.take_along_axis(score.z_fut, picked, -1) > 0) & (
        jnp.take_along_axis(score.z_ent, picked, -1) > 0)
    metrics["bs_both_positive_frac"] = _safe_mean(both, points >= 0)
  metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
  return Advantages(node_leaf=node_leaf, token_scale=token_scale, leaf_mask=is_init,
                    metrics=metrics, extras={"omega": omega})
