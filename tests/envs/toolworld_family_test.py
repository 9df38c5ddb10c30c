"""ToolWorldFamily: oracle replays solve every task, determinism, disjoint splits, scoring."""

from __future__ import annotations

import pytest

from tree_rl.envs.base import Task
from tree_rl.envs.executor import ToolExecutor, tool_message
from tree_rl.envs.parsing import format_tool_call, parse_step
from tree_rl.envs.toolworld import TOOL_NAMES, ToolWorldFamily
from tree_rl.envs.toolworld.oracle import TEMPLATES, number
from tree_rl.envs.toolworld.queries import split_of


@pytest.fixture(scope="module")
def family():
  return ToolWorldFamily(seed_world=0)


@pytest.fixture(scope="module")
def family_seed1():
  return ToolWorldFamily(seed_world=1)


def replay(family, task, oracle):
  """Re-executes every oracle call with the real tools; returns the episode."""
  executor = ToolExecutor(family.tools(task))
  steps = 0
  i = 0
  while i < len(oracle):
    message = oracle[i]
    assert message["role"] == "assistant"
    step = parse_step(message["content"])
    assert step.fields_ok and step.think
    results = executor.execute(step.calls)
    assert all(r.ok for r in results), [r.content for r in results]
    recorded = list(oracle[i + 1:i + 1 + len(results)])
    assert recorded == [tool_message(r) for r in results], task.task_id
    i += 1 + len(results)
    steps += 1
  assert steps == task.difficulty + 1 <= family.max_turns
  return list(task.messages) + list(oracle)


def test_oracles_solve_300_tasks(family, family_seed1):
  tasks = []
  for fam in (family, family_seed1):
    for split in ("train", "eval"):
      tasks += [(fam, t) for t in fam.generate(split, 75, seed=11)]
  assert len(tasks) == 300
  assert {t.difficulty for _, t in tasks} == {1, 2, 3, 4, 5}
  assert {t.metadata["template"] for _, t in tasks} == set(TEMPLATES)
  for fam, task in tasks:
    outcome = fam.score(task, replay(fam, task, task.oracle), truncated=False)
    assert (outcome.reward, outcome.correct, outcome.answered) == (1.0, True, True), \
        (task.messages[1]["content"], outcome.details)
    for alternative in task.metadata["oracle_alternatives"]:
      assert fam.score(task, replay(fam, task, alternative), truncated=False).reward == 1.0


def test_task_structure(family):
  task, = family.generate("train", 1, seed=0)
  assert task.family == "toolworld" and task.tool_names == TOOL_NAMES
  system, user = task.messages
  assert system["role"] == "system" and user["role"] == "user"
  assert "response_gen" in system["content"] and "unable to answer" in system["content"]
  assert [t.name for t in family.tools(task)] == list(TOOL_NAMES)
  assert task.metadata["world_seed"] == 0 and task.metadata["city"]


def test_generation_is_deterministic(family):
  a = family.generate("train", 20, seed=5)
  assert a == family.generate("train", 20, seed=5)
  assert a == ToolWorldFamily(seed_world=0).generate("train", 20, seed=5)
  other_seed = family.generate("train", 20, seed=6)
  assert [t.messages[1] for t in a] != [t.messages[1] for t in other_seed]
  other_world = ToolWorldFamily(seed_world=2).generate("train", 20, seed=5)
  assert [t.answer for t in a] != [t.answer for t in other_world]


def test_splits_never_share_a_question(family):
  train = {t.messages[1]["content"] for s in (0, 1) for t in family.generate("train", 100, s)}
  evals = {t.messages[1]["content"] for s in (0, 1) for t in family.generate("eval", 60, s)}
  assert not train & evals
  assert all(split_of(q) == "train" for q in train) and all(split_of(q) == "eval" for q in evals)


def test_difficulties_and_turn_limit():
  fam = ToolWorldFamily(difficulties=(2, 4))
  assert [t.difficulty for t in fam.generate("train", 4, seed=0)] == [2, 4, 2, 4]
  with pytest.raises(ValueError):
    ToolWorldFamily(max_turns=5)
  with pytest.raises(ValueError):
    ToolWorldFamily(difficulties=(0, 6))


# -- Scoring hand cases ---------------------------------------------------------

def _task(answer):
  return Task(task_id="hand", family="toolworld", split="train",
              messages=({"role": "system", "content": "tools"},
                        {"role": "user", "content": "How far is it?"}),
              tool_names=TOOL_NAMES, answer=answer)


def _episode(task, *steps):
  return [*task.messages, *({"role": "assistant", "content": s} for s in steps)]


def _final(answer):
  return "<think>done</think>\n" + format_tool_call("response_gen", {"answer": answer})


