"""APPO: Agentic Procedural Policy Optimization (arXiv 2606.12384, §3.2-3.3, Eqs. 3-8).

The readings tree_rl chose where the paper is open are in docs/methods/appo.md.

Three pieces, all jitted kernels over a packed TreeBatch:

1. The future value Omega (APPO Eq. 4) of every token of an initial rollout,
   a gamma-discounted sum of the log-ratios log(pi_theta / pi_old) of the token
   and every later token of its root-to-leaf sequence, exponentiated.
2. The Branching Score BS = Z(clip(Omega)) * Z(ent) (Eq. 5), z-scored within
   each initial rollout, and the top-B branch-point selection (§3.2; the sign
   filter of docs/methods/appo.md#sign-filter).
3. The registered estimator: the dual-group base advantage (Eq. 6, three
   readings: docs/methods/appo.md#base-advantage-reading) on the initial
   rollouts' policy tokens, and the future-aware token scale
   1 + b * clip(Omega, c_lo, c_hi) (Eq. 7, §3.3), so
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
import numpy as np
from jax import lax

from tree_rl.algos import registry
from tree_rl.algos.registry import AdvEstimator, Advantages, check_choice
from tree_rl.tree import derived, segment
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.derived import TreeStructure
from tree_rl.tree.types import Array, Bool, Float, Int, LeafTag

# The log of Omega is clamped to +-20 before exp so that long runs of large
# log-ratios cannot overflow (docs/methods/appo.md#future-value-clamp).
LOG_FUTURE_CLAMP = 20.0
# Token-level z-scores (Eq. 5) are 0 when the rollout's std is below this
# (docs/methods/appo.md#zero-spread-z-scores). Reward z-scores use
# segment.STD_FLOOR like every other estimator.
BS_STD_FLOOR = 1e-8

BASE_ADV_MODES = ("literal", "avg_flowback", "code_sum")
BS_MODES = ("bs", "entropy", "future")
FIRST_MINIBATCH_FALLBACKS = ("entropy", "skip_branching")


@dataclasses.dataclass(frozen=True)
class APPOConfig:
  """APPO advantage options: the paper's values (APPO §4.1, App. C) where it gives them,
  otherwise tree_rl's choices (docs/methods/appo.md)."""

  n_init: int = 4  # N, "initial sampling size" (APPO App. C).
  budget: int = 16  # M, "global rollout size" (APPO App. C); B = M/N - 1 = 3.
  tau_half: float = 32.0  # half-life of the decay, gamma = 2^(-1/tau) (APPO §4.1).
  fut_clip: tuple[float, float] = (1.0, 1.2)  # [c_lo, c_hi], the implementation's clip (App. C).
  b: float = 0.5  # weight of the future-aware term (APPO §3.3, App. C).
  # Eq. 6 reading: docs/methods/appo.md#base-advantage-reading.
  base_adv_mode: str = "avg_flowback"
  # False = the "w/o dual-group" ablation (docs/methods/appo.md#pooled-ablation).
  dual_group: bool = True
  bs_mode: str = "bs"  # "bs" (Eq. 5) | "entropy" (ablation, §4.3) | "future" (App. D).
  bs_require_both_positive: bool = True  # docs/methods/appo.md#sign-filter
  first_minibatch_fallback: str = "entropy"  # docs/methods/appo.md#first-minibatch-fallback
  std_ddof: int = 0  # population std (docs/methods/appo.md#zero-spread-z-scores).
  std_eps: float = 1e-6  # reward z-score eps (docs/methods/appo.md#zero-spread-z-scores).
  reward_channels: tuple[str, ...] = ("outcome",)  # leaf channels summed into R_n (our choice)

  def __post_init__(self):
    if not isinstance(self.n_init, int) or self.n_init < 1:
      raise ValueError(f"APPOConfig.n_init must be an int >= 1, got {self.n_init!r}")
    if not isinstance(self.budget, int) or self.budget < self.n_init:
      raise ValueError(
          f"APPOConfig.budget must be an int >= n_init={self.n_init}, got {self.budget!r}")
    if self.budget % self.n_init:
      raise ValueError(
          f"APPOConfig.budget={self.budget} must be a multiple of n_init={self.n_init}"
          " (M = (B + 1) * N at L = 1, APPO §3.2)")
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
    registry.check_reward_channels("APPOConfig", self.reward_channels)

  @property
  def gamma(self) -> float:
    """Token decay of Eq. 4, gamma = 2^(-1/tau_half) (0.97857 at tau_half = 32)."""
    return 2.0 ** (-1.0 / self.tau_half)

  @property
  def num_branches(self) -> int:
    """B, branch points per initial rollout at L = 1: M = (B + 1) N (APPO §3.2)."""
    return self.budget // self.n_init - 1


