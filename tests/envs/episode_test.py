"""run_episodes on a tiny in-test family: sum a list of integers with an `add` tool.

The family ("add") offers `add(a, b)` and a terminal `answer(value)`; a step without a call
may also answer in <answer>...</answer>. Its oracle adds the numbers left to right, then calls
`answer`, so a task of k numbers needs k tool steps (its difficulty). tests/evaluate_test.py
reuses it.
"""

from __future__ import annotations

import random

import pytest

from tree_rl.envs.base import Outcome, Task, Tool, render_tool_prompt
from tree_rl.envs.episode import run_episodes
from tree_rl.envs.parsing import format_tool_call, parse_step
from tree_rl.evaluate import replay_oracle_policy
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

INT = {"type": "integer"}
ADD = Tool(name="add", description="Add two integers.",
           parameters={"type": "object", "properties": {"a": INT, "b": INT},
                       "required": ["a", "b"]},
           fn=lambda a, b: a + b, timeout_s=2.0)
ANSWER = Tool(name="answer", description="Give the final answer; ends the episode.",
              parameters={"type": "object", "properties": {"value": INT}, "required": ["value"]},
              fn=lambda value: "recorded", timeout_s=2.0, terminal=True)


def _step(think: str, name: str, arguments: dict) -> str:
  return f"<think>{think}</think>\n{format_tool_call(name, arguments)}"


class AddFamily:
  """Sum 2 or 3 integers. Reward +1 correct, -1 wrong or truncated, 0 no answer."""

  name = "add"
  max_turns = 4

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    rng = random.Random(f"{split}/{seed}")
    tasks = []
    for i in range(num_tasks):
      nums = [rng.randint(1, 99) for _ in range(2 + i % 2)]
      prompt = render_tool_prompt([ADD, ANSWER], "You add numbers.",
                                  "Give the final answer by calling answer.")
      oracle, total = [], nums[0]
      for x in nums[1:]:
        oracle.append({"role": "assistant",
                       "content": _step(f"add {total} and {x}", "add", {"a": total, "b": x})})
        total += x
        oracle.append({"role": "tool", "name": "add", "content": str(total)})
      oracle.append({"role": "assistant", "content": _step("done", "answer", {"value": total})})
      oracle.append({"role": "tool", "name": "answer", "content": "recorded"})
      tasks.append(Task(task_id=f"add/{split}/{i}", family="add", split=split,
                        messages=({"role": "system", "content": prompt},
                                  {"role": "user", "content": f"What is {' + '.join(map(str, nums))}?"}),
                        tool_names=("add", "answer"), answer=total, oracle=tuple(oracle),
                        difficulty=len(nums)))
    return tasks

  def tools(self, task: Task) -> list[Tool]:
    return [ADD, ANSWER]

  def score(self, task, episode, truncated) -> Outcome:
    if truncated:
      return Outcome(reward=-1.0, correct=False, answered=False)
    parsed = parse_step(episode_last_assistant(episode))
    value = None
    if parsed.num_tool_call_blocks == 0:
      value = int(parsed.answer) if parsed.answer.strip().lstrip("-").isdigit() else None
    else:
      value = next((c.arguments["value"] for c in parsed.calls
                    if c.name == "answer" and c.arguments and "value" in c.arguments), None)
    if value is None:
      return Outcome(reward=0.0, correct=False, answered=False)
    correct = value == task.answer
    return Outcome(reward=1.0 if correct else -1.0, correct=correct, answered=True,
                   details={"value": value})


def episode_last_assistant(episode) -> str:
  return next((m["content"] for m in reversed(episode) if m["role"] == "assistant"), "")


class Recorder:
  """Wraps a per-conversation step function into a batched policy and logs batch sizes."""

  def __init__(self, step_fn):
    self.step_fn = step_fn
    self.batch_sizes = []

  def __call__(self, conversations):
    self.batch_sizes.append(len(conversations))
    return [self.step_fn(c) for c in conversations]


FAMILY = AddFamily()
TASKS = FAMILY.generate("eval", 4, seed=0)  # difficulties 2, 3, 2, 3


def test_oracle_replay_is_correct_and_batched():
  policy = Recorder(lambda c: None)
  replay = replay_oracle_policy(TASKS)
  policy.step_fn = lambda c: replay([c])[0]
  records = run_episodes(FAMILY, TASKS, policy, num_samples=2)
  assert [(r.task.task_id, r.sample_index) for r in records] == [
      (t.task_id, s) for t in TASKS for s in range(2)]
  # Every open episode goes in one call per turn; the 3-number tasks need a third turn.
  assert policy.batch_sizes == [8, 8, 4]
  for r in records:
    assert r.finished and not r.truncated
    assert r.outcome.correct and r.outcome.reward == 1.0
    assert r.num_tool_steps == r.task.difficulty == len(r.steps)
    assert [s.formatting_raw for s in r.steps] == [1.0] * len(r.steps)
    assert r.messages[:2] == r.task.messages
    assert list(r.messages[2:]) == list(r.task.oracle)  # the replay reproduces the oracle