@pytest.mark.parametrize("answer, reward, answered", [
    ("The drive is 541.3 km.", 1.0, True),
    ("About 540 km by road.", 1.0, True),  # within 1% of the truth
    ("It is 612 km.", -1.0, True),
    ("I am unable to answer: the maps tool returned an error.", 0.0, False),
    ("Sorry, I couldn't find the route information.", 0.0, False),
])
def test_score_hand_cases(family, answer, reward, answered):
  task = _task(number(541.3))
  outcome = family.score(task, _episode(task, _final(answer)), truncated=False)
  assert (outcome.reward, outcome.answered) == (reward, answered)
  assert outcome.correct == (reward == 1.0)
  assert outcome.details["answer"] == answer and outcome.details["ground_truth"] == task.answer


def test_truncated_and_missing_response_gen(family):
  task = _task(number(541.3))
  truncated = family.score(task, _episode(task, _final("541.3 km")), truncated=True)
  assert (truncated.reward, truncated.answered) == (-1.0, False)
  call = "<think>look</think>\n" + format_tool_call("maps_search", {"origin": "A",
                                                                   "destination": "B"})
  for episode in (_episode(task, call), _episode(task, "<think>x</think>The answer is 541.3 km."),
                  _episode(task)):
    outcome = family.score(task, episode, truncated=False)
    assert (outcome.reward, outcome.correct, outcome.answered) == (-1.0, False, False)
  lenient = ToolWorldFamily(truncated_outcome=0.0)
  assert lenient.score(task, _episode(task, call), truncated=False).reward == 0.0
  bad = "<think>x</think>\n" + format_tool_call("response_gen", {"text": "541.3"})
  assert family.score(task, _episode(task, bad), truncated=False).reward == -1.0


def test_format_gated_reward():
  """wrong_outcome and malformed_outcome: APPO's reward shape (bad format -1, wrong 0)."""
  task = _task(number(541.3))
  gated = ToolWorldFamily(wrong_outcome=0.0, malformed_outcome=-1.0)
  broken = ('<think>look</think>\n<tool_call>\n{"name": "maps_search", "arguments": '
            '{"origin": "A", "parameters": {"destination": "B"}}\n</tool_call>')
  assert not parse_step(broken).fields_ok  # a brace short, as SmolLM2 writes it after SFT
  lookup = "<think>look</think>\n" + format_tool_call("maps_search", {"origin": "A",
                                                                     "destination": "B"})
  cases = [  # (steps, gated reward, PORTool reward, correct, answered)
      ((lookup, _final("541.3 km")), 1.0, 1.0, True, True),
      ((lookup, _final("612 km")), 0.0, -1.0, False, True),
      ((lookup, _final("I am unable to answer.")), 0.0, 0.0, False, False),
      ((broken, _final("612 km")), -1.0, -1.0, False, True),
      ((broken, _final("541.3 km")), -1.0, 1.0, True, True),  # the gate wins
      ((broken, _final("I am unable to answer.")), -1.0, 0.0, False, False),
      ((lookup, "<think>x</think>The answer is 541.3 km."), -1.0, -1.0, False, False),
  ]
  portool = ToolWorldFamily()
  for steps, want, want_portool, correct, answered in cases:
    outcome = gated.score(task, _episode(task, *steps), truncated=False)
    assert (outcome.reward, outcome.correct, outcome.answered) == (want, correct, answered)
    assert outcome.details.get("malformed", False) == (steps[0] is broken and
                                                       steps[-1].startswith("<think>done"))
    assert portool.score(task, _episode(task, *steps), truncated=False).reward == want_portool
  assert gated.score(task, _episode(task, lookup, _final("541.3 km")),
                     truncated=True).reward == -1.0
  # wrong_outcome alone leaves malformed episodes on their answer's reward
  assert ToolWorldFamily(wrong_outcome=0.0).score(
      task, _episode(task, broken, _final("612 km")), truncated=False).reward == 0.0


def test_stock_threshold_accepts_both_routes():
  family = ToolWorldFamily(difficulties=(2, 3))
  tasks = [t for t in family.generate("train", 60, seed=0)
           if t.metadata["template"].startswith("stock_threshold")]
  assert tasks
  task = tasks[0]
  routes = [task.oracle, *task.metadata["oracle_alternatives"]]
  assert len(routes) == 2
  # Route A converts the threshold, route B the price; both reach the same verdict.
  converted = [[m for m in r if m["role"] == "tool" and m["name"] == "conversion_calculation"]
               for r in routes]
  assert converted[0] != converted[1]
  for route in routes:
    assert family.score(task, [*task.messages, *route], truncated=False).reward == 1.0
  wrong = "No." if task.answer["value"] == "yes" else "Yes."
  assert family.score(task, _episode(task, _final(wrong)), truncated=False).reward == -1.0
