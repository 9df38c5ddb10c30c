"""The per-step logs the branching strategies hand the trainer (`last_metrics`): APPO's
Branching Score logs summed over a step's mini-batches, TRACE's predictor rank
correlation against hand-built outcomes. Uses the scripted "add two numbers" world of
branching_test."""

import numpy as np
import pytest

from tests.rollout.branching_test import (  # noqa: F401 (chat, tokenizer: fixtures)
    AddFamily, add_steps, call, chat, peaks_scorer, scripted, tokenizer)
from tree_rl.algos.appo import APPOConfig
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.engine import SamplingParams, ScriptedEngine
from tree_rl.rollout.strategies import APPOStrategy, TRACEStrategy
from tree_rl.rollout.strategies.trace import rank_correlation
from tree_rl.tree.types import NodeKind


def _moved_scorer(peaks, moved):
  """peaks_scorer(peaks), and a current policy that puts log-prob +5 on the first `moved`
  tokens of each rollout's first step: Omega >= e^5 there (clipped to c_hi = 1.2) and
  exactly 1 after, so Z(clip Omega) > 0 exactly on those tokens (no fallback)."""
  base = peaks_scorer(peaks)

  def score(trees):
    out = base(trees)
    for tree, arrays in zip(trees, out):
      for i, node in enumerate(tree.nodes):
        if node.kind == NodeKind.POLICY and tree.nodes[node.parent].kind == NodeKind.PROMPT:
          arrays.logprobs[i] = arrays.logprobs[i].copy()
          arrays.logprobs[i][:moved] += 5.0
    return out

  return score


def test_appo_logs_the_branching_scores_of_every_minibatch_of_a_step(chat, tokenizer):
  # Mini-batch 0 is branched before any update (Omega = 1: every rollout falls back to the
  # entropy ranking, no point has Z(clip Omega) > 0); mini-batch 1 after the policy moved
  # on tokens 0-5, where the entropy peaks (1, 2, 3) are: its 2 rollouts x B = 3 points are
  # all both-positive. The step's logs: 2 of 4 rollouts fell back, 6 of 12 points both > 0.
  tasks = AddFamily().generate("train", 2, seed=5)
  scorer = {"now": peaks_scorer([1, 2, 3])}
  strategy = APPOStrategy(APPOConfig(n_init=2, budget=8), skip_punctuation=False,
                          current_logprobs=lambda trees: scorer["now"](trees))
  engine = ScriptedEngine(scripted(chat, add_steps), tokenizer, eos_id=tokenizer.eos_token_id)
  loop = AgentLoop(engine, chat, AddFamily(), AgentConfig(
      max_context_tokens=4096, sampling=SamplingParams(max_new_tokens=256)), strategy)
  assert strategy.last_metrics == {}
  with loop.open_forest(tasks) as forest:
    strategy.initial(forest)
    strategy.branch(forest, [0])
    assert strategy.last_metrics == {"appo/fallback_frac": 1.0,
                                     "appo/bs_both_positive_frac": 0.0}
    scorer["now"] = _moved_scorer([1, 2, 3], moved=6)
    strategy.branch(forest, [1])
    loop.close_forest(forest)
  assert strategy.last_metrics == pytest.approx({"appo/fallback_frac": 0.5,
                                                 "appo/bs_both_positive_frac": 0.5})
  with loop.open_forest(tasks) as forest:  # the next step starts its logs afresh
    strategy.initial(forest)
    assert strategy.last_metrics == {}
    loop.close_forest(forest)


# ----------------------------------------------------------------------------
# TRACE
# ----------------------------------------------------------------------------


class _TaskPredictor:
  """A SuccessPredictor that says `value[task_id]` for the task's every prefix."""

  def __init__(self, value):
    self.value, self.updates = value, 0

  def predict(self, task_ids, prefixes):
    return np.array([self.value[t] for t in task_ids], np.float64)

  def update(self, trees):
    self.updates += 1
    return {"fake_loss": 0.25}

  def state_dict(self):
    return {"meta": {}, "arrays": {}}

  def load_state_dict(self, state):
    del state


@pytest.mark.parametrize("right, wrong, rho", [(0.6, 0.4, 1.0), (0.4, 0.6, -1.0),
                                               (0.5, 0.5, "nan")])
def test_trace_logs_the_predictors_rank_correlation(chat, tokenizer, right, wrong, rho):
  # Task 0 is always answered right (success 1 at its root and every turn prefix), task 1
  # always wrong (0): a predictor that ranks task 0 above task 1 has rho = 1 (the ties
  # within a task are shared alike by both sides), the reverse -1, a constant one no rank.
  # (v = 0.6 / 0.4 keeps stage 1 at 2 roots each: V_root 0.48 + 0.48 > 0.84 for 4 on one.)
  tasks = AddFamily().generate("train", 2, seed=9)
  wrong_q = tasks[1].messages[-1]["content"]

  def steps(text):
    add, answer = add_steps(text)
    if wrong_q in text:
      answer = call("answer", value=tasks[1].answer + 1)
    return [add, answer]

  predictor = _TaskPredictor({tasks[0].task_id: right, tasks[1].task_id: wrong})
  strategy = TRACEStrategy(predictor=predictor)
  loop = AgentLoop(ScriptedEngine(scripted(chat, steps), tokenizer, tokenizer.eos_token_id),
                   chat, AddFamily(), AgentConfig(max_context_tokens=4096), strategy)
  trees = loop.rollout(tasks)
  assert len(trees) == 2 and predictor.updates == 1
  outcomes = {t.meta["task_id"]: {leaf.rewards["outcome"] for leaf in t.leaves} for t in trees}
  assert outcomes == {tasks[0].task_id: {1.0}, tasks[1].task_id: {-1.0}}
  got = strategy.last_metrics
  assert got["trace/fake_loss"] == 0.25
  if rho == "nan":
    assert np.isnan(got["trace/predictor_spearman"])
  else:
    assert got["trace/predictor_spearman"] == pytest.approx(rho)


def test_rank_correlation_averages_tied_ranks():
  # Ranks (1, 2.5, 2.5, 4) and (1, 3, 2, 4): rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9).
  assert rank_correlation(np.array([1.0, 2.0, 2.0, 3.0]),
                          np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(np.sqrt(0.9))
  assert rank_correlation(np.array([3.0, 1.0, 2.0]), np.array([30.0, 10.0, 20.0])) == 1.0
  assert np.isnan(rank_correlation(np.array([1.0]), np.array([2.0])))
  assert np.isnan(rank_correlation(np.array([1.0, 1.0]), np.array([0.0, 2.0])))
  with pytest.raises(ValueError, match="one length"):
    rank_correlation(np.zeros(2), np.zeros(3))
