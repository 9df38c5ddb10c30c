"""Tests of the math family: calculator, python tool, generation, splits, scoring and oracles.

The calculator's evaluator itself is tested in calculator_test.py.
"""

from __future__ import annotations

import json

import pytest

from tests.isolation import ISOLATION
from tree_rl.envs.base import Task, ToolError
from tree_rl.envs.executor import ToolExecutor, tool_message
from tree_rl.envs.math_family import MathFamily, extract_answer
from tree_rl.envs.parsing import parse_step


@pytest.fixture(scope="module")
def family() -> MathFamily:
  return MathFamily(sandbox=ISOLATION)


def _tool(family: MathFamily, name: str):
  return {t.name: t for t in family.tools(family.generate("eval", 1, 0)[0])}[name]


# -- calculator ---------------------------------------------------------------


def test_calculator_schema(family):
  calc = _tool(family, "calculator")
  schema = calc.schema()
  assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
  params = schema["function"]["parameters"]
  assert params["type"] == "object" and params["required"] == ["expression"]
  assert params["properties"]["expression"]["type"] == "string"
  assert calc.description and not calc.terminal


def test_calculator_errors_reach_the_model_through_the_executor(family):
  result, = ToolExecutor([_tool(family, "calculator")]).execute(
      parse_step('<tool_call>{"name": "calculator", "arguments": {"expression": "y * 2"}}'
                 "</tool_call>").calls)
  assert not result.ok and result.error == ToolError.EXCEPTION
  assert "unknown name 'y'" in result.content


# -- python tool --------------------------------------------------------------


def test_python_tool_runs_in_the_sandbox(family):
  python = _tool(family, "python")
  assert python.schema()["function"]["parameters"]["required"] == ["code"]
  assert python.fn(code="print(sum(i * i for i in range(10)))") == "285\n"
  assert "no output" in python.fn(code="x = 1")
  with pytest.raises(ValueError, match="ZeroDivisionError: division by zero"):
    python.fn(code="print('before')\n1 / 0")
  with pytest.raises(ValueError, match="reading /etc/passwd is outside the sandbox"):
    python.fn(code="open('/etc/passwd').read()")
  result, = ToolExecutor([python]).execute(parse_step(
      '<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 100)"}}</tool_call>').calls)
  assert result.ok and result.content == f"{2 ** 100}\n"


# -- generation and splits -----------------------------------------------------


def test_generation_is_deterministic_for_a_seed():
  first = MathFamily(sandbox=ISOLATION).generate("train", 30, seed=7)
  second = MathFamily(sandbox=ISOLATION).generate("train", 30, seed=7)
  assert first == second
  assert [t.task_id for t in first] == [f"math/train/{i}" for i in range(30)]
  other = MathFamily(sandbox=ISOLATION).generate("train", 30, seed=8)
  assert [t.messages for t in other] != [t.messages for t in first]


def test_tasks_are_well_formed_and_cycle_through_datasets(family):
  tasks = family.generate("train", 12, seed=3)
  assert [t.metadata["dataset"] for t in tasks] == list(family.datasets) * 4
  for task in tasks:
    assert isinstance(task, Task) and task.family == "math" and task.split == "train"
    system, user = task.messages
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert "<answer>...</answer>" in system["content"]
    assert user == {"role": "user", "content": task.metadata["entry"]["question"]}
    assert task.answer == task.metadata["entry"]["answer"]
    assert set(task.tool_names) == {"calculator", "python"}
    assert [t.name for t in family.tools(task)] == list(task.tool_names)
    json.dumps([task.metadata, task.answer, task.oracle])  # storable as plain JSON
  assert family.name == "math" and family.max_turns == 4


def test_splits_never_share_a_question():
  family = MathFamily(sandbox=ISOLATION, eval_pool_size=200)
  train = family.generate("train", 450, seed=0)
  evals = family.generate("eval", 150, seed=0)
  train_q = {t.messages[1]["content"] for t in train}
  eval_q = {t.messages[1]["content"] for t in evals}
  assert len(train_q) == 450 and len(eval_q) == 150  # distinct within each split too
  assert not train_q & eval_q
  pool = {e["question"] for entries in family._eval_pool(0).values() for _, e in entries}
  assert not train_q & pool  # the guarantee covers the whole eval pool


def test_entries_the_scorer_cannot_credit_are_skipped(family):
  # gsm_symbolic's scorer cannot read a leading minus sign, so "-1" never scores 1.
  assert not family._usable("gsm_symbolic", {"question": "q", "answer": "-1", "metadata": {}})
  assert family._usable("gsm_symbolic", {"question": "q", "answer": "12", "metadata": {}})
  assert family._usable("chain_sum", {"question": "q", "answer": "-1", "metadata": {}})


