"""The evaluation harness on the in-test "add" family of tests/envs/episode_test.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.envs.episode_test import FAMILY, TASKS, _step
from tree_rl.evaluate import EvalReport, evaluate, pass_at_k, replay_oracle_policy
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

# TASKS: 4 tasks, difficulties 2, 3, 2, 3.


def answer_policy(correct_at):
  """One-step policy: the right answer for batch positions where correct_at(i) holds."""
  def policy(conversations):
    texts = []
    for i, conversation in enumerate(conversations):
      task = next(t for t in TASKS if t.messages[1] == conversation[1])
      value = task.answer if correct_at(i) else task.answer + 1
      texts.append(_step("answer", "answer", {"value": value}))
    return texts
  return policy


def test_oracle_replay_scores_perfectly():
  report = evaluate(FAMILY, TASKS, replay_oracle_policy(TASKS), num_samples=2, pass_k=(1, 2))
  m = report.metrics
  assert m["accuracy"] == 1.0 and m["pass@1"] == 1.0 and m["pass@2"] == 1.0
  assert m["avg_tool_steps"] == pytest.approx(2.5)
  assert m["unanswerable_rate"] == 0.0 and m["truncated_rate"] == 0.0
  assert m["avg_formatting_raw"] == 1.0 and m["mean_reward"] == 1.0
  assert (m["num_tasks"], m["num_episodes"]) == (4, 8)
  assert m["accuracy/difficulty_2"] == 1.0 and m["accuracy/difficulty_3"] == 1.0
  assert len(report.episodes) == len(report.records) == 8
  assert report.episodes[1] == dataclasses.replace(report.episodes[1], task_id="add/eval/0",
                                                    sample=1, correct=True, steps=2)


def test_pass_at_k_against_hand_values():
  # Episodes run in (task, sample) order, so position i % 4 == 0 is sample 0 of each task:
  # c = 1 of n = 4 for every task. pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5,
  # pass@4 = 1.
  report = evaluate(FAMILY, TASKS, answer_policy(lambda i: i % 4 == 0), num_samples=4,
                    pass_k=(1, 2, 4))
  m = report.metrics
  assert m["accuracy"] == pytest.approx(0.25)
  assert (m["pass@1"], m["pass@2"], m["pass@4"]) == pytest.approx((0.25, 0.5, 1.0))
  assert m["mean_reward"] == pytest.approx((1 - 3) / 4)
  assert m["avg_tool_steps"] == 1.0 and m["unanswerable_rate"] == 0.0
  assert [e.correct for e in report.episodes[:4]] == [True, False, False, False]

  # Task 0 gets c = 2 (positions 0 and 1), the others c = 0:
  # pass@2 = (1 - C(2,2)/C(4,2)) / 4 tasks = (5/6) / 4.
  report = evaluate(FAMILY, TASKS, answer_policy(lambda i: i < 2), num_samples=4, pass_k=(2,))
  assert report.metrics["pass@2"] == pytest.approx(5 / 24)
  assert report.metrics["accuracy/difficulty_2"] == pytest.approx(2 / 8)
  assert report.metrics["accuracy/difficulty_3"] == 0.0


def test_pass_at_k_estimator():
  assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
  assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
  assert pass_at_k(4, 0, 1) == 0.0
  assert pass_at_k(4, 4, 3) == 1.0
  assert pass_at_k(4, 2, 3) == 1.0  # n - c < k
  with pytest.raises(ValueError):
    pass_at_k(4, 5, 1)
  with pytest.raises(ValueError):
    pass_at_k(4, 1, 5)


def test_never_answering_and_garbage_policies():
  add = _step("more", "add", {"a": 1, "b": 2})
  m = evaluate(FAMILY, TASKS, lambda cs: [add] * len(cs), max_turns=3).metrics
  assert m["accuracy"] == 0.0 and m["unanswerable_rate"] == 1.0 and m["truncated_rate"] == 1.0
  assert m["avg_tool_steps"] == 3.0 and m["avg_formatting_raw"] == 1.0
  assert m["mean_reward"] == -1.0

  m = evaluate(FAMILY, TASKS, lambda cs: ["<tool_call>{{{</tool_call>"] * len(cs)).metrics
  assert m["accuracy"] == 0.0 and m["unanswerable_rate"] == 1.0
  assert m["avg_formatting_raw"] == 0.0 and m["avg_tool_steps"] == FAMILY.max_turns


def test_json_round_trip(tmp_path):
  report = evaluate(FAMILY, TASKS, answer_policy(lambda i: i % 2 == 0), num_samples=2,
                    pass_k=(1, 2))
  path = str(tmp_path / "report.json")
  report.to_json(path)
  with open(path) as f:
    payload = json.load(f)
  assert payload["metrics"] == report.metrics
  assert payload["episodes"][0] == {"task_id": "add/eval/0", "sample": 0, "correct": True,
                                    "reward": 1.0, "steps": 1, "truncated": False,
                                    "answered": True, "difficulty": 2}
  loaded = EvalReport.from_json(path)
  assert loaded.metrics == report.metrics and loaded.episodes == report.episodes
  assert loaded.records == ()


def test_table_lists_every_metric_aligned():
  report = evaluate(FAMILY, TASKS, replay_oracle_policy(TASKS), num_samples=2, pass_k=(1, 2))
  table = report.table()
  lines = table.splitlines()
  assert len(lines) == len(report.metrics) + 2
  assert len({len(line) for line in lines}) == 1  # aligned columns
  for name in ["accuracy", "avg_tool_steps", "unanswerable_rate", "avg_formatting_raw",
               "mean_reward", "pass@1", "pass@2", "num_tasks", "num_episodes",
               "accuracy/difficulty_2", "accuracy/difficulty_3"]:
    assert any(line.split()[0] == name for line in lines[2:]), name
  assert "2.5000" in table and " 8" in table


def test_judge_metrics_join_the_report():
  judge = LLMJudge(JudgeConfig(), fallback=FAMILY)
  m = evaluate(FAMILY, TASKS, replay_oracle_policy(TASKS), judge=judge).metrics
  assert m["accuracy"] == 1.0
  assert m["judge/fallback_verifier"] == 4.0 and m["judge/requests"] == 0.0


def test_argument_errors():
  with pytest.raises(ValueError, match="num_samples"):
    evaluate(FAMILY, TASKS, replay_oracle_policy(TASKS), num_samples=2, pass_k=(3,))
  with pytest.raises(ValueError, match="unique"):
    evaluate(FAMILY, TASKS + TASKS[:1], replay_oracle_policy(TASKS))


def test_replay_policy_rejects_unknown_and_exhausted_conversations():
  replay = replay_oracle_policy(TASKS)
  with pytest.raises(ValueError, match="matches no task"):
    replay([[{"role": "user", "content": "hello"}]])
  finished = list(TASKS[0].messages) + list(TASKS[0].oracle)
  with pytest.raises(ValueError, match="0 oracle steps fit"):
    replay([finished])
  # Two tasks with one prompt but different first steps cannot be told apart.
  other = dataclasses.replace(TASKS[1], task_id="clash", messages=TASKS[0].messages)
  with pytest.raises(ValueError, match="2 oracle steps fit"):
    replay_oracle_policy([TASKS[0], other])([list(TASKS[0].messages)])
