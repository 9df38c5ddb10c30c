"""The offline reasoning rubric: hand-computed scores of small trajectories.

Every expected value is worked out in a comment from the four dimensions and AWPO's weights
(Reasoning Path 0.35, Tool Selection 0.30, Parameter Setting 0.25, Execution Strategy 0.10).
"""

import json

import pytest

from tree_rl.envs.base import Task
from tree_rl.rewards.rubric import reference_routes, rubric_dimensions, rubric_score

THINK = "<think>The user wants the weather in Paris, so I call get_weather.</think>\n"


def call(name, **arguments):
  return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def assistant(content):
  return {"role": "assistant", "content": content}


PROMPT = ({"role": "system", "content": "tools: get_weather, get_time"},
          {"role": "user", "content": "What is the weather in Paris, in celsius?"})
WEATHER = Task(task_id="t/0", family="fake", split="train", messages=PROMPT,
               tool_names=("get_weather", "get_time"), answer=None,
               oracle=(assistant(THINK + call("get_weather", city="Paris", unit="celsius")),
                       {"role": "tool", "name": "get_weather", "content": "18 C"}))


def score(task, *steps):
  return rubric_score(task, list(task.messages) + [assistant(s) for s in steps])


def test_the_oracle_itself_scores_one():
  assert score(WEATHER, THINK + call("get_weather", city="Paris", unit="celsius")) == 1.0
  # Values compare leniently: case, spacing, and numbers by value.
  assert score(WEATHER, THINK + call("get_weather", city=" paris", unit="Celsius")) == 1.0


def test_wrong_tool():
  # reasoning_path: think 1, path [get_time] vs [get_weather] LCS 0 -> (1 + 0) / 2 = 0.5
  # tool_selection: Jaccard({get_time}, {get_weather}) = 0
  # parameter_setting: the reference call is unmatched -> 0
  # execution_strategy: 1 good call of 1 attempt, 1 reference -> 1
  # 0.35 * 0.5 + 0.10 * 1 = 0.275
  assert score(WEATHER, THINK + call("get_time", city="Paris")) == pytest.approx(0.275)
  dims = rubric_dimensions(WEATHER, list(PROMPT) + [assistant(THINK + call("get_time"))])
  assert dims == pytest.approx({"reasoning_path": 0.5, "tool_selection": 0.0,
                                "parameter_setting": 0.0, "execution_strategy": 1.0})


def test_right_tool_one_wrong_argument():
  # parameter_setting: {city, unit}, city equal -> 1/2; the rest 1
  # 0.35 + 0.30 + 0.25 * 0.5 + 0.10 = 0.875
  got = score(WEATHER, THINK + call("get_weather", city="Paris", unit="fahrenheit"))
  assert got == pytest.approx(0.875)
  # An extra argument counts in the union: {city, unit, days}, 2 equal -> 2/3
  got = score(WEATHER, THINK + call("get_weather", city="Paris", unit="celsius", days=3))
  assert got == pytest.approx(0.35 + 0.30 + 0.25 * 2 / 3 + 0.10)


def test_malformed_call_scores_low():
  broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
  # Trivial think (1 word < 3), no well-formed call: path 0, selection 0, parameters 0,
  # strategy 0 good of 1 attempt -> 0.
  assert score(WEATHER, "<think>ok</think>\n" + broken) == 0.0
  # With real reasoning only the think half of reasoning_path is earned: 0.35 * 0.5.
  assert score(WEATHER, THINK + broken) == pytest.approx(0.175)


def test_redundant_repeat_and_think_after_the_call():
  ok = call("get_weather", city="Paris", unit="celsius")
  # reasoning_path: think 1, path [gw, gw] vs [gw] LCS 1 / 2 -> 0.75
  # tool_selection 1, parameter_setting 1 (the first call is matched)
  # execution_strategy: min(1 good, 1 ref) / max(2 attempts, 1 ref) = 0.5
  # 0.35 * 0.75 + 0.30 + 0.25 + 0.10 * 0.5 = 0.8625
  assert score(WEATHER, THINK + ok + "\n" + ok) == pytest.approx(0.8625)
  # Thinking after acting loses the think half: 0.35 * 0.5 + 0.65 = 0.825
  assert score(WEATHER, ok + "\n" + THINK) == pytest.approx(0.825)


def test_no_call_task_and_empty_episode():
  task = Task(task_id="t/1", family="fake", split="train", messages=PROMPT, tool_names=(),
              answer=None, oracle=(assistant(THINK + "<answer>No function fits.</answer>"),))
  assert score(task, THINK + "<answer>None of them fit.</answer>") == 1.0
  # A call where none belongs: path 0 -> 0.5 * 0.35; selection 0; parameters 0;
  # strategy min(1, 0) / max(1, 0) = 0 -> 0.175
  assert score(task, THINK + call("get_weather", city="Paris")) == pytest.approx(0.175)
  assert rubric_score(WEATHER, list(PROMPT)) == 0.0  # no assistant step


def _route(*calls):
  out = []
  for name, args in calls:
    out.append(assistant(f"<think>Next I call {name} for the answer.</think>\n"
                         + call(name, **args)))
    out.append({"role": "tool", "name": name, "content": "{}"})
  return tuple(out)


def test_multi_step_order_and_alternative_routes():
  ctx, news = ("get_current_context", {}), ("news_search", {"query": "Halcyon"})
  answer = ("response_gen", {"answer": "Revenue rose 10.9%."})
  alt = ("web_search", {"query": "Halcyon"})
  task = Task(task_id="t/2", family="fake", split="train", messages=PROMPT, tool_names=(),
              answer=None, oracle=_route(ctx, news, answer),
              metadata={"oracle_alternatives": (_route(alt, answer),)})
  steps = lambda route: [m["content"] for m in route if m["role"] == "assistant"]
  assert score(task, *steps(_route(ctx, news, answer))) == 1.0
  assert score(task, *steps(_route(alt, answer))) == 1.0  # the alternative route counts
  # Context and news swapped: LCS 2 of 3 -> reasoning_path (1 + 2/3) / 2 = 5/6; the rest 1.
  # 0.35 * 5/6 + 0.65 = 0.941667
  assert score(task, *steps(_route(news, ctx, answer))) == pytest.approx(0.35 * 5 / 6 + 0.65)


def test_task_without_oracle_fails_naming_it():
  task = Task(task_id="bare/7", family="bare", split="train", messages=PROMPT, tool_names=(),
              answer=None)
  with pytest.raises(ValueError, match="'bare/7' of family 'bare' has no oracle"):
    reference_routes(task)
