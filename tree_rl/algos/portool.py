"""PORTool advantages: step rewards on a rewarded tree, trajectory- and
fork-relative z-scores blended by Theorem 3.1 (PORTool, arXiv 2510.26020: §3.2 Steps 2-3,
Eqs. 2-3, Theorem 3.1 and its proof in App. B). The readings tree_rl chose where the paper
is open are in docs/methods/portool.md.

Tree conventions. A PORTool step s_{j,t} is a POLICY node. Its step-level
parent par(s) is its nearest strict ancestor that is a policy node, or the
root (node 0) when there is none; env nodes (tool output) are context only.
A leaf k is trajectory tau_k and m(s) is the set of leaves under s. Then

  t(s)     = number of policy nodes among the ancestors-or-self of s (depth),
  T_k      = number of policy nodes on leaf k's path,
  |s|      = policy tokens of s,  |tau_k| = policy tokens on leaf k's path,
  C(p)     = step-level children of p (nodes s with par(s) = p),
  F        = {p : |C(p)| >= 2}, p a policy node, or the root if root_is_fork,
  n        = number of leaves of the tree.

Algorithm 1 makes every step one policy node followed by its tool output. A
general tree may hold a chain of policy nodes (a split step); each counts as
a step of its own, all but the last with a single step child, so they add to
T_k and only the first can be a fork child.

Kernel outline: masked [B, N], [B, N, N] and [B, N, K] reductions with static
shapes, the sibling groups given by a one-hot of the step-level parent (no
loop over nodes, forks or leaves):
  1. step structure: t, T_k, par(s), |C(p)|, F;
  2. step rewards (Eq. 2) with the G rule of §3.2 Step 2 (read as in
     docs/methods/portool.md#step-reward-g-rule);
  3. A_trj over the leaves and A_fork over the siblings of each fork (§3.2 Step 3);
  4. omega_2 (Theorem 3.1) and Eq. 3, written per (step, trajectory).

The output is `node_leaf[b, s, k]` = Eq. 3's A for step s inside trajectory
k; it differs between the copies of a shared step because omega_2 holds
|tau_k|. `extras` carries the two parts for App. B's two-term surrogate.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp

from tree_rl.algos.registry import (AdvEstimator, Advantages, check_choice,
                                    check_reward_channels, register)
from tree_rl.tree import segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import TreeStructure, structure
from tree_rl.tree.types import Array, Bool, Float, Int

G_RULES = ("adaptive", "max", "avg", "mix2")
OMEGA_MODES = ("theorem", "traj_only", "fork_only", "no_scale")


@dataclasses.dataclass(frozen=True)
class PORToolConfig:
  """PORTool advantage settings (PORTool §3.2, §4.3; defaults: docs/methods/portool.md)."""

  gamma: float = 0.95  # best value of the gamma ablation (PORTool §4.3.1, Fig. 3)
  fm_half_range: float = 0.25  # the stated range [-0.25, 0.25] (§3.2 Step 2)
  # The node "format" channel holds the raw rubric in [0, 1] and is rescaled
  # R_fm = h (2 raw - 1) (docs/methods/portool.md#formatting-reward-scale);
  # False reads it as R_fm directly.
  format_is_raw: bool = True
  g_rule: str = "adaptive"  # Eq. 2's G (docs/methods/portool.md#step-reward-g-rule)
  # Tie tolerance of the G test (docs/methods/portool.md#g-rule-tie-tolerance).
  # 1e-9 would suit float64. The kernels run in float32, whose
  # spacing near |R| ~ 1 is 1.2e-7: two mathematically equal Rmax computed
  # along different paths (gamma^a R_out + R_fm) can differ by a few ulps, and
  # 1e-9 would flip such ties to G = max on noise. 1e-6 covers that round-off
  # and stays orders of magnitude below real reward gaps (rescaled rubric
  # steps are >= ~3e-3; gamma^a - gamma^b is ~1e-2 or more for gamma <= 0.99).
  g_tie_tol: float = 1e-6
  root_is_fork: bool = True  # docs/methods/portool.md#root-as-a-fork
  std_ddof: int = 0  # population std (docs/methods/portool.md#z-score-convention)
  std_eps: float = 1e-6  # verl's epsilon (docs/methods/portool.md#z-score-convention)
  omega_mode: str = "theorem"  # §4.3.2 ablations: theorem | traj_only | fork_only | no_scale
  reward_channels: tuple[str, ...] = ("outcome",)  # leaf channels summed into R_out (ours)
  format_channel: str = "format"  # node channel of the rubric (our choice)

  def __post_init__(self):
    if not 0.0 <= self.gamma <= 1.0:
      raise ValueError(f"PORToolConfig.gamma={self.gamma} must be in [0, 1] (PORTool Eq. 2)")
    if not self.fm_half_range >= 0.0:
      raise ValueError(f"PORToolConfig.fm_half_range={self.fm_half_range} must be >= 0")
    check_choice("PORToolConfig", "g_rule", self.g_rule, G_RULES)
    if not self.g_tie_tol >= 0.0:
      raise ValueError(f"PORToolConfig.g_tie_tol={self.g_tie_tol} must be >= 0")
    check_choice("PORToolConfig", "std_ddof", self.std_ddof, (0, 1))
    if not self.std_eps >= 0.0:
      raise ValueError(f"PORToolConfig.std_eps={self.std_eps} must be >= 0")
    check_choice("PORToolConfig", "omega_mode", self.omega_mode, OMEGA_MODES)
    for name in ("format_is_raw", "root_is_fork"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"PORToolConfig.{name}={getattr(self, name)!r} must be a bool")
    check_reward_channels("PORToolConfig", self.reward_channels)
    if not isinstance(self.format_channel, str) or not self.format_channel:
      raise ValueError(f"PORToolConfig.format_channel must name a reward channel, got "
                       f"{self.format_channel!r}")


@flax.struct.dataclass
class PORToolParams:
  """The numeric settings of a PORToolConfig as arrays.

  The kernel reads its knobs from here, not from Python values, so one
  compiled `portool_kernel` serves every setting: a gamma or
  G-rule sweep, or a test of every ablation, needs no recompile. Under the
  registry's jit, where the config is static, these are constants that XLA
  folds away.
  """

  gamma: Float[Array, ""]
  fm_half_range: Float[Array, ""]
  format_is_raw: Bool[Array, ""]
  g_rule: Int[Array, ""]  # index into G_RULES
  g_tie_tol: Float[Array, ""]
  root_is_fork: Bool[Array, ""]
  std_ddof: Float[Array, ""]
  std_eps: Float[Array, ""]
  omega_mode: Int[Array, ""]  # index into OMEGA_MODES

  @classmethod
  def from_config(cls, config: PORToolConfig) -> "PORToolParams":
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return cls(
        gamma=f32(config.gamma), fm_half_range=f32(config.fm_half_range),
        format_is_raw=jnp.asarray(config.format_is_raw),
        g_rule=jnp.asarray(G_RULES.index(config.g_rule), jnp.int32),
        g_tie_tol=f32(config.g_tie_tol), root_is_fork=jnp.asarray(config.root_is_fork),
        std_ddof=f32(config.std_ddof), std_eps=f32(config.std_eps),
        omega_mode=jnp.asarray(OMEGA_MODES.index(config.omega_mode), jnp.int32))


@dataclasses.dataclass(frozen=True)
class _Steps:
  """Step-level structure of each tree (plain container, built under jit)."""

  is_step: Bool[Array, "B N"]  # valid policy node
  on_path: Bool[Array, "B N K"]  # step n lies on leaf k's path
  depth: Int[Array, "B N"]  # t(s), first steps 1
  num_steps: Int[Array, "B K"]  # T_k
  child_of: Bool[Array, "B N N"]  # [b, s, p]: s is a step with par(s) = p
  num_children: Float[Array, "B N"]  # |C(p)|
  is_fork: Bool[Array, "B N"]  # p in F
  fork_child: Bool[Array, "B N"]  # par(s) in F


def _steps(st: TreeStructure, root_is_fork: Bool[Array, ""]) -> _Steps:
  """Step-level parents, depths and forks from the ancestor matrix."""
  n = st.node_valid.shape[1]
  idx = jnp.arange(n)
  is_step = st.is_policy & st.node_valid
  depth = (st.ancestor & is_step[:, None, :]).sum(-1).astype(jnp.int32)
  on_path = st.leaves_under & is_step[:, :, None]
  num_steps = on_path.sum(1).astype(jnp.int32)
  # Parents precede children, so along a root-to-node path indices increase:
  # the nearest strict policy ancestor is the one with the largest index, and
  # 0 (the root) is the fallback when there is none.
  strict = st.ancestor & (idx[:, None] != idx[None, :])
  parent = jnp.max(jnp.where(strict & is_step[:, None, :], idx, 0), axis=-1)
  parent = jnp.where(is_step, parent, -1)
  # Sibling groups as a dense [N, N] one-hot (the footprint of the ancestor
  # matrix) rather than scatter-based segment ops: every group reduction
  # below is then a masked reduction that XLA fuses.
  child_of = parent[:, :, None] == idx[None, None, :]
  num_children = child_of.sum(1).astype(jnp.float32)
  is_root = (idx == 0) & st.node_valid
  can_fork = is_step | (is_root & root_is_fork)
  is_fork = can_fork & (num_children >= 2)
  fork_child = (child_of & is_fork[:, None, :]).any(-1)
  return _Steps(is_step, on_path, depth, num_steps, child_of, num_children, is_fork, fork_child)


def _to_children(per_parent: Array, child_of: Bool[Array, "B N N"]) -> Array:
  """x[par(s)] for every step s (0 / False off steps), as a masked reduction."""
  if per_parent.dtype == jnp.bool_:
    return (child_of & per_parent[:, None, :]).any(-1)
  return jnp.where(child_of, per_parent[:, None, :], 0.0).sum(-1)


def group_zscore(
    x: Float[Array, "B X"],
    member: Bool[Array, "B X G"],
    ddof: Float[Array, ""] | float,
    eps: Float[Array, ""] | float,
) -> Float[Array, "B X"]:
  """norm(x, S) of PORTool §3.2 Step 3 within groups given as a membership mask.

  z_i = (x_i - mean_g) / (std_g + eps) for the group g holding i (each i is in
  at most one group), std with `ddof`; 0 for i in no group and for groups
  whose std is <= segment.STD_FLOOR (all equal, or too few members for ddof).
  """
  cnt = member.sum(1).astype(jnp.float32)  # [B, G]
  mean = jnp.where(member, x[:, :, None], 0.0).sum(1) / jnp.maximum(cnt, 1.0)
  dev = jnp.where(member, x[:, :, None] - mean[:, None, :], 0.0)  # [B, X, G]
  var = (dev * dev).sum(1) / jnp.maximum(cnt - ddof, 1.0)
  std = jnp.sqrt(jnp.where(cnt > ddof, var, 0.0))
  spread = member & (std > segment.STD_FLOOR)[:, None, :]
  return jnp.where(spread, dev / (std + eps)[:, None, :], 0.0).sum(-1)


def step_rewards(
    r_out: Float[Array, "B K"], fm: Float[Array, "B N"], sp: _Steps, params: PORToolParams
) -> tuple[Float[Array, "B N"], Bool[Array, "B N"]]:
  """Step reward R(s) (Eq. 2) with the per-fork G rule (docs/methods/portool.md#step-reward-g-rule).

  v_k(s) = gamma^(T_k - t(s)) R_out(tau_k) + R_fm(s)   for k in m(s),
  Rmax(s) = max_k v_k(s),  Ravg(s) = mean_k v_k(s).
  adaptive: all children of p use G = max unless |C(p)| < 2 or every
  Rmax(c), c in C(p), ties within g_tie_tol (then G = avg). mix2 runs the same
  test on the outcome-only maxima max_k gamma^(T_k - t) R_out and adds R_fm.
  R_fm does not depend on k, so Rmax = max_k(outcome part) + R_fm.

  Args:
    r_out: outcome reward of each leaf (0 on padding).
    fm: the node format channel (raw rubric or R_fm, per format_is_raw).

  Returns:
    R [B, N] (meaningful on steps) and use_max [B, N] per parent p (G = max).
  """
  r_fm = jnp.where(params.format_is_raw, params.fm_half_range * (2.0 * fm - 1.0), fm)
  to_go = jnp.maximum(sp.num_steps[:, None, :] - sp.depth[:, :, None], 0)
  out_part = jnp.power(params.gamma, to_go.astype(jnp.float32)) * r_out[:, None, :]  # [B,N,K]
  count = sp.on_path.sum(-1)
  max_out = jnp.where(sp.on_path, out_part, -jnp.inf).max(-1)
  max_out = jnp.where(count > 0, max_out, 0.0)
  avg_out = jnp.where(sp.on_path, out_part, 0.0).sum(-1) / jnp.maximum(count, 1)
  r_max, r_avg = max_out + r_fm, avg_out + r_fm

  rule = params.g_rule
  test = jnp.where(rule == G_RULES.index("mix2"), max_out, r_max)[:, :, None]
  hi = jnp.where(sp.child_of, test, -jnp.inf).max(1)  # [B, N] per parent
  lo = jnp.where(sp.child_of, test, jnp.inf).min(1)
  adaptive = (sp.num_children >= 2) & (hi - lo > params.g_tie_tol)
  use_max = jnp.where(rule == G_RULES.index("max"), True,
                      jnp.where(rule == G_RULES.index("avg"), False, adaptive))
  return jnp.where(_to_children(use_max, sp.child_of), r_max, r_avg), use_max


def portool_kernel(
    batch: TreeBatch,
    params: PORToolParams,
    reward_channels: tuple[str, ...] = ("outcome",),
    format_channel: str = "format",
) -> Advantages:
  """PORTool's per-(step, trajectory) advantage (Eq. 3 with Theorem 3.1).

  A_trj(tau_j)  = norm(R_out(tau_j), {R_out(tau_k)}_{k in [n]})
  A_fork(s)     = norm(R(s), {R(c)}_{c in C(par s)})          if par(s) in F
  omega_2(j, s) = n |tau_j| / (|m(s)| |s| |C(par s)| n_forks)   (Theorem 3.1)
  A(j, s)       = omega_1 mean_{k in m(s)} A_trj(tau_k) + omega_2(j, s) A_fork(s)  (Eq. 3)

  norm is a z-score with `std_ddof` and `std_eps`; a group whose std is 0
  gives 0. Steps that are not children of a fork, and every step when
  n_forks = 0, get no fork term (App. B; docs/methods/portool.md#trees-without-forks).
  omega_mode picks
  (omega_1, omega_2) per the Sec. 4.3.2 ablation: theorem (1, Thm 3.1),
  traj_only (1, 0), fork_only (0, Thm 3.1), no_scale (1, 1).

  Args:
    batch: packed trees; R_out is the sum of the leaf channels `reward_channels`, and
      node channel `format_channel` holds the rubric of each step.
    params: the numeric settings (`PORToolParams.from_config`).
    reward_channels, format_channel: channel names (static).

  Returns:
    Advantages with node_leaf [B, N, K] (0 off-path, on prompt/env nodes and
    padding), token_scale None (ones), leaf_mask = valid leaves, extras
    "trajectory_term" [B, N, K] (omega_1 mean A_trj), "fork_term" [B, N, K]
    (omega_2 A_fork), "omega2" [B, N, K] (the omega_2 applied), "fork_adv"
    [B, N] (A_fork, unscaled), and scalar metrics.
  """
  st = structure(batch)
  sp = _steps(st, params.root_is_fork)
  ddof, eps = params.std_ddof, params.std_eps

  # Step 3 of the method: trajectory- and fork-relative advantages (§3.2 Step 3).
  r_out = batch.leaf_rewards(*reward_channels)
  a_trj = group_zscore(r_out, st.leaf_valid[:, :, None], ddof, eps)  # [B, K]
  m_count = st.num_leaves_under.astype(jnp.float32)  # |m(s)|
  trj_mean = jnp.einsum("bnk,bk->bn", st.leaves_under.astype(jnp.float32), a_trj)
  trj_mean = trj_mean / jnp.maximum(m_count, 1.0)

  r_step, use_max = step_rewards(r_out, batch.node_rewards(format_channel), sp, params)
  siblings = sp.child_of & sp.is_fork[:, None, :]  # groups: the children of each fork
  a_fork = group_zscore(r_step, siblings, ddof, eps)  # [B, N]

  # Theorem 3.1: omega_2 is the ratio of a child token's weight in the
  # fork-wise GRPO objective to its weight in one trajectory copy of Eq. 1.
  n_leaves = st.leaf_valid.sum(-1).astype(jnp.float32)  # n
  n_forks = sp.is_fork.sum(-1).astype(jnp.float32)
  c_par = _to_children(sp.num_children, sp.child_of)  # |C(par s)|
  node_den = m_count * st.node_policy_tokens.astype(jnp.float32) * c_par
  den = node_den[:, :, None] * n_forks[:, None, None]
  tau = st.path_policy_tokens.astype(jnp.float32)
  omega2_thm = n_leaves[:, None, None] * tau[:, None, :] / jnp.maximum(den, 1.0)
  fork_mask = sp.on_path & sp.fork_child[:, :, None] & (n_forks > 0)[:, None, None]
  mode = params.omega_mode
  omega1 = jnp.where(mode == OMEGA_MODES.index("fork_only"), 0.0, 1.0)
  omega2 = jnp.where(mode == OMEGA_MODES.index("traj_only"), 0.0,
                     jnp.where(mode == OMEGA_MODES.index("no_scale"), 1.0, omega2_thm))
  omega2 = jnp.where(fork_mask, omega2, 0.0)

  traj_term = jnp.where(sp.on_path, omega1 * trj_mean[:, :, None], 0.0)
  fork_term = jnp.where(fork_mask, omega2 * a_fork[:, :, None], 0.0)
  node_leaf = traj_term + fork_term  # Eq. 3

  metrics = _metrics(st, sp, r_out, use_max, omega2, fork_mask)
  extras = {"trajectory_term": traj_term, "fork_term": fork_term, "omega2": omega2,
            "fork_adv": jnp.where(sp.fork_child, a_fork, 0.0)}
  return Advantages(node_leaf=node_leaf, leaf_mask=st.leaf_valid, metrics=metrics, extras=extras)


@register(AdvEstimator.PORTOOL, PORToolConfig)
def portool_advantages(batch: TreeBatch, config: PORToolConfig) -> Advantages:
  """The registered PORTool estimator: `portool_kernel` under `config`."""
  return portool_kernel(batch, PORToolParams.from_config(config), config.reward_channels,
                        config.format_channel)


def _metrics(
    st: TreeStructure,
    sp: _Steps,
    r_out: Float[Array, "B K"],
    use_max: Bool[Array, "B N"],
    omega2: Float[Array, "B N K"],
    fork_mask: Bool[Array, "B N K"],
) -> dict[str, Float[Array, ""]]:
  """Batch scalars for the logs (docs/methods/portool.md#logged-metrics)."""
  tree_ok = st.node_valid[:, 0]
  n_trees = jnp.maximum(tree_ok.sum(), 1).astype(jnp.float32)
  n_forks = sp.is_fork.sum(-1).astype(jnp.float32)
  all_forks = jnp.maximum(sp.is_fork.sum(), 1).astype(jnp.float32)
  n_w = jnp.maximum(fork_mask.sum(), 1).astype(jnp.float32)
  n_leaves = jnp.maximum(st.leaf_valid.sum(-1), 1)
  mean = jnp.where(st.leaf_valid, r_out, 0.0).sum(-1, keepdims=True) / n_leaves[:, None]
  std = jnp.sqrt(jnp.where(st.leaf_valid, (r_out - mean) ** 2, 0.0).sum(-1) / n_leaves)
  return {
      "n_forks_mean": (n_forks * tree_ok).sum() / n_trees,
      "fork_avg_frac": (sp.is_fork & ~use_max).sum() / all_forks,
      # Over the (fork child, trajectory) pairs: the omega_2 actually applied.
      "omega2_mean": jnp.where(fork_mask, omega2, 0.0).sum() / n_w,
      "omega2_max": jnp.where(fork_mask, omega2, 0.0).max(),
      "zero_std_frac": (tree_ok & (std <= segment.STD_FLOOR)).sum() / n_trees,
  }
