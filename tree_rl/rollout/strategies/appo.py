"""APPO's token-level branching (arXiv 2606.12384, §3.2, Eqs. 4-5, App. I Algorithm 1).

  1. N initial rollouts per prompt (tagged INIT), run to the end.
  2. For every initial rollout H_n, the Branching Score of each valid position i
       BS_{n,i} = Z(clip(Omega_{n,i}, c_lo, c_hi); H_n) * Z(ent_{n,i}; H_n)      (Eq. 5)
     from the *current* policy's log-probs (Omega, Eq. 4, against the recorded
     behaviour log-probs) and entropies; the top-B positions are branch points
     (`tree_rl.algos.appo.branching_score` / `select_branch_points`, so the
     sign filter, the cyclic repeat of too-few points and the first-minibatch
     entropy fallback are the estimator's own).
  3. From each point a continuation is sampled with the current policy (the
     engine holds the current weights): the branch shares positions 0..i-1
     (the paper's "exclusive" prefix) and resamples token i onwards, through
     the full agent loop (tools included), tagged BRANCH.
  4. L = 1: every initial rollout gets exactly B branches, so every tree has
     exactly M = (B + 1) N leaves. L > 1 (App. E): each further loop samples
     source rollouts uniformly from the tree's rollouts (initial and branches)
     and branches at their top-B points, with M as a hard cap
     (docs/methods/appo.md#budget-and-loops).

Valid positions (docs/methods/appo.md#valid-branch-positions): policy tokens,
minus EOS / end-of-turn ids and, with `skip_punctuation`, tokens that decode to whitespace or punctuation.
A rollout without a valid position (its prompt filled the context) keeps the
budget with fresh rollouts from the prompt instead.

Current-policy log-probs come from `current_logprobs(trees)`, which the trainer
supplies (`model_scorer(model)` recomputes them on the packed trees). Without
it the behaviour log-probs and entropies recorded at sampling stand in: then
Omega = 1, and the estimator's fallback ranks by entropy alone (what the first
mini-batch of every step sees in the paper;
docs/methods/appo.md#first-minibatch-fallback).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tree_rl.algos.appo import (APPOConfig, branching_metrics, branching_score,
                                select_branch_points)
from tree_rl.rollout.branching import Branch, Forest
from tree_rl.rollout.strategies.base import (BranchingStrategy, RunContext, register,
                                             strategy_options)
from tree_rl.tree.batch import Buckets, TreeBatch, pack
from tree_rl.tree.rollout_tree import Node, RolloutTree
from tree_rl.tree.types import Array, Bool, Float, Int, LeafTag, NodeKind

BRANCH_TIMINGS = ("per_minibatch", "per_step")
# Scoring runs on one-leaf chain trees padded to these sizes, so the jitted
# scorer compiles once per bucket rather than once per rollout shape.
_CHAIN_BUCKETS = Buckets(trees=tuple(2**i for i in range(13)))


class NodeArrays(NamedTuple):
  """Per-node arrays of one tree, indexed like `tree.nodes` (one value per token)."""

  logprobs: list[np.ndarray]
  entropies: list[np.ndarray]


PolicyScorer = Callable[[Sequence[RolloutTree]], list[NodeArrays]]


def behaviour_scorer(trees: Sequence[RolloutTree]) -> list[NodeArrays]:
  """The log-probs and entropies recorded at sampling (0 where a node has none)."""
  out = []
  for tree in trees:
    get = lambda arr, n: np.zeros(len(n.tokens)) if arr is None else np.asarray(arr, np.float64)
    out.append(NodeArrays([get(n.logprobs, n) for n in tree.nodes],
                          [get(n.entropies, n) for n in tree.nodes]))
  return out


@functools.partial(jax.jit, static_argnums=0)  # one compile per (fitted graph, bucket)
def score_program(graphdef: Any, state: Any, batch: TreeBatch):
  """The scorer's program: ((log-probs, entropies) `[B, L]` of every packed token, the
  attention backstop `attention_overflow` for the host to read)."""
  from flax import nnx  # rollout code imports model code lazily

  from tree_rl.models.attention import TreeMask, attention_overflow
  from tree_rl.models.logprobs import tree_logprobs
  from tree_rl.tree import derived

  model = nnx.merge(graphdef, state)
  st = derived.structure(batch)
  overflow = attention_overflow(TreeMask(batch.node_of_token, st.ancestor),
                                model.attention_config)
  return tree_logprobs(model, batch, st), overflow


def model_scorer(model: Any, buckets: Buckets | None = None,
                 place_batch: Callable[[TreeBatch], TreeBatch] | None = None) -> PolicyScorer:
  """`current_logprobs` from a Decoder: log-probs and entropies on the packed trees.

  The trees are packed (`buckets`, default `Buckets()`, so shapes repeat across
  calls and the jitted scorer compiles once per bucket), scored with
  `tree_rl.models.logprobs.tree_logprobs`, and mapped back from the packed
  depth-first node order (`RolloutTree.preorder`) to each tree's own indices.
  The model is read at call time, so it follows in-place weight updates. With
  blockwise attention, each packed batch runs on the graph fitted to its exact
  key-block bound (`AttentionFitter`), whatever static bound the model carries:
  one compile per (bucket, bound). On a device mesh the trainer passes `place_batch`
  (`tree_rl.placement.Placement.place_batch`: the packed trees split over the mesh, so
  `buckets` must pad the trees to a multiple of its tree shards); the weights keep the
  training layout they were updated with, and the jit follows both inputs' shardings.
  """
  from flax import nnx  # rollout code imports model code lazily

  from tree_rl.models.attention import AttentionFitter, raise_on_overflow

  fit = AttentionFitter(model)

  def score(trees: Sequence[RolloutTree]) -> list[NodeArrays]:
    batch = pack(list(trees), buckets or Buckets())
    if place_batch is not None:
      batch = place_batch(batch)
    (lp, ent), overflow = score_program(fit.graphdef(batch), nnx.state(model), batch)
    if int(overflow):
      raise_on_overflow(overflow, batch.tokens.shape, fit.config(batch))
    lp, ent = np.asarray(lp, np.float64), np.asarray(ent, np.float64)
    out = []
    for b, tree in enumerate(trees):
      per_lp: list[np.ndarray] = [np.zeros(0)] * len(tree.nodes)
      per_ent: list[np.ndarray] = [np.zeros(0)] * len(tree.nodes)
      off = 0
      for i in tree.preorder():
        n = len(tree.nodes[i].tokens)
        per_lp[i], per_ent[i] = lp[b, off:off + n], ent[b, off:off + n]
        off += n
      out.append(NodeArrays(per_lp, per_ent))
    return out

  return score


@functools.partial(jax.jit, static_argnames=("config", "num_points", "num_branches"))
def _top_points(batch: TreeBatch, logp: Float[Array, "B L"], entropy: Float[Array, "B L"],
                mask: Bool[Array, "B L"], config: APPOConfig, num_points: int,
                num_branches: int) -> tuple[Int[Array, "B K R"], dict, Int[Array, ""]]:
  """`[B, K, num_points]` top-B offsets (Eq. 5, APPO §3.2) of every INIT path of `batch`,
  the Branching Score logs of its top `num_branches` points (`branching_metrics`) and the
  number of rollouts with a candidate position (the denominator of fallback_frac)."""
  score = branching_score(batch, logp, entropy, config, token_mask=mask)
  points = select_branch_points(score.bs, score.z_fut, score.z_ent, score.valid, num_points,
                                config.bs_require_both_positive)
  logged = dataclasses.replace(config, budget=num_branches + 1)  # n_init = 1: B = num_branches
  n_rollouts = (score.valid.any(-1) | score.fell_back).sum()
  return points, branching_metrics(score, logged), n_rollouts


def branching_config(estimator: str, estimator_config: Any) -> APPOConfig:
  """The APPOConfig the APPO strategy branches with in a run whose advantage estimator is
  `estimator`: with APPO's own estimator, that estimator's (one config for the branching and
  the advantages, so N = n_init and the scoring options agree); else APPO's defaults."""
  return estimator_config if estimator == "appo" else APPOConfig()


