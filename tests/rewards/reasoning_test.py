"""The leaf scorer of AWPO's reasoning reward: rubric and LLM judge kinds, no score on failure."""

import dataclasses
import math

import pytest

from tests.rewards.judge_test import GOOD, TASK, AddFamily
from tree_rl.envs.base import Task
from tree_rl.rewards.judge import JudgeConfig
from tree_rl.rewards.reasoning import REASONING_CHANNEL, make_reasoning_scorer


def _config(url):
  return JudgeConfig(base_url=url, model="judge", timeout_s=0.5, max_retries=1, backoff_s=0.01,
                     backoff_max_s=0.02)


def test_kinds():
  assert make_reasoning_scorer("", AddFamily(), [TASK]) is None
  with pytest.raises(ValueError, match=r"valid kinds: \['', 'rubric', 'llm'\]"):
    make_reasoning_scorer("gpt", AddFamily(), [TASK])
  with pytest.raises(ValueError, match="base_url"):
    make_reasoning_scorer("llm", AddFamily(), [TASK], JudgeConfig())


def test_rubric_checks_every_task_up_front_and_scores():
  bare = Task(task_id="bare/3", family="bare", split="train", messages=TASK.messages,
              tool_names=(), answer=None)
  with pytest.raises(ValueError, match="'bare/3'.*no oracle"):
    make_reasoning_scorer("rubric", AddFamily(), [TASK, bare])
  step = ('<think>I add two and three.</think><tool_call>{"name": "add", '
          '"arguments": {"a": 2, "b": 3}}</tool_call>')
  task = dataclasses.replace(TASK, oracle=({"role": "assistant", "content": step},))
  scorer = make_reasoning_scorer("rubric", AddFamily(), [task])
  assert scorer(task, list(task.messages) + list(task.oracle), False) == {REASONING_CHANNEL: 1.0}
  # GOOD answers without the call and thinks one word: every dimension 0.
  assert scorer(task, GOOD, True) == {REASONING_CHANNEL: 0.0}
  m = scorer.step_metrics([{"outcome": 1.0, REASONING_CHANNEL: 0.5}, {"outcome": 0.0}])
  assert m == {"reward/reasoning_mean": 0.5, "reward/reasoning_missing_frac": 0.5}


def test_llm_judge_scores_and_a_failed_judgement_is_missing(server_factory):
  tiers = ('{"reasoning_path": "Tier II", "tool_selection": "Tier I", '
           '"parameter_setting": "Tier I", "execution_strategy": "Tier IV"}')
  fake = server_factory([("ok", tiers)])  # then HTTP 500 forever
  scorer = make_reasoning_scorer("llm", AddFamily(), [TASK], _config(fake.url))
  # 0.35 * 0.8 + 0.30 + 0.25 + 0.10 * 0.4 = 0.87
  assert scorer(TASK, GOOD, False)[REASONING_CHANNEL] == pytest.approx(0.87)
  other = GOOD[:-1] + [{"role": "assistant", "content": "<think>add them</think>5"}]
  assert scorer(TASK, other, False) == {}  # 2 attempts, both 500: no score
  m = scorer.step_metrics([{REASONING_CHANNEL: 0.87}, {}])
  assert m["reward/reasoning_missing_frac"] == 0.5
  assert (m["judge/requests"], m["judge/failures"]) == (3.0, 1.0)


def test_unreachable_judge_never_raises():
  scorer = make_reasoning_scorer("llm", AddFamily(), [TASK], _config("http://127.0.0.1:9/v1"))
  assert scorer(TASK, GOOD, True) == {}
  assert math.isnan(scorer.step_metrics([{}])["reward/reasoning_mean"])