def test_eval_beyond_the_pool_is_refused():
  with pytest.raises(ValueError, match="raise eval_pool_size"):
    MathFamily(sandbox=ISOLATION, eval_pool_size=4).generate("eval", 30, seed=0)
  with pytest.raises(ValueError, match="split"):
    MathFamily(sandbox=ISOLATION).generate("test", 3, seed=0)


# -- scoring -------------------------------------------------------------------


def _hand_task(answer: str = "42", dataset: str = "chain_sum") -> Task:
  entry = {"question": "What is 40 + 2?", "answer": answer, "metadata": {}}
  return Task(task_id="math/eval/0", family="math", split="eval",
              messages=({"role": "user", "content": entry["question"]},), tool_names=(),
              answer=answer, metadata={"dataset": dataset, "dataset_config": {}, "entry": entry})


def _episode(task: Task, *steps: str) -> list[dict]:
  return list(task.messages) + [{"role": "assistant", "content": s} for s in steps]


@pytest.mark.parametrize("text, reward, correct, answered", [
    ("<think>40 + 2</think>\n<answer>42</answer>", 1.0, True, True),
    ("<answer> 42 </answer>", 1.0, True, True),
    ("<answer>42.0</answer>", 1.0, True, True),
    ("<answer>41</answer>", 0.0, False, True),
    ("<think>so the answer is 42</think>", 0.0, False, False),
    ("<think><answer>42</answer></think>", 0.0, False, False),  # tags in think are reasoning
    ("The result is \\boxed{42}.", 1.0, True, True),
    ("<answer>\\boxed{42}</answer>", 1.0, True, True),
    ("<answer></answer>", 0.0, False, False),
])
def test_score_hand_cases(family, text, reward, correct, answered):
  outcome = family.score(_hand_task(), _episode(_hand_task(), text), truncated=False)
  assert (outcome.reward, outcome.correct, outcome.answered) == (reward, correct, answered)
  if answered:
    assert outcome.details["scorer"] == "reasoning_gym"
    assert outcome.details["extracted"] == extract_answer(text)


def test_score_truncated_and_last_message(family):
  task = _hand_task()
  outcome = family.score(task, _episode(task, "<answer>42</answer>"), truncated=True)
  assert (outcome.reward, outcome.correct, outcome.answered) == (0.0, False, False)
  outcome = family.score(task, _episode(task, "<answer>42</answer>", "<answer>7</answer>"),
                         truncated=False)
  assert not outcome.correct and outcome.details["extracted"] == "7"


def test_score_gsm_partial_credit_and_math_verify_fallback(family):
  gsm = _hand_task("288", "gsm_symbolic")
  assert family.score(gsm, _episode(gsm, "<answer>288 apples</answer>"), False).correct
  wrong = family.score(gsm, _episode(gsm, "<answer>287</answer>"), False)
  assert not wrong.correct and 0.0 < wrong.reward < 0.1  # gsm_symbolic's own format credit
  unknown = _hand_task("1/2", "not_a_reasoning_gym_dataset")
  outcome = family.score(unknown, _episode(unknown, "<answer>0.5</answer>"), False)
  assert outcome.correct and outcome.details["scorer"] == "math_verify"
  outcome = family.score(unknown, _episode(unknown, "<answer>0.25</answer>"), False)
  assert not outcome.correct and outcome.reward == 0.0


# -- oracle ---------------------------------------------------------------------


def test_oracle_episodes_replay_with_real_tools_and_score_correct(family):
  tasks = family.generate("train", 60, seed=11)
  for task in tasks:
    executor = ToolExecutor(family.tools(task))
    oracle, steps, i = list(task.oracle), 0, 0
    while i < len(oracle):
      step = oracle[i]
      assert step["role"] == "assistant"
      parsed = parse_step(step["content"])
      assert parsed.think and (parsed.fields_ok or not parsed.calls)
      results = executor.execute(parsed.calls)
      expected = oracle[i + 1:i + 1 + len(results)]
      assert [tool_message(r) for r in results] == expected, task.task_id
      assert all(r.ok for r in results)
      steps += bool(results)
      i += 1 + len(results)
    assert not parse_step(oracle[-1]["content"]).calls  # the last step answers
    assert task.difficulty == steps
    outcome = family.score(task, list(task.messages) + oracle, truncated=False)
    assert outcome.correct and outcome.reward == 1.0, (task.task_id, outcome)
  by_dataset = {}
  for task in tasks:
    by_dataset.setdefault(task.metadata["dataset"], []).append(task.difficulty)
  assert set(by_dataset["basic_arithmetic"]) == {1} and set(by_dataset["chain_sum"]) == {1}
  assert sum(by_dataset["gsm_symbolic"]) >= len(by_dataset["gsm_symbolic"]) // 2
