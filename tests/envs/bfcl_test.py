"""Tests of the BFCL family: data loading, splits, the AST checker and the AWPO reward."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tree_rl.envs import bfcl_data
from tree_rl.envs.bfcl import BFCLFamily, ast_match, normalize_string, reference_calls
from tree_rl.envs.bfcl_data import CATEGORIES, BfclItem, load_eval_items
from tree_rl.envs.executor import ToolExecutor
from tree_rl.envs.parsing import format_tool_call

_TYPES = {"dict", "object", "integer", "float", "number", "string", "array", "tuple",
          "boolean", "any"}


def _check_schema(schema, where):
  """Every node has a known type; objects list their required keys among their properties."""
  assert isinstance(schema, dict), where
  assert schema.get("type", "any") in _TYPES, (where, schema.get("type"))
  props = schema.get("properties")
  if props is not None:
    assert isinstance(props, dict), where
    assert set(schema.get("required", ())) <= set(props), where
    for key, sub in props.items():
      _check_schema(sub, f"{where}.{key}")
  elif schema.get("type") in ("dict", "object"):
    assert schema.get("additionalProperties") is True, where  # free-form map
  if "items" in schema:
    _check_schema(schema["items"], f"{where}[]")


def _check_task_tools(family, task):
  tools = family.tools(task)
  assert [t.name for t in tools] == list(task.tool_names)
  assert len(set(task.tool_names)) == len(tools)
  ToolExecutor(tools)  # unique names
  for tool in tools:
    assert tool.parameters["type"] == "dict"
    _check_schema(dict(tool.parameters), tool.name)
    json.dumps(tool.schema())
  for call in task.metadata["reference_calls"]:
    assert call["name"] in task.tool_names


def _step(text):
  return [{"role": "assistant", "content": text}]


def _calls_step(*calls, think="ok"):
  return _step(f"<think>{think}</think>\n" + "\n".join(format_tool_call(n, a) for n, a in calls))


# ----------------------------------------------------------------------------- data


@pytest.mark.parametrize("category,count", [("simple", 400), ("multiple", 200), ("parallel", 200),
                                            ("parallel_multiple", 200), ("irrelevance", 240)])
def test_eval_category_loads_with_valid_tools(category, count):
  items = load_eval_items(category)
  assert len(items) == count
  assert all(it.category == category and it.question for it in items)
  assert all(bool(it.ground_truth) == (category != "irrelevance") for it in items)
  family = BFCLFamily(categories=(category,))
  tasks = family.generate("eval", count, seed=0)
  assert len({t.task_id for t in tasks}) == count
  for task in tasks:
    assert task.family == "bfcl" and task.split == "eval"
    assert task.messages[0]["role"] == "system" and task.messages[-1]["role"] == "user"
    _check_task_tools(family, task)


def test_missing_package_names_the_fix(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModuleNotFoundError, match="pip install --no-deps bfcl-eval"):
    bfcl_data.bfcl_data_dir()


def test_generate_is_deterministic_and_seeded():
  family = BFCLFamily()
  for split in ("eval", "train"):
    a, b = family.generate(split, 60, seed=5), family.generate(split, 60, seed=5)
    assert a == b
    c = family.generate(split, 60, seed=6)
    assert [t.messages for t in a] != [t.messages for t in c]
  cats = {t.metadata["category"] for t in family.generate("eval", 100, seed=1)}
  assert cats == set(CATEGORIES)  # a sample spans the categories
  with pytest.raises(ValueError, match="only 1240"):
    family.generate("eval", 5000, seed=0)


def test_train_is_synthetic_valid_and_disjoint_from_eval():
  family = BFCLFamily()
  train = family.generate("train", 500, seed=0)
  questions = [t.messages[-1]["content"] for t in train]
  assert len(set(questions)) == len(questions)
  eval_questions = {m["content"] for c in CATEGORIES for it in load_eval_items(c)
                    for m in it.messages}
  assert not set(questions) & eval_questions
  by_cat = {c: [t for t in train if t.metadata["category"] == c] for c in CATEGORIES}
  assert all(len(v) == 100 for v in by_cat.values())
  assert all(len(t.answer) == 1 for t in by_cat["simple"] + by_cat["multiple"])
  assert all(len(t.tool_names) >= 2 for t in by_cat["multiple"])
  assert all(len(t.answer) >= 2 and len(t.tool_names) == 1 for t in by_cat["parallel"])
  assert all(len({next(iter(c)) for c in t.answer}) >= 2 for t in by_cat["parallel_multiple"])
  assert all(t.answer == [] for t in by_cat["irrelevance"])
  for task in train:
    _check_task_tools(family, task)


# ----------------------------------------------------------------------------- AST checker

FUNCS = [
    {"name": "weather.get", "description": "Weather.", "parameters": {
        "type": "dict", "required": ["city"],
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"},
                       "days": {"type": "integer"}}}},
    {"name": "time.now", "description": "Time.", "parameters": {
        "type": "dict", "required": ["tz"], "properties": {"tz": {"type": "string"}}}},
    {"name": "area", "description": "Area.", "parameters": {
        "type": "dict", "required": ["radius"], "properties": {"radius": {"type": "float"}}}},
    {"name": "update", "description": "Update.", "parameters": {
        "type": "dict", "required": ["info"], "properties": {"info": {
            "type": "dict", "properties": {"email": {"type": "string"},
                                           "phone": {"type": "string"}}}}}},
]
WEATHER = {"weather.get": {"city": ["Paris", "Paris, France"], "unit": ["celsius", ""],
                           "days": ["", 1]}}
TIME = {"time.now": {"tz": ["Europe/Paris"]}}


def call(name, **arguments):
  return {"name": name, "arguments": arguments}


def test_ast_optional_parameters_and_values():
  assert ast_match(FUNCS, [WEATHER], [call("weather.get", city="Paris", unit="celsius")])[0]
  assert ast_match(FUNCS, [WEATHER], [call("weather.get", city="Paris")])[0]  # "" acceptable
  assert ast_match(FUNCS, [WEATHER], [call("weather.get", city="paris,  france", days=1)])[0]
  ok, why = ast_match(FUNCS, [WEATHER], [call("weather.get", city="Lyon")])
  assert not ok and "city" in why
  assert not ast_match(FUNCS, [WEATHER], [call("weather.get", unit="celsius")])[0]  # required
  assert not ast_match(FUNCS, [WEATHER], [call("weather.get", city="Paris", wind=True)])[0]
  assert not ast_match(FUNCS, [TIME], [call("time.now")])[0]
  assert not ast_match(FUNCS, [WEATHER], [call("time.now", tz="Europe/Paris")])[0]
  assert normalize_string("New-York City") == normalize_string("new york_city")


def test_ast_numeric_types():
  area = {"area": {"radius": [5.0]}}
  assert ast_match(FUNCS, [area], [call("area", radius=5)])[0]  # int for a float parameter
  assert ast_match(FUNCS, [area], [call("area", radius=5.0)])[0]
  assert not ast_match(FUNCS, [area], [call("area", radius=5.5)])[0]
  assert not ast_match(FUNCS, [area], [call("area", radius="5")])[0]
  days = {"weather.get": {"city": ["Paris"], "days": [3]}}
  assert ast_match(FUNCS, [days], [call("weather.get", city="Paris", days=3)])[0]
  assert not ast_match(FUNCS, [days], [call("weather.get", city="Paris", days=3.0)])[0]
  assert not ast_match(FUNCS, [{"weather.get": {"city": ["Paris"], "days": [1]}}],
                       [call("weather.get", city="Paris", days=True)])[0]


def test_ast_parallel_order_extra_calls_and_pairing():
  gt = [WEATHER, TIME]
  pair = [call("weather.get", city="Paris"), call("time.now", tz="Europe/Paris")]
  assert ast_match(FUNCS, gt, pair)[0]
  assert ast_match(FUNCS, gt, pair[::-1])[0]  # order does not matter
  assert not ast_match(FUNCS, gt, pair + [call("time.now", tz="UTC")])[0]  # extra call
  assert not ast_match(FUNCS, gt, pair[:1])[0]  # missing call
  # Greedy pairing would give the first answer call the first prediction and fail.
  loose = {"weather.get": {"city": ["Paris", "Rome"]}}
  strict = {"weather.get": {"city": ["Paris"]}}
  preds = [call("weather.get", city="Paris"), call("weather.get", city="Rome")]
  assert ast_match(FUNCS, [loose, strict], preds)[0]
  assert not ast_match(FUNCS, [strict, strict], preds)[0]


def test_ast_dict_templates_and_irrelevance():
  gt = [{"update": {"info": [{"email": ["a@b.org"], "phone": [""]}]}}]
  assert ast_match(FUNCS, gt, [call("update", info={"email": "a@b.org"})])[0]
  assert not ast_match(FUNCS, gt, [call("update", info={"email": "x@b.org"})])[0]
  assert not ast_match(FUNCS, gt, [call("update", info={"email": "a@b.org", "fax": "1"})])[0]
  assert not ast_match(FUNCS, gt, [call("update", info={"phone": "1"})])[0]
  assert ast_match(FUNCS, [], [])[0]
  assert not ast_match(FUNCS, [], [call("time.now", tz="UTC")])[0]


def test_reference_calls_take_first_values_and_skip_omittable():
  item = BfclItem("x", "parallel_multiple", ({"role": "user", "content": "q"},), tuple(FUNCS),
                  (WEATHER, TIME, {"update": {"info": [{"email": ["a@b.org"], "phone": [""]}]}}))
  assert reference_calls(item) == [call("weather.get", city="Paris"),
                                   call("time.now", tz="Europe/Paris"),
                                   call("update", info={"email": "a@b.org"})]


# ----------------------------------------------------------------------------- scoring


def _task(*gt, category="parallel_multiple", no_call="match"):
  family = BFCLFamily(no_call=no_call)
  item = BfclItem("hand", category, ({"role": "user", "content": "q"},), tuple(FUNCS), gt)
  return family, family.task_from_item(item, "eval", "bfcl/eval/hand")


def test_score_awpo_partial_match_end_to_end():
  gt = ({"weather.get": {"city": ["Paris"], "unit": ["C"]}}, TIME)
  family, task = _task(*gt)
  episode = list(task.messages) + _calls_step(("weather.get", {"city": "Paris", "unit": "F"}))
  out = family.score(task, episode, truncated=True)
  # r_name 1/2, r_para 1, r_value 1 (city) over 1 + 2 calls + 3 arguments.
  assert out.reward == pytest.approx(1 + 2.5 / 6)
  assert out.details["s_exec"] == pytest.approx(2.5 / 6)
  assert out.details["format_ok"] and not out.correct and out.answered
  full = list(task.messages) + _calls_step(("time.now", {"tz": "Europe/Paris"}),
                                           ("weather.get", {"city": "paris", "unit": "C"}))
  out = family.score(task, full, truncated=True)
  # AST-correct (case-insensitive); S_exec misses only the exact value "Paris".
  assert out.correct and out.reward == pytest.approx(1 + (1 + 2 + 2) / 6)


def test_score_format_failures():
  family, task = _task(TIME)
  good = ("time.now", {"tz": "Europe/Paris"})
  no_think = _step(format_tool_call(*good))
  assert family.score(task, list(task.messages) + no_think, False).reward == 0.0
  bad_json = _step('<think>x</think>\n<tool_call>{"name": "time.now", </tool_call>')
  out = family.score(task, list(task.messages) + bad_json, False)
  assert out.reward == 0.0 and not out.correct and not out.details["format_ok"]
  empty = family.score(task, list(task.messages) + _step("<think>x</think>"), False)
  assert empty.reward == 0.0 and not empty.answered
  assert family.score(task, list(task.messages), False).reward == 0.0  # no step at all
  ok = family.score(task, list(task.messages) + _calls_step(good), True)
  assert ok.reward == 2.0 and ok.correct


def test_score_irrelevance():
  family, task = _task(category="irrelevance")
  answer = _step("<think>nothing fits</think>\n<answer>I cannot help with that.</answer>")
  out = family.score(task, list(task.messages) + answer, False)
  assert out.reward == 2.0 and out.correct and out.answered
  called = family.score(task, list(task.messages) + _calls_step(("time.now", {"tz": "UTC"})), True)
  assert called.reward == 1.0 and not called.correct
  malformed = _step("<think>x</think>\n<tool_call>{oops</tool_call>")
  out = family.score(task, list(task.messages) + malformed, False)
  assert out.correct and out.reward == 0.0  # BFCL: no decodable call; AWPO: bad format
  family, task = _task(category="irrelevance", no_call="toolrl")
  assert family.score(task, list(task.messages) + answer, False).reward == 1.0


def test_oracle_is_correct_with_full_reward():
  family = BFCLFamily()
  tasks = family.generate("eval", 200, seed=0) + family.generate("train", 200, seed=0)
  for task in tasks:
    out = family.score(task, list(task.messages) + list(task.oracle), truncated=True)
    assert out.correct and out.reward == 2.0, (task.task_id, out)
    tools = {t.name: t for t in family.tools(task)}
    for message in task.oracle[1:]:
      assert message["role"] == "tool" and message["name"] in tools