def test_garbage_policy_is_truncated_and_never_raises():
  garbage = ["lorem ipsum <tool_call>{oops</tool_call>",
             '<think>hm</think><tool_call>{"name": "nope", "arguments": {}}</tool_call>',
             '<think>hm</think><tool_call>{"name": "add", "arguments": {"a": "1"}}</tool_call>',
             "<tool_call>[]</tool_call>"]
  turn = {"i": 0}

  def policy(conversations):
    turn["i"] += 1
    return [garbage[(turn["i"] - 1) % len(garbage)]] * len(conversations)

  records = run_episodes(FAMILY, TASKS[:2], policy, max_turns=4)
  for r in records:
    assert r.truncated and not r.finished
    assert (r.outcome.reward, r.outcome.correct, r.outcome.answered) == (-1.0, False, False)
    assert len(r.steps) == 4
    assert r.num_tool_steps == 3  # the empty list makes no call
    contents = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert len(contents) == 3
    assert contents[0].startswith("Error [parse]")
    assert contents[1].startswith("Error [unknown_tool]")
    assert contents[2].startswith("Error [invalid_arguments]")
    raws = [s.formatting_raw for s in r.steps]
    assert raws[0] == 0.0 and raws[3] == 0.0  # no think block
    assert raws[1] == pytest.approx(0.45) and raws[2] == pytest.approx(0.45)
    assert max(raws) < 0.5


def test_policy_that_never_answers_is_truncated():
  add = _step("keep adding", "add", {"a": 1, "b": 1})
  records = run_episodes(FAMILY, TASKS, Recorder(lambda c: add), num_samples=1, max_turns=2)
  for r in records:
    assert r.truncated and r.num_tool_steps == 2 and len(r.steps) == 2
    assert not r.outcome.answered
    assert [m["content"] for m in r.messages[2:] if m["role"] == "tool"] == ["2", "2"]


def test_free_text_answer_ends_the_episode():
  def answer(conversation):
    task = next(t for t in TASKS if t.messages[1] == conversation[1])
    return f"<think>easy</think><answer>{task.answer}</answer>"

  records = run_episodes(FAMILY, TASKS, Recorder(answer))
  for r in records:
    assert r.finished and len(r.steps) == 1 and r.num_tool_steps == 0
    assert r.outcome.correct and r.steps[0].results == ()
    assert r.steps[0].formatting_raw == pytest.approx(0.2)  # think only
    assert r.messages[-1]["role"] == "assistant"


def test_failed_terminal_call_lets_the_model_repair_it():
  task = TASKS[0]
  texts = iter([_step("answer", "answer", {"value": "five"}),
                _step("answer again", "add", {"a": 1, "b": 2}) + "\n" +
                format_tool_call("answer", {"value": task.answer})])
  records = run_episodes(FAMILY, [task], lambda cs: [next(texts) for _ in cs])
  (r,) = records
  assert r.finished and len(r.steps) == 2 and r.num_tool_steps == 2
  assert not r.steps[0].results[0].ok
  # Both calls of the final step ran, and the episode ended after them.
  assert [res.content for res in r.steps[1].results] == ["3", "recorded"]
  assert r.outcome.correct


def test_bad_policies_are_value_errors():
  def raises(conversations):
    raise RuntimeError("sampler crashed")

  with pytest.raises(ValueError, match="policy raised.*sampler crashed"):
    run_episodes(FAMILY, TASKS, raises)
  with pytest.raises(ValueError, match="returned 1 texts for 4"):
    run_episodes(FAMILY, TASKS, lambda cs: ["x"])
  with pytest.raises(ValueError, match="must be a string"):
    run_episodes(FAMILY, TASKS, lambda cs: [None] * len(cs))
  with pytest.raises(ValueError, match="list of strings"):
    run_episodes(FAMILY, TASKS, lambda cs: "x")
  with pytest.raises(ValueError, match="max_turns"):
    run_episodes(FAMILY, TASKS, lambda cs: ["x"] * len(cs), max_turns=0)


def test_policy_cannot_corrupt_the_episode():
  def vandal(conversations):
    for c in conversations:
      c.clear()
    return ["<answer>1</answer>"] * len(conversations)

  (r,) = run_episodes(FAMILY, TASKS[:1], vandal)
  assert r.messages[:2] == TASKS[0].messages and len(r.messages) == 3


def test_judge_without_endpoint_scores_with_the_verifier():
  judge = LLMJudge(JudgeConfig(), fallback=FAMILY)
  replay = replay_oracle_policy(TASKS)
  records = run_episodes(FAMILY, TASKS, replay, judge=judge)
  assert all(r.outcome.correct and r.outcome.reward == 1.0 for r in records)
  assert {r.outcome.details["source"] for r in records} == {"verifier"}
  assert judge.metrics()["judge/fallback_verifier"] == len(TASKS)
  truncated = run_episodes(FAMILY, TASKS[:1], replay, judge=judge, max_turns=1)
  assert truncated[0].truncated and truncated[0].outcome.details["source"] == "rule"
  assert truncated[0].outcome.reward == -1.0 and not truncated[0].outcome.answered
