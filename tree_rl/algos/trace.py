"""TRACE rollout-budget allocation and tree statistics (TRACE, arXiv 2606.11119, §4.1-4.3,
Eqs. 12-21; tree_rl's readings where the paper is open: docs/methods/trace.md).

TRACE is not an advantage estimator: it decides how many root rollouts each candidate prompt
gets and where each tree is expanded, and its trees are trained with TreeRPO or Tree-GRPO.
So nothing here is registered. Two kinds of pieces:

Host-side allocators (numpy; they run between rollout stages, outside any jitted step):
  root_value / allocate_roots     Stage 1: P(m Bernoulli(v) outcomes are mixed), and the exact
                                  DP over m_i in {0} U {2..cap} with sum m_i = M (eqs. 12-13).
  flip_probability / prefix_value Stage 2: q = P(a continuation repeats the factual reward)
  / allocate_prefixes             and 1 - q^k, allocated greedily (eqs. 15-16, 34).

Jitted tree statistics on a TreeBatch:
  backed_up_targets   the predictor's regression targets n_y and V_hat (eq. 18); the learned
                      predictor that fits them is `tree_rl.algos.trace_value`.
  effective_ratio     fraction of trees whose leaf rewards are not all equal (eq. 21).

Predicted probabilities are clipped to [eps, 1 - eps] before allocation
(docs/methods/trace.md#probability-clip): at v = 0 or 1 every count has value 0 and only
the tie-break would decide.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tree_rl.tree import derived
from tree_rl.tree.batch import TreeBatch
from tree_rl.tree.types import Array, Float, Int

EPS = 1e-3  # clip for predicted probabilities (docs/methods/trace.md#probability-clip).
# Host-side numeric input: an array, a (nested) list or a scalar. numpy.typing.ArrayLike
# would be the natural hint, but the test suite's beartype hook has no numeric tower (it
# rejects a float where ArrayLike says complex).
ArrayLike = np.ndarray | Sequence[Any] | float | int | np.number
Count = int | np.integer

# Tie-break of allocate_roots towards more active prompts (see there); our choice.
COVERAGE_BONUS = 1e-10


def _probabilities(x: ArrayLike, name: str) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
  if not np.isfinite(x).all() or (x < 0).any() or (x > 1).any():
    raise ValueError(f"{name} must hold probabilities in [0, 1], got {x}")
  return x


# ----------------------------------------------------------------------------
# Stage 1: global root allocation
# ----------------------------------------------------------------------------


def root_value(v: ArrayLike, m: ArrayLike) -> np.ndarray:
  """V_root(v, m) = 1 - v^m - (1 - v)^m for m >= 2, else 0 (TRACE eq. 12).

  The probability that m i.i.d. Bernoulli(v) outcomes contain both a success and a failure.
  Broadcasts `v` against `m`.
  """
  v = np.asarray(v, np.float64)
  m = np.asarray(m)
  return np.where(m >= 2, 1.0 - v**m - (1.0 - v) ** m, 0.0)


def allocate_roots(
    v: ArrayLike, total: Count, max_per_prompt: Count | None = None, eps: float = EPS
) -> np.ndarray:
  """Root rollout counts m [B] maximising sum_i V_root(v_i, m_i) (TRACE eq. 13).

  Exact DP over prompts (TRACE §4.1 solves Eq. 13 by dynamic programming):
  dp_i[b] = max_{m in {0} U {2..cap}, m <= b}
  dp_{i-1}[b - m] + V_root(v_i, m), with cap = max_per_prompt (the paper has no cap: default
  `total`). The inner max over m runs for all budgets b at once on a sliding window of
  dp_{i-1}, so the cost is O(B * M * cap) numpy work and a B-step Python loop
  (B = 512, M = 1024: about a second).

  Tie-break (ours, docs/methods/trace.md#root-allocation-tie-break): among optimal
  allocations, the one with the
  most active prompts (m_i > 0), then, np.argmax taking the first maximum, the one where
  later prompts get smaller counts. Ties are common: V_root(v, 3) / 3 = V_root(v, 2) / 2 =
  v (1 - v) for every v, so with a constant predictor (cold start,
  docs/methods/trace.md#cold-start) and M = 2B,
  all-2 and any mix of 2s and 3s tie; coverage picks m = 2 for every prompt. The first rule
  is a bonus of COVERAGE_BONUS per active prompt added to the objective: far above float64
  round-off of the sums, far below any real difference in value (it costs at most
  B * COVERAGE_BONUS). The result is a pure function of (v, total, max_per_prompt, eps).

  Args:
    v: [B] predicted root success probabilities, clipped to [eps, 1 - eps].
    total: M, the number of root rollouts to hand out (sum m_i = M exactly).
    max_per_prompt: optional per-prompt cap (none in the paper;
      docs/methods/trace.md#per-prompt-cap).
    eps: probability clip.

  Returns:
    int64 [B] counts in {0} U {2..cap} summing to `total`.
  """
  v = np.clip(_probabilities(v, "v"), eps, 1.0 - eps)
  n_prompts = v.shape[0]
  if total < 0:
    raise ValueError(f"total must be >= 0, got {total}")
  cap = total if max_per_prompt is None else min(max_per_prompt, total)
  if cap < 0:
    raise ValueError(f"max_per_prompt must be >= 0, got {max_per_prompt}")
  if total == 0:
    return np.zeros(n_prompts, np.int64)

  counts = np.arange(cap + 1)
  gain = root_value(v[:, None], counts[None, :])  # [B, cap + 1]
  gain[:, 1:2] = -np.inf  # m = 1 is not allowed: group optimizers need 2 rollouts
  gain[:, 2:] += COVERAGE_BONUS
  dp = np.full(total + 1, -np.inf)
  dp[0] = 0.0
  choice = np.zeros((n_prompts, total + 1), np.int32)
  pad = np.full(cap, -np.inf)
  rows = np.arange(total + 1)
  for i in range(n_prompts):
    # prev[b, m] = dp[b - m] (-inf where m > b): a reversed sliding window over the padded dp.
    prev = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, dp]), cap + 1)
    cand = prev[:, ::-1] + gain[i]
    choice[i] = np.argmax(cand, axis=1)
    dp = cand[rows, choice[i]]
  if not np.isfinite(dp[total]):
    raise ValueError(
        f"cannot hand out exactly {total} root rollouts to {n_prompts} prompts with counts in"
        f" {{0}} U {{2..{cap}}}")
  m = np.zeros(n_prompts, np.int64)
  b = total
  for i in range(n_prompts - 1, -1, -1):
    m[i] = choice[i, b]
    b -= m[i]
  return m


# ----------------------------------------------------------------------------
# Stage 2: local prefix expansion
# ----------------------------------------------------------------------------


def flip_probability(r: ArrayLike, v: ArrayLike, eps: float = EPS) -> np.ndarray:
  """q = r v + (1 - r)(1 - v) (TRACE eqs. 15, 34), v clipped to [eps, 1 - eps].

  The probability that one new continuation from an anchor repeats the factual reward r of
  the bare rollout through it, when the predictor gives the anchor success probability v. A
  fractional r (F1 rewards, docs/methods/trace.md#non-binary-rewards) interpolates.
  """
  r = np.asarray(r, np.float64)
  v = np.clip(np.asarray(v, np.float64), eps, 1.0 - eps)
  return np.asarray(r * v + (1.0 - r) * (1.0 - v))


def prefix_value(q: ArrayLike, k: ArrayLike) -> np.ndarray:
  """V_pref = 1 - q^k (TRACE eq. 15): P(at least one of k continuations flips the reward);
  0 for k = 0."""
  return np.asarray(1.0 - np.asarray(q, np.float64) ** np.asarray(k))


def allocate_prefixes(q: ArrayLike, budget: Count) -> np.ndarray:
  """Continuation counts K [A] maximising sum_a 1 - q_a^{K_a}, sum K = budget (TRACE eq. 16).

  Each term is concave in K (its marginal gain q^K (1 - q) does not increase), so handing out
  one continuation at a time to the anchor with the largest marginal gain is exact
  (docs/methods/trace.md#prefix-allocation). A max-heap keyed on (-gain, index) breaks ties
  towards the lowest anchor index.

  Args:
    q: [A] repeat probabilities of the anchors (`flip_probability`).
    budget: m_i * N continuations for this prompt (eq. 14).

  Returns:
    int64 [A] counts summing to `budget`.
  """
  q = _probabilities(q, "q")
  if budget < 0:
    raise ValueError(f"budget must be >= 0, got {budget}")
  out = np.zeros(q.shape[0], np.int64)
  if budget == 0:
    return out
  if q.shape[0] == 0:
    raise ValueError(
        f"no prefix anchor to spend {budget} continuations on; the caller must fall back to"
        " extra root rollouts (TRACE App. E.5)")
  heap = [(-(1.0 - qa), a) for a, qa in enumerate(q.tolist())]
  heapq.heapify(heap)
  for _ in range(budget):
    _, a = heapq.heappop(heap)
    out[a] += 1
    heapq.heappush(heap, (-(q[a] ** out[a]) * (1.0 - q[a]), a))
  return out


# ----------------------------------------------------------------------------
# Tree statistics (jitted)
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("channel",))
def backed_up_targets(
    batch: TreeBatch, channel: str = "outcome"
) -> tuple[Int[Array, "B N"], Float[Array, "B N"]]:
  """The predictor's tree-backed targets (TRACE eq. 18).

  n_y = 1 at a leaf and sum_{c in C(y)} n_c above; V_hat(y) = r_y at a leaf and
  (1/n_y) sum_c n_c V_hat(c) above. Unrolled, n_y is the number of leaves under y and V_hat(y)
  their mean reward (leaf-count weighted, unlike TreeRPO's child mean:
  docs/methods/trace.md#two-backups), so both
  are one masked reduction over `leaves_under`.

  Returns:
    n_y int32 [B, N] and V_hat f32 [B, N]; 0 on padding nodes.
  """
  st = derived.structure(batch)
  reward = batch.leaf_rewards(channel)  # [B, K], 0 on padding leaves
  n_y = st.num_leaves_under
  total = jnp.einsum("bnk,bk->bn", st.leaves_under.astype(reward.dtype), reward)
  v_hat = jnp.where(n_y > 0, total / jnp.maximum(n_y, 1), 0.0)
  return n_y, v_hat


@functools.partial(jax.jit, static_argnames=("channel",))
def effective_ratio(batch: TreeBatch, channel: str = "outcome") -> Float[Array, ""]:
  """Eff_root = (1/|B|) sum_i 1[Var(R_i) > 0] (TRACE eq. 21).

  R_i is every leaf reward of tree i, continuation leaves included. The average runs over the
  batch's valid trees, i.e. the active prompts that were rolled out
  (docs/methods/trace.md#effective-ratio-denominator), and is 0
  for a batch of padding only. Var > 0 is tested as max > min, which is exact.
  """
  ok = batch.leaf_node >= 0
  reward = batch.leaf_rewards(channel)
  hi = jnp.where(ok, reward, -jnp.inf).max(-1)
  lo = jnp.where(ok, reward, jnp.inf).min(-1)
  tree_ok = ok.any(-1)
  mixed = tree_ok & (hi > lo)
  return mixed.sum() / jnp.maximum(tree_ok.sum(), 1).astype(jnp.float32)
