"""Tests of the multi-hop search QA family: world, BM25 search, EM/F1, splits and oracle."""

from __future__ import annotations

import json

import pytest

from tree_rl.envs.executor import ToolExecutor, tool_message
from tree_rl.envs.parsing import format_tool_call, parse_step
from tree_rl.envs.search_qa import (SearchQAFamily, World, exact_match, make_entities,
                                    normalize_answer, token_f1)


@pytest.fixture(scope="module")
def family():
  return SearchQAFamily(num_entities=150, hops=(2, 3, 4))


def test_corpus_is_deterministic_in_the_seed():
  a, b = World(3, 80), World(3, 80)
  assert a.docs == b.docs
  assert World(4, 80).docs != a.docs
  entities = make_entities(3, 80)
  assert len(entities) == 80 and len({e.name for e in entities}) == 80
  words = [w for e in entities for w in e.name.split()
           if w not in ("River", "University", "Institute", "College", "Labs", "Holdings",
                        "Industries", "Systems", "Works")]
  assert len(words) == len(set(words))  # no word is shared by two names
  with pytest.raises(ValueError):
    make_entities(0, 10)


def test_search_finds_each_entity_by_name(family):
  world = family.world
  for name in world.names:
    assert world.search(name, top_k=1)[0]["title"] == name
  hits = world.search(world.names[0] + " capital", top_k=5)
  assert len(hits) == 5 and hits == world.search(world.names[0] + " capital", top_k=5)
  assert all(set(h) == {"title", "text"} for h in hits)
  assert world.search("zzzz qqqq") == []  # no known token
  for bad in (0, 11, True):
    with pytest.raises(ValueError):
      world.search("x", top_k=bad)
  with pytest.raises(ValueError):
    world.search("  ")


def test_search_tool_through_executor(family):
  task = family.generate("eval", 1, seed=0)[0]
  (tool,) = family.tools(task)
  executor = ToolExecutor([tool])
  name = task.metadata["chain"][0]
  call = parse_step(format_tool_call("search", {"query": name})).calls
  (result,) = executor.execute(call)
  assert result.ok and json.loads(result.content)[0]["title"] == name
  assert 1 <= len(json.loads(result.content)) <= 3  # default top_k; only scoring documents
  bad = parse_step(format_tool_call("search", {"query": name, "top_k": 50})).calls
  assert not executor.execute(bad)[0].ok


def test_normalisation_em_and_f1():
  assert normalize_answer("  The Dravon   River! ") == "dravon river"
  assert normalize_answer("An apple, a pear.") == "apple pear"
  assert exact_match("the Dravon river.", ["Dravon River"]) == 1.0
  assert exact_match("Dravon", ["Dravon River", "Dravon"]) == 1.0
  assert exact_match("Dravon delta", ["Dravon River"]) == 0.0
  # "dravon river delta" vs "dravon river": precision 2/3, recall 1, F1 = 2*(2/3)/(5/3) = 0.8.
  assert token_f1("Dravon River delta", ["Dravon River"]) == pytest.approx(0.8)
  # "alia" vs "alia verron": precision 1, recall 1/2, F1 = 2/3; the best gold wins.
  assert token_f1("Alia", ["Alia Verron"]) == pytest.approx(2 / 3)
  assert token_f1("Alia", ["Bo Chen", "Alia Verron"]) == pytest.approx(2 / 3)
  assert token_f1("the", ["Alia"]) == 0.0


def test_score_rules():
  fam_f1 = SearchQAFamily(num_entities=150, reward="f1")
  fam_em = SearchQAFamily(num_entities=150, reward="em")
  task = next(t for t in fam_em.generate("train", 30, seed=0)  # a one-word answer
              if t.answer["aliases"] == [t.answer["answer"]] and " " not in t.answer["answer"])
  gold = task.answer["answer"]

  def episode(text):
    return list(task.messages) + [{"role": "assistant", "content": text}]

  out = fam_em.score(task, episode(f"<think>x</think><answer>The {gold}.</answer>"), False)
  assert out.reward == 1.0 and out.correct and out.answered and out.details["f1"] == 1.0
  partial = episode(f"<think>x</think><answer>{gold} maybe</answer>")
  assert fam_em.score(task, partial, False).reward == 0.0
  out = fam_f1.score(task, partial, False)
  assert out.reward == pytest.approx(2 / 3) and not out.correct
  assert out.details["prediction"] == f"{gold} maybe"
  truncated = fam_f1.score(task, episode(f"<answer>{gold}</answer>"), True)
  assert truncated.reward == 0.0 and not truncated.answered
  call = episode("<think>x</think>" + format_tool_call("search", {"query": gold}))
  assert not fam_f1.score(task, call, False).answered
  assert not fam_f1.score(task, list(task.messages), False).answered


def test_generate_is_deterministic_and_splits_are_disjoint(family):
  train = family.generate("train", 150, seed=1)
  assert train == family.generate("train", 150, seed=1)
  assert [t.messages for t in train] != [t.messages for t in family.generate("train", 150, 2)]
  evals = family.generate("eval", 100, seed=1)
  questions = lambda ts: {t.messages[-1]["content"] for t in ts}
  assert len(questions(train)) == 150 and len(questions(evals)) == 100
  assert not questions(train) & questions(evals)
  anchors = lambda ts: {t.metadata["chain"][0] for t in ts}
  assert not anchors(train) & anchors(evals)
  assert {t.difficulty for t in train} == {2, 3, 4}
  assert all(t.metadata["world_seed"] == 0 for t in train + evals)
  with pytest.raises(ValueError, match="only"):
    family.generate("eval", 100_000, seed=0)


def test_oracle_solves_every_task_through_the_real_tool(family):
  tasks = family.generate("train", 60, seed=0) + family.generate("eval", 40, seed=0)
  for task in tasks:
    executor = ToolExecutor(family.tools(task))
    replay = list(task.messages)
    oracle = list(task.oracle)
    assert len(oracle) == 2 * task.difficulty + 1
    for i in range(0, len(oracle) - 1, 2):
      step, expected = oracle[i], oracle[i + 1]
      calls = parse_step(step["content"]).calls
      (result,) = executor.execute(calls)
      assert tool_message(result) == expected
      # The document of the entity this hop looks up is among the results.
      hop_entity = task.metadata["chain"][i // 2]
      assert hop_entity in [h["title"] for h in json.loads(result.content)]
      replay += [step, tool_message(result)]
    replay.append(oracle[-1])
    out = family.score(task, replay, truncated=False)
    assert out.correct and out.reward == 1.0, (task.task_id, out)
    assert len(oracle) // 2 + 1 <= family.max_turns
