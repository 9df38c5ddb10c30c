"""Every task family end to end through the evaluation harness.

The oracle policy replays each task's oracle steps as model text; the harness
parses them, runs the real tools through the executor and scores the episode
with the family's verifier. Every family must come out at accuracy 1.
"""

import pytest

from tree_rl.envs import FAMILIES, TaskFamily, make_family
from tree_rl.evaluate import evaluate, replay_oracle_policy


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_oracle_policy_solves_every_family(name):
  family = make_family(name)
  assert isinstance(family, TaskFamily)
  tasks = family.generate("train", 12, seed=3) + family.generate("eval", 12, seed=3)
  report = evaluate(family, tasks, replay_oracle_policy(tasks))
  assert report.metrics["accuracy"] == 1.0, report.table()
  assert report.metrics["unanswerable_rate"] == 0.0
  assert report.metrics["num_episodes"] == 24


def test_unknown_family_lists_the_valid_ones():
  with pytest.raises(ValueError, match="toolworld"):
    make_family("tool_world")


def test_toolworld_tool_subsets_keep_the_oracle_solvable():
  family = make_family("toolworld", tools_per_task=6, difficulties=(1, 2, 3), max_turns=4)
  tasks = family.generate("train", 24, seed=5) + family.generate("eval", 12, seed=5)
  for t in tasks:
    assert len(t.tool_names) == 6 and "response_gen" in t.tool_names
    assert {x.name for x in family.tools(t)} == set(t.tool_names)
    assert all(f'"name": "{n}"' in t.messages[0]["content"] for n in t.tool_names)
  assert evaluate(family, tasks, replay_oracle_policy(tasks)).metrics["accuracy"] == 1.0
  # The full setting is unchanged: all 17 tools.
  assert len(make_family("toolworld").generate("train", 1, seed=5)[0].tool_names) == 17


def test_tool_latency_delays_every_call_and_concurrent_calls_overlap():
  import time  # noqa: PLC0415

  from tree_rl.envs.episode import run_episodes  # noqa: PLC0415

  latency = 0.4
  family = make_family("search_qa", tool_latency_s=latency)
  assert isinstance(family, TaskFamily) and family.name == "search_qa"
  tasks = family.generate("train", 4, seed=0)
  assert tasks == make_family("search_qa").generate("train", 4, seed=0)  # same tasks
  plain = {t.name: t.timeout_s for t in make_family("search_qa").tools(tasks[0])}
  assert {t.name: t.timeout_s - latency for t in family.tools(tasks[0])} == plain
  # One oracle step per task: 4 episodes, one call each, run by the episode pool (the same
  # `advance` over a thread pool that the agent loop's Forest uses).
  start = time.monotonic()
  records = run_episodes(family, tasks, replay_oracle_policy(tasks), max_turns=1,
                         max_workers=4)
  wall = time.monotonic() - start
  results = [r for rec in records for s in rec.steps for r in s.results]
  assert len(results) >= 4 and all(r.ok for r in results)
  assert all(r.seconds >= latency for r in results)  # every call waited
  assert wall >= latency
  assert wall < 2.5 * latency, wall  # overlapped: one after the other would take >= 4x


@pytest.mark.parametrize("bad", [-1.0, "1", float("nan"), True])
def test_tool_latency_must_be_a_number_of_seconds(bad):
  with pytest.raises(ValueError, match=r"task\.kwargs\.tool_latency_s"):
    make_family("toolworld", tool_latency_s=bad)