class BranchingScore(NamedTuple):
  """Per initial-rollout path arrays, `[B, K, P]` (P = batch.max_path_len).

  Index [b, k, p] is position p of leaf k's root-to-leaf sequence (prompt
  included); rows of non-INIT leaves and invalid positions are all 0/False.
  `fell_back` is per rollout, `[B, K]`.
  """

  bs: Float[Array, "B K P"]  # Branching Score (Eq. 5, or its ablation / fallback)
  z_fut: Float[Array, "B K P"]  # Z(clip(Omega, c_lo, c_hi); H_n)
  z_ent: Float[Array, "B K P"]  # Z(ent; H_n)
  valid: Bool[Array, "B K P"]  # candidate branch positions
  fell_back: Bool[Array, "B K"]  # clip(Omega) had ~zero std: the first-minibatch fallback applied


# ----------------------------------------------------------------------------
# Future value (Eq. 4)
# ----------------------------------------------------------------------------

# Width W of the token blocks of the two-level scan in `_future_tokens`: the
# in-block part is one [., W] x [W, W] matmul, the carry between blocks a
# scan with factor gamma^W over the L / W block totals.
SCAN_BLOCK = 32


def _init_leaves(batch: TreeBatch, st: TreeStructure) -> Bool[Array, "B K"]:
  return st.leaf_valid & (batch.leaf_tag == int(LeafTag.INIT))


def _init_path_log_future(
    batch: TreeBatch, st: TreeStructure, logp: Float[Array, "B L"], config: APPOConfig
) -> tuple[Int[Array, "B K P"], Float[Array, "B K P"]]:
  """Packed index and clamped log-Omega of every position of every INIT path.

  The per-rollout form the Branching Score needs (its z-scores run over
  `[B, K, P]` rows): every INIT path is gathered with
  `derived.path_token_index` and scanned, S_i = x_i + gamma S_{i+1}; the
  zero padding past a path's end leaves S unchanged. x_i = log rho_i on
  policy tokens and 0 on prompt and env tokens, which still age the discount
  (docs/methods/appo.md#future-value-distance). On the tokens of exactly
  one INIT path it equals `_future_tokens` (both are tested against the
  O(L^2) definition in tests/algos/ref_appo.py).
  """
  k = batch.leaf_node.shape[1]
  leaf_ids = jnp.where(_init_leaves(batch, st), jnp.arange(k)[None, :], -1)
  idx = derived.path_token_index(batch, st, leaf_ids, batch.max_path_len)
  log_rho = jnp.where(batch.loss_mask, logp - batch.behavior_logp, 0.0)
  x = derived.gather_tokens(log_rho, idx, 0.0)
  s = segment.discounted_reverse_cumsum(x, config.gamma, axis=-1)
  return idx, jnp.clip(s, -LOG_FUTURE_CLAMP, LOG_FUTURE_CLAMP)


