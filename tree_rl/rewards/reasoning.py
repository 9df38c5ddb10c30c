"""AWPO's reasoning score R_reason (arXiv 2512.19126, §3.2, eq. 20) of every rollout leaf,
from the configured judge.

`make_reasoning_scorer(kind, family, tasks, judge_config)` builds the scorer the trainer hands
to the agent loop, which calls it on each ended episode and adds its channels to the leaf:

  kind "rubric"  `rubric.rubric_score`: offline rules over the task's oracle trajectory
                 (deterministic, no network; checked against every task at startup).
  kind "llm"     `LLMJudge.judge_reasoning_verdict` at an OpenAI-compatible endpoint, with its
                 retries and reply cache.

The score goes to leaf channel "reasoning". When the judge has no score (every vote failed
after its retries: the LLMJudge falls back to the verifier's proxy, which is not a reasoning
grade), the leaf gets no "reasoning" channel, the trainer packs the absent channel as NaN and
the AWPO estimator gives that group the outcome-only advantage (docs/methods/awpo.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from tree_rl.envs.base import Message, Task
from tree_rl.rewards import rubric
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

REASONING_CHANNEL = "reasoning"  # AWPOConfig.reasoning_channel's default
JUDGE_KINDS = ("", "rubric", "llm")


class ReasoningScorer:
  """Callable (task, episode, truncated) -> {"reasoning": R_reason}, or {} when missing.

  Thread-safe: the agent loop scores a turn's ended episodes concurrently.
  """

  def __init__(self, score: Callable[[Task, Sequence[Message]], float],
               judge: LLMJudge | None = None):
    self._score = score
    self.judge = judge

  def __call__(self, task: Task, episode: Sequence[Message], truncated: bool
               ) -> dict[str, float]:
    del truncated  # a truncated episode is graded on what it did
    value = self._score(task, episode)
    return {REASONING_CHANNEL: value} if math.isfinite(value) else {}

  def step_metrics(self, leaf_rewards: Sequence[dict[str, float]]) -> dict[str, float]:
    """reward/reasoning_mean over the scored leaves (NaN if none), the fraction without a
    score, and the LLM judge's counters since the start of the run."""
    scores = [r[REASONING_CHANNEL] for r in leaf_rewards if REASONING_CHANNEL in r]
    out = {"reward/reasoning_mean": sum(scores) / len(scores) if scores else float("nan"),
           "reward/reasoning_missing_frac":
               1.0 - len(scores) / len(leaf_rewards) if leaf_rewards else 0.0}
    if self.judge is not None:
      out.update(self.judge.metrics())
    return out


def make_reasoning_scorer(kind: str, family: Any, tasks: Sequence[Task],
                          judge_config: JudgeConfig | None = None) -> ReasoningScorer | None:
  """The scorer of judge `kind` ("" -> None); fails now when it cannot score `tasks`.

  Args:
    kind: one of JUDGE_KINDS.
    family: the task family (the LLM judge's verifier fallback, only used to detect failure).
    tasks: the tasks that will be rolled out; "rubric" needs an oracle on every one.
    judge_config: the endpoint, for kind "llm".
  """
  if kind not in JUDGE_KINDS:
    raise ValueError(f"judge kind {kind!r}; valid kinds: {list(JUDGE_KINDS)}")
  if not kind:
    return None
  if kind == "rubric":
    for task in tasks:
      rubric.reference_routes(task)
    return ReasoningScorer(rubric.rubric_score)
  if judge_config is None or judge_config.base_url is None:
    raise ValueError("judge kind 'llm' needs a JudgeConfig with a base_url")
  judge = LLMJudge(judge_config, fallback=family)

  def score(task: Task, episode: Sequence[Message]) -> float:
    verdict = judge.judge_reasoning_verdict(task, episode)
    return float("nan") if verdict.source == "verifier" else verdict.score

  return ReasoningScorer(score, judge)