@register("appo")
@dataclasses.dataclass
class APPOStrategy(BranchingStrategy):
  """Attributes:
    config: APPOConfig: n_init = N (4), budget = M (16), so B = M/N - 1 = 3
      (APPO App. C); fut_clip [1, 1.2], tau_half 32, bs_mode, the sign filter and
      the first-minibatch fallback, shared with the advantage estimator.
    loops: L, branching loops (1 in all the paper's main experiments).
    current_logprobs: trees -> per-node current-policy log-probs and
      entropies; None uses the behaviour ones (see the module docstring).
    skip_punctuation: drop whitespace/punctuation-only tokens from the
      candidates (docs/methods/appo.md#valid-branch-positions).
    seed: source sampling for L > 1.
    branch_timing: "per_minibatch" (the paper, §3.2 and App. I; see
      docs/methods/appo.md#branch-timing: the trainer grows the
      initial rollouts of a step's prompts under the step's starting policy, then
      branches each PPO mini-batch's prompts with the policy after the previous
      mini-batch's update) or "per_step" (the authors' public code: branch once,
      before any update). Read by the trainer; the same with one mini-batch.
  """

  # N is config.n_init (the estimator's when both are APPO's): the config checks that
  # samples_per_task agrees with it.
  generic_fields: ClassVar[Mapping[str, str]] = {"samples_per_task": "n_init", "max_turns": ""}
  config: APPOConfig = APPOConfig()
  loops: int = 1
  current_logprobs: PolicyScorer | None = None
  skip_punctuation: bool = True
  seed: int = 0
  branch_timing: str = "per_minibatch"

  def __post_init__(self):
    if self.loops < 1:
      raise ValueError(f"APPOStrategy.loops={self.loops} must be >= 1")
    if self.branch_timing not in BRANCH_TIMINGS:
      raise ValueError(f"APPOStrategy.branch_timing={self.branch_timing!r}; choose one of "
                       f"{BRANCH_TIMINGS}")
    self._rng = np.random.default_rng(self.seed)
    self._logged = np.zeros(4)  # fallback (sum, count), both-positive (sum, count)

  def leaves_per_task(self) -> int | None:
    return self.config.budget

  @property
  def branches_between_updates(self) -> bool:
    return self.branch_timing == "per_minibatch"

  @classmethod
  def from_run(cls, rollout: Any, seed: int, run: RunContext | None = None) -> APPOStrategy:
    """With `run`: the APPOConfig of `branching_config` and the run's current-policy scorer
    (else the behaviour log-probs)."""
    kw = strategy_options(rollout, seed)
    if run is not None:
      kw["config"] = branching_config(run.estimator, run.estimator_config)
      if run.scorer is not None:
        kw["current_logprobs"] = run.scorer()
    return cls(**kw)

  @property
  def last_metrics(self) -> dict[str, float]:
    """APPO's Branching Score logs (`tree_rl.algos.appo.branching_metrics`) over every
    rollout branched since the last `initial` (a training step, all its mini-batches),
    which the trainer writes each step:

      appo/fallback_frac: share of the scored rollouts (with a candidate position) whose
        clip(Omega) had ~zero std, so that config.first_minibatch_fallback applied.
      appo/bs_both_positive_frac: share of the chosen branch points with
        Z(clip Omega) > 0 and Z(ent) > 0 (Eq. 5's two factors both above average).

    Empty until a rollout is scored.
    """
    fb, fb_n, both, both_n = self._logged
    out = {"appo/fallback_frac": fb / fb_n} if fb_n else {}
    if both_n:
      out["appo/bs_both_positive_frac"] = both / both_n
    return out

  # --------------------------------------------------------------------------

  def grow(self, forest: Forest) -> None:
    self.initial(forest)
    self.branch(forest)

  def initial(self, forest: Forest) -> None:
    """Step 1: N initial rollouts of every tree, run to the end (a new step: the
    Branching Score logs start over)."""
    self._logged = np.zeros(4)
    n = self.config.n_init
    forest.run([b for t in range(len(forest.trees)) for b in forest.start(t, n)])

  def branch(self, forest: Forest, trees: Sequence[int] | None = None) -> None:
    """Steps 2-4 for `trees` (default: all) with the policy the engine and
    `current_logprobs` hold now: the trainer calls it once per mini-batch with
    that mini-batch's trees, after the previous mini-batch's update."""
    cfg = self.config
    num_points, cap = cfg.num_branches, cfg.budget
    ids = range(len(forest.trees)) if trees is None else [int(t) for t in trees]
    planned = {t: len(forest.trees[t].leaves) for t in ids}
    for loop in range(self.loops):
      if num_points == 0:
        break
      sources = self._sources(forest, loop, planned, num_points)
      if not sources:
        break
      points = self._branch_points(forest, sources, num_points)
      new: list[Branch] = []
      for (t, leaf), offsets in zip(sources, points):
        take = min(len(offsets), cap - planned[t])  # the L > 1 hard cap; L = 1 always fits
        for off in offsets[:take]:
          if off < 0:  # no valid position on this rollout: keep M with a fresh rollout
            new.extend(forest.start(t, 1, LeafTag.BRANCH))
          else:
            new.append(forest.branch_at_offset(t, leaf, int(off)))
        planned[t] += max(take, 0)
      forest.run(new)

  def _sources(self, forest: Forest, loop: int, planned: dict[int, int],
               num_points: int) -> list[tuple[int, int]]:
    """(tree, leaf) rollouts of the trees in `planned` to branch from in this loop."""
    out = []
    for t in planned:
      tree = forest.trees[t]
      if loop == 0:  # L = 1: every initial rollout once
        out.extend((t, k) for k, leaf in enumerate(tree.leaves) if leaf.tag == LeafTag.INIT)
        continue
      left = self.config.budget - planned[t]
      if left > 0 and tree.leaves:  # uniform over all rollouts of the tree, with replacement
        picks = self._rng.integers(len(tree.leaves), size=math.ceil(left / num_points))
        out.extend((t, int(k)) for k in picks)
    return out

  def _branch_points(self, forest: Forest, sources: list[tuple[int, int]],
                     num_points: int) -> list[list[int]]:
    """Top-B offsets into each source's root-to-leaf sequence (-1: none valid).

    Each source's path becomes a one-leaf chain tree tagged INIT, so the
    estimator's per-rollout z-scores and Omega run over exactly that rollout
    (a branch rollout's path includes its parent's prefix, as Eq. 4 wants).
    """
    scorer = self.current_logprobs or behaviour_scorer
    scored = sorted({t for t, _ in sources})  # only the trees being branched
    scores = dict(zip(scored, scorer([forest.trees[t] for t in scored])))
    skip = frozenset(forest.chat.eos_ids)
    keep_token = self._token_filter(forest)
    chains, rows = [], []
    for t, leaf in sources:
      tree = forest.trees[t]
      path = tree.path(tree.leaves[leaf].node)
      chain = RolloutTree(nodes=[], meta={})
      lp, ent, mask = [], [], []
      for j, i in enumerate(path):
        n = tree.nodes[i]
        chain.nodes.append(Node(parent=j - 1, kind=n.kind, tokens=list(n.tokens),
                                logprobs=n.logprobs, step=n.step))
        lp.append(np.asarray(scores[t].logprobs[i], np.float64))
        ent.append(np.asarray(scores[t].entropies[i], np.float64))
        policy = n.kind == NodeKind.POLICY
        mask.append(np.array([policy and tok not in skip and keep_token(tok)
                              for tok in n.tokens], bool))
      chain.add_leaf(len(path) - 1, {"outcome": 0.0}, tag=LeafTag.INIT)
      chains.append(chain)
      rows.append((np.concatenate(lp), np.concatenate(ent), np.concatenate(mask)))
    batch = pack(chains, _CHAIN_BUCKETS, check=False)
    n_rows, length = batch.tokens.shape
    arr = lambda j, dtype: np.stack(
        [np.pad(r[j], (0, length - len(r[j]))).astype(dtype) for r in rows]
        + [np.zeros(length, dtype)] * (n_rows - len(rows)))
    # Only the scoring fields of the config and a bucketed B reach the compiled
    # program: the first B of the top-2^k points are the top-B
    # (docs/methods/appo.md#too-few-branch-points). B itself sizes only the logs.
    scoring = dataclasses.replace(self.config, n_init=1, budget=1)
    points, logs, n_rollouts = _top_points(
        batch, jnp.asarray(arr(0, np.float32)), jnp.asarray(arr(1, np.float32)),
        jnp.asarray(arr(2, bool)), scoring, 1 << (num_points - 1).bit_length(), num_points)
    top = np.asarray(points)[:len(rows), 0, :num_points]
    # Running sums, so the step's logs weigh every call's rollouts and points alike.
    n_points = int((top >= 0).sum())
    self._logged += [float(logs["fallback_frac"]) * int(n_rollouts), int(n_rollouts),
                     float(logs.get("bs_both_positive_frac", 0.0)) * n_points, n_points]
    return [[int(p) for p in row] for row in top]

  def _token_filter(self, forest: Forest) -> Callable[[int], bool]:
    if not self.skip_punctuation:
      return lambda tok: True
    memo: dict[int, bool] = {}

    def keep(tok: int) -> bool:
      if tok not in memo:
        memo[tok] = any(ch.isalnum() for ch in forest.chat.decode([tok]))
      return memo[tok]

    return keep