def _block_rows(v: Array, idx: Int[Array, "B M"], width: int) -> tuple[Array, Int[Array, "B M"]]:
  """The `width`-token block of `v [B, L']` holding packed index idx, and idx's offset in it.

  idx = L' (one past the end) maps to the last block at offset `width`.
  """
  b, lp = v.shape
  blk = jnp.minimum(idx // width, lp // width - 1)
  rows = jnp.take_along_axis(v.reshape(b, lp // width, width), blk[:, :, None], axis=1)
  return rows, idx - blk * width


def _node_bounds(node_of_token: Int[Array, "B L"], n_nodes: int) -> Int[Array, "B M"]:
  """`[B, N + 1]`: bounds[b, i] is the packed index of node i's first token.

  Node i owns the packed tokens [bounds[i], bounds[i + 1]) (depth-first
  packing keeps a node's tokens contiguous and in node order, padding last),
  so bounds[i] counts the tokens of nodes < i. Searched on the first token
  of every SCAN_BLOCK-token block, then counted inside the one block where
  node i starts: nothing of size L is written or carried through a loop.
  """
  width = SCAN_BLOCK
  b, l = node_of_token.shape
  nb = -(-l // width)
  if nb * width != l:
    node_of_token = jnp.pad(node_of_token, ((0, 0), (0, nb * width - l)), constant_values=-1)
  key = lambda v: jnp.where(v >= 0, v, n_nodes)  # padding sorts last
  want = jnp.arange(n_nodes + 1, dtype=jnp.int32)
  heads = key(node_of_token[:, ::width])  # [B, J]
  n_heads = jax.vmap(lambda h: jnp.searchsorted(h, want, side="left"))(heads)  # heads < i
  blk = jnp.maximum(n_heads - 1, 0)  # node i starts in this block (if n_heads > 0)
  rows, _ = _block_rows(node_of_token, blk * width, width)
  inside = (key(rows) < want[None, :, None]).sum(-1, dtype=jnp.int32)
  return jnp.where(n_heads > 0, blk * width + inside, 0).astype(jnp.int32)


def _node_to_tokens(values: Array, node_of_token: Int[Array, "B L"]) -> Array:
  """`[B, L]` values[b, node_of_token[b, t]] of a `[B, N]` table (padding reads node 0)."""
  return jnp.take_along_axis(values, jnp.maximum(node_of_token, 0), axis=1)


def _suffix_at(
    x: Float[Array, "B J W"], after: Float[Array, "B J"], idx: Int[Array, "B M"], log_gamma: float
) -> Float[Array, "B M"]:
  """G_i = sum_{t >= i} gamma^(t - i) x_t at packed indices idx (0 at the end).

  `after[b, j]` is G at the first token of block j + 1 (0 after the last).
  """
  b, nb, width = x.shape
  rows, off = _block_rows(x.reshape(b, nb * width), idx, width)
  d = jnp.arange(width)[None, None, :] - off[:, :, None]
  inside = jnp.where(d >= 0, jnp.exp(jnp.maximum(d, 0) * log_gamma) * rows, 0.0).sum(-1)
  carry = jnp.take_along_axis(after, jnp.minimum(idx // width, nb - 1), axis=1)
  return jnp.where(idx < nb * width, inside + jnp.exp((width - off) * log_gamma) * carry, 0.0)


def _block_carry(totals: Float[Array, "B J"], width: int, log_gamma: float) -> Float[Array, "B J"]:
  """G at the first token of the next block, from the blocks' in-block sums.

  G at block j's start is totals_j + gamma^W G at block j + 1's: a reverse
  scan over the L / W blocks, as a log-depth associative scan of the affine
  maps s -> a s + c (a sequential scan would take L / W dependent steps).
  The factors are <= gamma^W = 2^(-W / tau_half), so round-off does not
  build up.
  """
  decay = jnp.full(totals.shape, math.exp(width * log_gamma), totals.dtype)
  # (a1, c1) after (a2, c2) in scan order: the nearer block is applied last.
  compose = lambda far, near: (far[0] * near[0], near[1] + near[0] * far[1])
  _, starts = lax.associative_scan(compose, (decay, totals), reverse=True, axis=1)
  return jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))


def _in_block_scan(x: Float[Array, "B J W"], log_gamma: float) -> Float[Array, "B J W"]:
  """sum_{c' >= c} gamma^(c' - c) x[b, j, c'] within every W-token block.

  One matmul with D[c', c] = gamma^(c' - c) [c' >= c]: O(W) work per token,
  float32 throughout (HIGHEST: no reduced-precision passes on accelerators).
  """
  b, nb, width = x.shape
  c = np.arange(width)
  dmat = np.where(c[:, None] >= c[None, :], np.exp(np.maximum(c[:, None] - c[None, :], 0)
                                                   * log_gamma), 0.0).astype(np.float32)
  return jnp.dot(x.reshape(b * nb, width), dmat,
                 precision=lax.Precision.HIGHEST).reshape(b, nb, width)


class _Future(NamedTuple):
  """`_future_tokens` output."""

  omega: Float[Array, "B L"]  # Omega on exclusive tokens, exactly 1 elsewhere
  exclusive: Bool[Array, "B L"]  # token on exactly one INIT leaf's path
  init_count: Int[Array, "B N"]  # INIT leaves whose path passes through each node
  bounds: Int[Array, "B M"]  # [B, N + 1] packed node boundaries (`_node_bounds`)


def _future_tokens(
    batch: TreeBatch, st: TreeStructure, logp: Float[Array, "B L"], config: APPOConfig
) -> _Future:
  """Omega of every token, O(L) on the packed layout (no path gather).

  Omega is defined (and not 1) on the exclusive tokens, those on exactly one
  INIT leaf's path. For such a token t of node n (packed tokens [a_n, e_n),
  sequence positions [p_n, q_n)) the suffix of Eq. 4 splits into node n's
  own tokens and the nodes m strictly below n that are on the same path,
  which are the exclusive nodes below n with an INIT leaf under them (branch-
  only nodes do not count):

    S_t = sum_{t <= t' < e_n} gamma^(t' - t) x_t' + gamma^(e_n - t) Tail_n
    Tail_n = sum_{m below n on the path} gamma^(p_m - q_n) E_m,  E_m = S of m's own tokens at a_m

  With G the discounted suffix sum of the whole packed row, across node
  boundaries, node n's own part is G_t - gamma^(e_n - t) G_{e_n}, so
  S_t = G_t + gamma^(e_n - t) Q_n with Q_n = Tail_n - G_{e_n}. That second
  term is itself the reverse scan of impulses at the nodes' last tokens, so
  S = scan(x + z). The scan is blocked: with the value S takes at the next
  block's first token added as one more impulse at each block's last token,
  S is the in-block scan (`_in_block_scan`) of x + z. Those carries, and G at
  the node boundaries, come from the blocks' totals (`_block_carry`). So the
  tokens see one reduction and one matmul; the rest is `[B, N, N]` work per
  node pair and `[B, L / W]` per block. x is zeroed off the exclusive tokens
  first: they never enter an exclusive token's sum (what lies below an
  exclusive node on its path is exclusive too), and this keeps branch
  tokens' log-ratios out of the round-off of the rollouts' sums. Decays are
  exp(distance * log gamma) of distances >= 0, in float32.
  """
  b, l = batch.tokens.shape
  n = batch.parent.shape[1]
  width = SCAN_BLOCK
  lg = -math.log(2.0) / config.tau_half  # log gamma
  nb = -(-l // width)
  lp = nb * width

  init_count = (st.leaves_under & _init_leaves(batch, st)[:, None, :]).sum(-1)
  exclusive = (_node_to_tokens(init_count == 1, batch.node_of_token)
               & (batch.node_of_token >= 0))
  x = jnp.where(batch.loss_mask & exclusive, logp - batch.behavior_logp, 0.0)
  x = x.astype(jnp.float32)
  if lp != l:
    x = jnp.pad(x, ((0, 0), (0, lp - l)))

  # G at every node boundary, from the block totals.
  to_start = np.exp(np.arange(width) * lg).astype(np.float32)  # gamma^offset
  totals = (x.reshape(b, nb, width) * to_start).sum(-1)
  after = _block_carry(totals, width, lg)
  bounds = _node_bounds(batch.node_of_token, n)
  first, end = bounds[:, :-1], bounds[:, 1:]
  size = end - first
  g_first = _suffix_at(x.reshape(b, nb, width), after, first, lg)
  g_end = _suffix_at(x.reshape(b, nb, width), after, end, lg)
  own = g_first - jnp.exp(size * lg) * g_end  # E_n (0 for an empty node)
  p_first = jnp.take_along_axis(batch.positions, jnp.minimum(first, l - 1), axis=1)
  p_end = p_first + size

  # Tail_n over [b, n, m]: m strictly below n with an INIT leaf under it.
  below = (jnp.swapaxes(st.ancestor, 1, 2) & ~jnp.eye(n, dtype=bool)[None]
           & (init_count > 0)[:, None, :])
  gap = jnp.maximum(p_first[:, None, :] - p_end[:, :, None], 0)
  tail = jnp.einsum("bnm,bm->bn", jnp.where(below, jnp.exp(gap * lg), 0.0), own,
                    precision=lax.Precision.HIGHEST)
  q = jnp.where(init_count == 1, tail - g_end, 0.0)

  # Impulse z = gamma (Q_n - R) at node n's last token, R = gamma^|m| Q_m the
  # correction the scan carries in from the node m owning the next token.
  nxt = jnp.take_along_axis(batch.node_of_token, jnp.minimum(end, l - 1), axis=1)
  carried = jnp.take_along_axis(q * jnp.exp(size * lg), jnp.maximum(nxt, 0), axis=1)
  z = math.exp(lg) * (q - jnp.where((end < l) & (nxt >= 0), carried, 0.0))
  z = jnp.where(size > 0, z, 0.0)
  last = jnp.clip(end - 1, 0, lp - 1)  # node n's last token (z = 0 for an empty node)

  # Carries of x + z: its block totals add z to the totals of x.
  rows = jnp.arange(b)[:, None]
  totals = totals.at[rows, last // width].add(z * jnp.take(to_start, last % width))
  carry = math.exp(lg) * _block_carry(totals, width, lg)  # gamma S at the next block's start
  ends = jnp.broadcast_to(jnp.arange(nb) * width + width - 1, (b, nb))
  x = x.at[rows, jnp.concatenate([last, ends], axis=1)].add(jnp.concatenate([z, carry], axis=1))
  s = _in_block_scan(x.reshape(b, nb, width), lg).reshape(b, lp)[:, :l]
  log_fut = jnp.clip(s, -LOG_FUTURE_CLAMP, LOG_FUTURE_CLAMP)
  return _Future(jnp.exp(jnp.where(exclusive, log_fut, 0.0)), exclusive, init_count, bounds)


def _node_policy_tokens(batch: TreeBatch, bounds: Int[Array, "B M"]) -> Int[Array, "B N"]:
  """Loss-mask tokens of every node (`TreeStructure.node_policy_tokens`).

  Counts at the node boundaries are whole blocks before plus a partial
  block, so no `[B, L]` cumulative sum is written.
  """
  width = SCAN_BLOCK
  m = batch.loss_mask
  b, l = m.shape
  nb = -(-l // width)
  if nb * width != l:
    m = jnp.pad(m, ((0, 0), (0, nb * width - l)))
  blocks = m.reshape(b, nb, width).sum(-1, dtype=jnp.int32)
  before = lax.associative_scan(jnp.add, blocks, axis=1) - blocks  # (XLA:CPU's cumsum is quadratic)
  rows, off = _block_rows(m, bounds, width)
  part = (rows & (jnp.arange(width)[None, None, :] < off[:, :, None])).sum(-1, dtype=jnp.int32)
  at = jnp.take_along_axis(before, jnp.minimum(bounds // width, nb - 1), axis=1) + part
  return at[:, 1:] - at[:, :-1]


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
  distance i' - i (docs/methods/appo.md#future-value-distance). Computed in
  O(L) on the packed layout
  (`_future_tokens`): a blocked reverse scan over the packed tokens plus
  `[B, N, N]` per-node work; nothing is `[B, L, K]`, `[B, K, P]` or
  `[B, L, L]`.

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
  return _future_tokens(batch, st, logp, config).omega


# ----------------------------------------------------------------------------
# Branching Score (Eq. 5) and branch-point selection (APPO §3.2)
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
) -> BranchingScore:
  """BranchingScore of the gathered INIT paths (`_init_path_log_future`)."""
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
  # mini-batch, where pi_theta = pi_old and Omega == 1), Z(clip Omega) is 0 and
  # Eq. 5 ranks nothing: fall back per rollout
  # (docs/methods/appo.md#first-minibatch-fallback).
  has_valid = valid.any(-1)
  fell_back = fut_flat & has_valid & (config.bs_mode != "entropy")
  fb = fell_back[..., None]
  if config.first_minibatch_fallback == "entropy":
    bs = jnp.where(fb, z_ent, bs)
  else:
    bs = jnp.where(fb, 0.0, bs)
    valid = valid & ~fb
  zero = lambda x: jnp.where(valid, x, 0.0)
  return BranchingScore(zero(bs), zero(z_fut), zero(z_ent), valid, fell_back)


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
  rollout strategy's whitespace/punctuation/EOS filter,
  docs/methods/appo.md#valid-branch-positions).
  `bs_mode="entropy"` gives BS = Z(ent), `"future"` gives BS = Z(clip Omega).
  Fallback (docs/methods/appo.md#first-minibatch-fallback): for a rollout whose
  clip(Omega) has ~zero std,
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
    the leaf's root-to-leaf sequence), all zero/False off INIT rows, and the
    `[B, K]` fallback flags. `branching_metrics` turns it into the Branching
    Score logs (docs/methods/appo.md#logged-metrics).
  """
  st = derived.structure(batch) if st is None else st
  idx, log_fut = _init_path_log_future(batch, st, logp, config)
  return _branching_paths(batch, idx, log_fut, entropy, config, token_mask)


def select_branch_points(
    bs: Float[Array, "B K P"],
    z_fut: Float[Array, "B K P"],
    z_ent: Float[Array, "B K P"],
    valid: Bool[Array, "B K P"],
    num_branches: int,
    require_both_positive: bool = True,
) -> Int[Array, "B K R"]:
  """Top-B branch points of every rollout by Branching Score (APPO §3.2, Eq. 5).

  The order below is tree_rl's (docs/methods/appo.md#sign-filter and
  #too-few-branch-points).

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


def _safe_mean(x, mask, weight=None) -> Float[Array, ""]:
  """Mean of x over mask (optionally weighted); 0 when the mask is empty."""
  w = mask.astype(jnp.float32) * (1.0 if weight is None else weight)
  return ((x * w).sum() / jnp.maximum(w.sum(), 1e-9)).astype(jnp.float32)


def branching_metrics(score: BranchingScore, config: APPOConfig) -> dict[str, Float[Array, ""]]:
  """The Branching Score logs, for the rollout strategy that branches
  (docs/methods/appo.md#logged-metrics).

  They need the per-rollout `[B, K, P]` score, so they live here and not in
  the registered estimator (whose future value never gathers the paths):

    fallback_frac: share of the initial rollouts with a candidate position
      whose clip(Omega) had ~zero std, so that the first-minibatch fallback
      (docs/methods/appo.md#first-minibatch-fallback) applied.
    bs_both_positive_frac (only when config.num_branches > 0): share of the
      top-B branch points (`select_branch_points` with
      config.bs_require_both_positive) with Z(clip Omega) > 0 and Z(ent) > 0.

  Args:
    score: `branching_score(...)` output (with the strategy's token_mask).
    config: num_branches and bs_require_both_positive.

  Returns:
    Scalar float32 metrics by name.
  """
  has_valid = score.valid.any(-1) | score.fell_back
  metrics = {"fallback_frac": _safe_mean(score.fell_back, has_valid)}
  if config.num_branches > 0:
    points = select_branch_points(score.bs, score.z_fut, score.z_ent, score.valid,
                                  config.num_branches, config.bs_require_both_positive)
    picked = jnp.maximum(points, 0)
    both = (jnp.take_along_axis(score.z_fut, picked, -1) > 0) & (
        jnp.take_along_axis(score.z_ent, picked, -1) > 0)
    metrics["bs_both_positive_frac"] = _safe_mean(both, points >= 0)
  return metrics


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
  r = batch.leaf_rewards(*config.reward_channels)
  is_init = _init_leaves(batch, st)
  is_branch = st.leaf_valid & (batch.leaf_tag == int(LeafTag.BRANCH))
  mu_i, sd_i, n_i = _stats(r, is_init, config.std_ddof)
  mu_b, sd_b, n_b = _stats(r, is_branch, config.std_ddof)
  if not config.dual_group:
    # "w/o dual-group": one pooled mean and std over all M rollouts
    # (docs/methods/appo.md#pooled-ablation).
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
  """z_I of the INIT leaves and z_B of the BRANCH leaves (APPO §3.3, Eq. 6).

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
    # has a single group and reduces to z_I (docs/methods/appo.md#base-advantage-reading).
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


def _token_sums(*values: Array) -> list[Array]:
  """Totals of `[B, L]` token arrays, in one pass over the tokens.

  One multi-operand reduction over each row, then a sum of the `[B]` row
  totals: XLA:CPU fuses the elementwise producers of a variadic reduce (for
  a lone masked sum it writes the masked `[B, L]` operand out first).
  """
  init = tuple(jnp.zeros((), v.dtype) for v in values)
  rows = lax.reduce(values, init, lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
  return [row.sum() for row in rows]


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
  coverage of the prefix they share. Omega comes from the O(L) packed-layout
  scan of `future_value`. The branch points are chosen by the rollout
  strategy with `branching_score` and `select_branch_points`, and their logs
  (fallback_frac, bs_both_positive_frac) come from `branching_metrics`;
  `entropy` feeds only those, so this kernel does not read it (it stays an
  input so that every APPO caller passes the same arrays).

  Args:
    batch: packed APPO trees (leaf_tag INIT / BRANCH).
    config: APPOConfig.
    logp: `[B, L]` log-probs of the sampled tokens under the current
      mini-batch policy pi_theta (behavior_logp holds pi_old's).
    entropy: `[B, L]` current-policy token entropies (unused here, see above).

  Returns:
    Advantages with node_leaf `[B, N, K]` = A_base on INIT paths (0 for
    BRANCH leaves), token_scale `[B, L]` = 1 + b * A_fut on the INIT paths'
    policy tokens (stop-gradient; 1 elsewhere), leaf_mask = INIT leaves, the
    logged metrics other than the Branching Score ones (docs/methods/appo.md#logged-metrics), and
    extras["omega"] `[B, L]`.
  """
  del entropy  # Branching Score logs: `branching_metrics`
  st = derived.structure(batch)
  is_init = _init_leaves(batch, st)
  is_branch = st.leaf_valid & (batch.leaf_tag == int(LeafTag.BRANCH))
  g = _groups(batch, st, config)
  node_leaf = _base_advantages(batch, st, config, g)

  fut = _future_tokens(batch, st, logp, config)
  # A_fut is a constant weight (docs/methods/appo.md#future-term-clip).
  omega = lax.stop_gradient(fut.omega)
  lo, hi = config.fut_clip
  scaled = fut.exclusive & batch.loss_mask
  token_scale = jnp.where(scaled, 1.0 + config.b * jnp.clip(omega, lo, hi), 1.0)

  # --- logged metrics (Branching Score ones: `branching_metrics`) -------------
  tree_has_init = g.n_init > 0
  tree_has_branch = g.n_branch > 0
  n_cov, _ = _coverage(st, is_branch, g.z_branch)
  on_init = (fut.init_count > 0) & st.is_policy  # [B, N]
  policy_tokens = _node_policy_tokens(batch, fut.bounds)
  n_scaled = jnp.maximum(jnp.where(fut.init_count == 1, policy_tokens, 0).sum(), 1)
  omega_sum, n_outside = _token_sums(
      jnp.where(scaled, omega, 0.0), (((omega < lo) | (omega > hi)) & scaled).astype(jnp.int32))
  r = batch.leaf_rewards(*config.reward_channels)
  metrics = {
      "omega_mean": omega_sum / n_scaled,
      "fut_clip_frac": n_outside / n_scaled,
      "z_init_zero_std_rate": _safe_mean(g.init_flat, tree_has_init),
      "z_branch_zero_std_rate": _safe_mean(g.branch_flat, tree_has_branch),
      # mean |S(n, i)| over the policy tokens of the initial rollouts
      "coverage_mean": _safe_mean(n_cov, on_init, weight=policy_tokens),
      "reward_mean_init": _safe_mean(r, is_init),
      "reward_mean_branch": _safe_mean(r, is_branch),
  }
  metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
  return Advantages(node_leaf=node_leaf, token_scale=token_scale, leaf_mask=is_init,
                    metrics=metrics, extras={"omega": omega})
