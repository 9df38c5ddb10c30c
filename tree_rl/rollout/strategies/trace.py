"""TRACE's two-stage rollout allocation (arXiv 2606.11119, §2.2, §4.1-4.3, Algorithm 1).

tree_rl's readings where the paper is open are in docs/methods/trace.md.

Stage 1, global root allocation (Eqs. 12-13). A success predictor scores every
prompt of the call, v_i = V(x_i); `tree_rl.algos.trace.allocate_roots` solves
    max sum_i 1 - v_i^{m_i} - (1 - v_i)^{m_i}   s.t.  sum_i m_i = M,  m_i in {0} U {2, 3, ...}
exactly, and prompt i gets m_i bare rollouts (tagged INIT). m_i = 0 skips the
prompt: `AgentLoop.rollout` returns no tree for it and lists it in
`RolloutStats.skipped_tasks`. M = round(roots_per_task * #prompts).

Stage 2, local prefix expansion (Eqs. 14-16). The anchors of an active prompt
are the non-root, non-terminal turn prefixes of its bare rollouts: for every
rollout j and turn t < T_j, the history H_{j,t} that ends with the tool reply of
turn t (Eq. 7; each occurrence counts). With r_j the rollout's reward clipped
to [0, 1] and q = r_j V(H) + (1 - r_j)(1 - V(H)) the probability that a new
continuation repeats it, `allocate_prefixes` spreads m_i * N continuations
greedily by marginal gain q^K (1 - q) (exact: each term is concave). A
continuation restarts turn t + 1 from the anchor (a sibling of the factual next
step, tagged BRANCH) and runs to the end under the loop's turn limit; it is
never expanded again (one expansion round, App. E.5). A prompt with no anchor
(every bare rollout ended after one turn) spends its budget on
ceil(continuation_cost * m_i * N) extra root rollouts instead (App. E.5: a
continuation costs half a rollout; the conversion is ours,
docs/methods/trace.md#no-anchor-fallback).

The predictor is an interface, `SuccessPredictor`: `predict(task_ids, prefixes)`
scores prompts and turn prefixes, `update(trees)` learns from a step's finished
trees and returns metrics to log, and `state_dict()` / `load_state_dict()` carry
its learned state through checkpoints ({"meta": JSON, "arrays": a pytree of
arrays}). Two are registered by name (`make_predictor`, `PREDICTORS`):
  value_head    the paper's: a small value model over the serialized prefix
                tokens, trained online by MSE on backed-up success rates (eqs.
                17-19; `tree_rl.algos.trace_value.ValueHeadPredictor`).
  running_mean  a per-task running mean of past success rates (prefix-blind;
                an ablation, and the default of a bare `TRACEStrategy()`).
After the rollout the strategy calls `predictor.update(trees)` (TRACE trains the
predictor after each step and uses it on the next) and keeps the returned
metrics in `last_metrics`, with `trace/predictor_spearman`: the rank correlation
between what the predictor said before the update and the step's realised
success, on the examples it is trained on (roots and turn prefixes, eq. 18).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from tree_rl.algos.trace import allocate_prefixes, allocate_roots, flip_probability
from tree_rl.algos.trace_value import ValueHeadConfig, ValueHeadPredictor, supervision_examples
from tree_rl.rollout.branching import Branch, Forest
from tree_rl.rollout.strategies.base import (BranchingStrategy, RunContext, register,
                                             strategy_options)
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import LeafTag, NodeKind


def rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rho of two [E] samples: the Pearson correlation of their ranks, tied values
  sharing their average rank. NaN when E < 2 or either sample is constant (no ranking)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.shape != y.shape or x.ndim != 1:
    raise ValueError(f"rank_correlation: two 1-D samples of one length, got {x.shape}, {y.shape}")

  def ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=np.float64)
    _, tie, count = np.unique(v, return_inverse=True, return_counts=True)
    return (np.bincount(tie, weights=r) / count)[tie]

  if len(x) < 2:
    return float("nan")
  rx, ry = ranks(x) - (len(x) - 1) / 2, ranks(y) - (len(y) - 1) / 2
  den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
  return float((rx * ry).sum() / den) if den > 0 else float("nan")


def success(reward: float) -> float:
  """A leaf's reward as a success in [0, 1]: clip(r, 0, 1).

  +1/0/-1 (tool world) becomes 1/0/0, 0/1 stays, an F1 reward interpolates
  (docs/methods/trace.md#non-binary-rewards).
  """
  return float(min(max(reward, 0.0), 1.0))


@runtime_checkable
class SuccessPredictor(Protocol):
  """V(H): the probability that a rollout continuing from prefix H succeeds (Eq. 17)."""

  def predict(self, task_ids: Sequence[str], prefixes: Sequence[Sequence[int]]) -> np.ndarray:
    """[A] probabilities for A (task id, context tokens) pairs; a root's prefix is its prompt."""
    ...

  def update(self, trees: Sequence[RolloutTree]) -> Mapping[str, float]:
    """Learns from finished trees (each with meta["task_id"]); returns metrics to log."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """The learned state: {"meta": JSON-able values, "arrays": a pytree of arrays}."""
    ...

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Takes back `state_dict()`'s output (the arrays restored into its structure)."""
    ...


class RunningMeanPredictor:
  """Per-task running mean of past success rates, shrunk towards a prior.

    V(task) = (sum of successes + prior * prior_weight) / (count + prior_weight)

  It ignores the prefix (every anchor of a task gets the task's rate), so stage
  2 ranks anchors by their rollout's reward only. `update` counts the INIT
  leaves: continuations are placed where a flip was likely, so their mean is
  biased away from the prompt's success rate (Eq. 18 would average all leaves).

  Args:
    prior: the rate of an unseen task (0.5: the most uncertain).
    prior_weight: pseudo-count of the prior.
  """

  def __init__(self, prior: float = 0.5, prior_weight: float = 1.0):
    if not 0.0 <= prior <= 1.0 or prior_weight <= 0:
      raise ValueError(f"RunningMeanPredictor: prior in [0, 1] and prior_weight > 0, got "
                       f"{prior}, {prior_weight}")
    self.prior, self.prior_weight = prior, prior_weight
    self.total: dict[str, float] = collections.defaultdict(float)
    self.count: dict[str, float] = collections.defaultdict(float)

  def predict(self, task_ids: Sequence[str], prefixes: Sequence[Sequence[int]]) -> np.ndarray:
    del prefixes  # prefix-blind
    w = self.prior_weight
    return np.array([(self.total.get(i, 0.0) + self.prior * w) / (self.count.get(i, 0.0) + w)
                     for i in task_ids], np.float64)

  def update(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
    for tree in trees:
      task_id = tree.meta["task_id"]
      for leaf in tree.leaves:
        if leaf.tag == LeafTag.INIT:
          self.total[task_id] += success(leaf.rewards["outcome"])
          self.count[task_id] += 1.0
    return {}

  def state_dict(self) -> dict[str, Any]:
    """The per-task sums and counts (JSON: task ids are strings); no arrays."""
    return {"meta": {"total": dict(self.total), "count": dict(self.count)}, "arrays": {}}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.total = collections.defaultdict(float, state["meta"]["total"])
    self.count = collections.defaultdict(float, state["meta"]["count"])


PREDICTORS = ("running_mean", "value_head")


def check_predictor(name: str, kwargs: Mapping[str, Any] | None = None) -> None:
  """Fails unless `name` is a registered predictor and `kwargs` are its knobs.

  Cheap (builds no model), so config validation calls it at startup.
  """
  if name not in PREDICTORS:
    raise ValueError(f"unknown TRACE success predictor {name!r}; valid: {sorted(PREDICTORS)}")
  knobs = (("prior", "prior_weight") if name == "running_mean"
           else tuple(f.name for f in dataclasses.fields(ValueHeadConfig)))
  unknown = sorted(set(kwargs or {}) - set(knobs))
  if unknown:
    raise ValueError(f"TRACE predictor {name!r}: unknown key(s) {unknown}; valid keys: "
                     f"{sorted(knobs)}")


def make_predictor(name: str, *, vocab_size: int, seed: int = 0, **kwargs: Any
                   ) -> SuccessPredictor:
  """The success predictor registered as `name`, built with its knobs `kwargs`.

  Args:
    name: one of PREDICTORS (an unknown name fails listing them).
    vocab_size: the policy's vocabulary (the value head embeds prefix tokens).
    seed: the value head's initial weights and shuffles.
    **kwargs: RunningMeanPredictor's arguments, or ValueHeadConfig's fields.
  """
  check_predictor(name, kwargs)
  if name == "running_mean":
    return RunningMeanPredictor(**kwargs)
  return ValueHeadPredictor(vocab_size, seed=seed, config=ValueHeadConfig(**kwargs))


@register("trace")
@dataclasses.dataclass
class TRACEStrategy(BranchingStrategy):
  """Attributes:
    roots_per_task: M / #prompts (2.0: the paper's M = 1024 roots for 512
      candidates, and 512 for 256).
    continuations_per_root: N, continuation budget per root rollout (2, TRACE App. E.5).
    max_roots_per_task: optional cap on m_i (none in the paper).
    continuation_cost: rollouts one continuation costs, for the no-anchor
      fallback (0.5, App. E.5).
    predictor: the success predictor; None builds a RunningMeanPredictor
      (`make_predictor` builds one by name).
    update_predictor: call predictor.update(trees) after the rollout.
    last_metrics: the last rollout's predictor logs, which the trainer writes:
      trace/predictor_spearman (`rank_correlation` of the predictor's V(H), before
      its update, against the realised success V_hat of eq. 18 on the roots and turn
      prefixes of the call's trees; NaN when either side is constant, e.g. the cold
      start's 0.5 everywhere) and what `predictor.update` reported (trace/predictor_*).
  """

  # Roots per prompt are allocated (roots_per_task on average), not a fixed group size.
  generic_fields: ClassVar[Mapping[str, str]] = {"max_turns": ""}
  roots_per_task: float = 2.0
  continuations_per_root: int = 2
  max_roots_per_task: int | None = None
  continuation_cost: float = 0.5
  predictor: SuccessPredictor | None = None
  update_predictor: bool = True
  _logs: dict[str, float] = dataclasses.field(default_factory=dict, init=False, repr=False)

  def __post_init__(self):
    if self.roots_per_task <= 0 or self.continuations_per_root < 0:
      raise ValueError("TRACEStrategy: roots_per_task must be > 0 and continuations_per_root >= 0")
    if self.predictor is None:
      self.predictor = RunningMeanPredictor()

  @property
  def last_metrics(self) -> dict[str, float]:
    return self._logs

  @classmethod
  def from_run(cls, rollout: Any, seed: int, run: RunContext | None = None) -> TRACEStrategy:
    """The predictor the config names (rollout.strategy_kwargs.predictor, default
    running_mean, with predictor_kwargs), over the run's vocabulary and seeded by `seed`."""
    kw = strategy_options(rollout, seed)
    name, options = kw.pop("predictor", "running_mean"), kw.pop("predictor_kwargs", {})
    if name != "running_mean" and (run is None or run.vocab_size is None):
      raise ValueError(f"TRACE's predictor {name!r} needs the policy's vocabulary (a run)")
    kw["predictor"] = make_predictor(name, vocab_size=run.vocab_size if run else 0, seed=seed,
                                     **options)
    return cls(**kw)

  def state_dict(self) -> dict[str, Any]:
    """The predictor's learned state, tagged with its class (for checkpoints)."""
    state = self.predictor.state_dict()
    return {"meta": {"predictor": type(self.predictor).__name__, **state["meta"]},
            "arrays": state["arrays"]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    meta = dict(state["meta"])
    saved, ours = meta.pop("predictor"), type(self.predictor).__name__
    if saved != ours:
      raise ValueError(f"the checkpoint holds a {saved}'s state; this run's TRACE predictor is "
                       f"a {ours} (rollout.strategy_kwargs.predictor)")
    self.predictor.load_state_dict({"meta": meta, "arrays": state["arrays"]})

  def leaves_per_task(self) -> int | None:
    """Average leaves per prompt, M (1 + N) / #prompts, when it is an integer."""
    avg = self.roots_per_task * (1 + self.continuations_per_root)
    return int(round(avg)) if abs(avg - round(avg)) < 1e-9 else None

  def grow(self, forest: Forest) -> None:
    trees, tasks = forest.trees, forest.tasks
    # ---- Stage 1: global root allocation (Eqs. 12-13) ----
    ids = [task.task_id for task in tasks]
    v = np.asarray(self.predictor.predict(ids, [tree.nodes[0].tokens for tree in trees]))
    m = allocate_roots(v, int(round(self.roots_per_task * len(tasks))), self.max_roots_per_task)
    for tree, vi, mi in zip(trees, v, m):
      tree.meta["trace_root_value"], tree.meta["trace_roots"] = float(vi), int(mi)
    forest.run([b for t, mi in enumerate(m) for b in forest.start(t, int(mi))])
    # ---- Stage 2: local prefix expansion (Eqs. 14-16) ----
    cont: list[Branch] = []
    for t, mi in enumerate(m):
      if mi > 0:
        cont.extend(self._expand(forest, t, int(mi) * self.continuations_per_root))
    forest.run(cont)
    live = [tree for tree in trees if tree.leaves]
    logs = {"predictor_spearman": self._spearman(live)} if live else {}
    if self.update_predictor:
      logs.update(self.predictor.update(live) or {})
    self._logs = {f"trace/{k}": float(v) for k, v in logs.items()}

  def _spearman(self, trees: Sequence[RolloutTree]) -> float:
    """The predictor's rank correlation with the realised success of `trees`' roots and
    turn prefixes (the examples `predictor.update` fits, eq. 18)."""
    prefixes, targets, is_root = supervision_examples(trees)
    owner = np.cumsum(is_root) - 1  # each tree's examples start with its root
    v = self.predictor.predict([trees[i].meta["task_id"] for i in owner], prefixes)
    return rank_correlation(np.asarray(v), targets)

  def _expand(self, forest: Forest, t: int, budget: int) -> list[Branch]:
    tree = forest.trees[t]
    anchors = []  # (the factual next policy node, the anchor's env node, r_j)
    for leaf in tree.leaves:
      if leaf.tag != LeafTag.INIT:
        continue
      path = tree.path(leaf.node)
      for a, c in zip(path, path[1:]):
        if tree.nodes[a].kind == NodeKind.ENV and tree.nodes[c].kind == NodeKind.POLICY:
          anchors.append((c, a, success(leaf.rewards["outcome"])))
    tree.meta["trace_anchors"] = len(anchors)
    if budget == 0:
      return []
    if not anchors:
      return forest.start(t, math.ceil(self.continuation_cost * budget), LeafTag.BRANCH)
    v = self.predictor.predict([tree.meta["task_id"]] * len(anchors),
                               [tree.context(a) for _, a, _ in anchors])
    q = flip_probability(np.array([r for _, _, r in anchors]), np.asarray(v))
    counts = allocate_prefixes(q, budget)
    return [forest.branch_at(t, c, 0, LeafTag.BRANCH)
            for (c, _, _), k in zip(anchors, counts) for _ in range(int(k))]
