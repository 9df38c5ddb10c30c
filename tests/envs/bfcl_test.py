"""Tests of the BFCL family: data loading, splits, the AST checker and the AWPO reward."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tree_rl.envs import bfcl, bfcl_data
from tree_rl.envs.bfcl import BFCLFamily, normalize_string, reference_calls
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
# Hand-worked verdicts of BFCL's AST rule; each runs through our restatement and, when
# bfcl-eval is installed, through BFCL's own checker (tests/envs/bfcl_official_test.py
# compares the two on every shipped item).

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
    {"name": "fit", "description": "Fit.", "parameters": {
        "type": "dict", "required": ["x"], "properties": {
            "x": {"type": "array", "items": {"type": "float"}},
            "weights": {"type": "array", "items": {"type": "float"}},
            "rows": {"type": "array", "items": {"type": "dict"}}}}},
]
WEATHER = {"weather.get": {"city": ["Paris", "Paris, France"], "unit": ["celsius", ""],
                           "days": ["", 1]}}
TIME = {"time.now": {"tz": ["Europe/Paris"]}}
CHECKERS = ["tree_rl"] + (["bfcl_eval"] if bfcl.official_checker() is not None else [])


def call(name, **arguments):
  return {"name": name, "arguments": arguments}


@pytest.fixture(params=CHECKERS)
def check(request):
  """ast_match with the checker under test; the category defaults to "multiple" (one call,
  checked against the function the answer names)."""

  def run(ground_truth, calls, category="multiple"):
    return bfcl.ast_match(FUNCS, ground_truth, calls, category, request.param)

  return run


def test_ast_strings_ignore_only_ascii_spaces_and_some_punctuation(check):
  assert check([WEATHER], [call("weather.get", city="Paris", unit="celsius")]).valid
  assert check([WEATHER], [call("weather.get", city="paris,  france", days=1)]).valid
  assert check([WEATHER], [call("weather.get", city=" PARIS ")]).valid
  for city in ("Paris\n", "\tParis", "Paris\u00a0", "Paris,\u00a0France", "Paris,\nFrance"):
    verdict = check([WEATHER], [call("weather.get", city=city)])
    assert verdict == (False, "value_error:string", verdict.error) and repr(city) in verdict.error
  assert normalize_string("New-York City") == normalize_string("new york_city")
  assert normalize_string("Toronto\n") != normalize_string("Toronto")


def test_ast_parameters_required_optional_and_unknown(check):
  assert check([WEATHER], [call("weather.get", city="Paris")]).valid  # "" acceptable
  assert check([WEATHER], [call("weather.get", unit="celsius")]).error_type == (
      "simple_function_checker:missing_required")
  assert check([TIME], [call("time.now", tz="Europe/Paris", wind=True)]).error_type == (
      "simple_function_checker:unexpected_param")
  strict = {"weather.get": {"city": ["Paris"], "unit": ["celsius"]}}  # no "": must be given
  assert check([strict], [call("weather.get", city="Paris")]).error_type == (
      "simple_function_checker:missing_optional")
  no_days = {"weather.get": {"city": ["Paris"]}}  # declared, but not in the answer
  assert check([no_days], [call("weather.get", city="Paris", days=1)]).error_type == (
      "simple_function_checker:unexpected_param")
  assert check([WEATHER], [call("time.now", tz="Europe/Paris")]).error_type == (
      "simple_function_checker:wrong_func_name")
  assert check([WEATHER], [call("weather_get", city="Paris")]).error_type == (
      "simple_function_checker:wrong_func_name")  # dots are kept, as for Qwen's FC mode


def test_ast_numeric_and_boolean_types(check):
  area = {"area": {"radius": [5.0]}}
  assert check([area], [call("area", radius=5)]).valid  # int promoted for a float
  assert check([area], [call("area", radius=5.0)]).valid
  assert not check([area], [call("area", radius=5.5)]).valid
  assert check([area], [call("area", radius="5")]).error_type == "type_error:simple"
  assert check([area], [call("area", radius=True)]).error_type == "type_error:simple"
  days = {"weather.get": {"city": ["Paris"], "days": [3]}}
  assert check([days], [call("weather.get", city="Paris", days=3)]).valid
  assert check([days], [call("weather.get", city="Paris", days=3.0)]).error_type == (
      "type_error:simple")
  one = {"weather.get": {"city": ["Paris"], "days": [1]}}
  assert check([one], [call("weather.get", city="Paris", days=True)]).error_type == (
      "type_error:simple")


def test_ast_float_arrays_reject_integer_items_unless_optional(check):
  fit = {"fit": {"x": [[1.0, 2.0]]}}
  assert check([fit], [call("fit", x=[1.0, 2.0])]).valid
  assert check([fit], [call("fit", x=[1, 2])]).error_type == "type_error:nested"
  assert check([fit], [call("fit", x=[1.0, "2"])]).error_type == "type_error:nested"
  assert check([fit], [call("fit", x=[2.0, 1.0])]).error_type == "value_error:list/tuple"
  # BFCL's quirk: an acceptable "" (optional) is not a list, so it lets the items through
  # unchecked, and [1, 2] == [1.0, 2.0] in Python; [] matches "" (both have length 0).
  loose = {"fit": {"x": [[1.0]], "weights": ["", [1.0, 2.0]]}}
  assert check([loose], [call("fit", x=[1.0], weights=[1, 2])]).valid
  assert check([loose], [call("fit", x=[1.0], weights=[])]).valid


def test_ast_variables_compare_exactly(check):
  """An answer of another type than the schema's (a string naming a variable) is compared
  with ==, without string normalisation."""
  fit = {"fit": {"x": ["data['x']"]}}
  assert check([fit], [call("fit", x="data['x']")]).valid
  assert check([fit], [call("fit", x="data['x'] ")]).error_type == "value_error:others"
  assert check([fit], [call("fit", x=[1.0, 2.0])]).error_type == "value_error:others"
  assert check([fit], [call("fit", x=1.0)]).error_type == "type_error:simple"


def test_ast_dicts_and_lists_of_dicts(check):
  gt = [{"update": {"info": [{"email": ["a@b.org"], "phone": [""]}]}}]
  assert check(gt, [call("update", info={"email": "A@B.org"})]).valid
  assert check(gt, [call("update", info={"email": "x@b.org"})]).error_type == (
      "value_error:dict_value")
  assert check(gt, [call("update", info={"email": "a@b.org", "fax": "1"})]).error_type == (
      "value_error:dict_key")
  assert check(gt, [call("update", info={"phone": ""})]).error_type == "value_error:dict_key"
  # Dict values are compared with == and no type check: True == 1.
  flag = [{"update": {"info": [{"email": [1]}]}}]
  assert check(flag, [call("update", info={"email": True})]).valid
  rows = [{"fit": {"x": [[1.0]], "rows": [[{"k": ["a"]}, {"k": ["b"]}]]}}]
  assert check(rows, [call("fit", x=[1.0], rows=[{"k": "a"}, {"k": "b"}])]).valid
  assert check(rows, [call("fit", x=[1.0], rows=[{"k": "b"}, {"k": "a"}])]).error_type == (
      "value_error:dict_value")
  assert check(rows, [call("fit", x=[1.0], rows=[{"k": "a"}])]).error_type == (
      "value_error:list_dict_count")


def test_ast_checker_crashes_are_wrong_answers(check):
  # BFCL's checker raises on these; both rules report a wrong answer that says so.
  huge = check([{"area": {"radius": [5.0]}}], [call("area", radius=10 ** 400)])
  assert huge == (False, "ast_checker:raised", huge.error) and "OverflowError" in huge.error
  # "" among the acceptable lists of dicts skips the item type check, then the dict check
  # reads .items() of a number.
  rows = [{"fit": {"x": [[1.0]], "rows": ["", [{"k": ["a"]}]]}}]
  crash = check(rows, [call("fit", x=[1.0], rows=[5])])
  assert crash.error_type == "ast_checker:raised" and "AttributeError" in crash.error
  lost = check([{"gone": {"a": [1]}}, TIME], [call("time.now", tz="UTC")] * 2, "parallel")
  assert lost.error_type == "ast_checker:raised" and "TypeError" in lost.error


def test_ast_parallel_first_fit_depends_on_call_order(check):
  gt = [WEATHER, TIME]
  pair = [call("weather.get", city="Paris"), call("time.now", tz="Europe/Paris")]
  for category in ("parallel", "parallel_multiple"):
    assert check(gt, pair, category).valid
    assert check(gt, pair[::-1], category).valid
    assert check(gt, pair + [call("time.now", tz="UTC")], category).error_type == (
        "parallel_function_checker_no_order:wrong_count")
    assert check(gt, pair[:1], category).error_type == (
        "parallel_function_checker_no_order:wrong_count")
  # Each answer call takes the first unused call that fits it: the loose one takes "Paris"
  # and leaves only "Rome" for the strict one. The other order matches.
  loose = {"weather.get": {"city": ["Paris", "Rome"]}}
  strict = {"weather.get": {"city": ["Paris"]}}
  paris, rome = call("weather.get", city="Paris"), call("weather.get", city="Rome")
  assert check([loose, strict], [paris, rome], "parallel").error_type == (
      "parallel_function_checker_no_order:cannot_find_match")
  assert check([loose, strict], [rome, paris], "parallel").valid


def test_ast_simple_and_multiple_take_exactly_one_call(check):
  one = [call("weather.get", city="Paris")]
  assert check([WEATHER], one, "simple").valid and check([WEATHER], one, "multiple").valid
  assert check([WEATHER], one * 2, "simple").error_type == "simple_function_checker:wrong_count"
  assert check([WEATHER], one * 2, "multiple").error_type == (
      "multiple_function_checker:wrong_count")
  assert check([WEATHER], [], "multiple").error_type == "multiple_function_checker:wrong_count"
  # simple checks against the first function doc, multiple against the answer's function.
  area = [{"area": {"radius": [1.0]}}]
  assert check(area, [call("area", radius=1.0)], "multiple").valid
  assert check(area, [call("area", radius=1.0)], "simple").error_type == (
      "simple_function_checker:wrong_func_name")


def test_ast_irrelevance_and_bad_arguments(check):
  assert check([], [], "irrelevance").valid
  assert check([], [call("time.now", tz="UTC")], "irrelevance").error_type == (
      "irrelevance_error:decoder_success")
  with pytest.raises(ValueError, match="must have no possible answer"):
    check([TIME], [], "irrelevance")
  with pytest.raises(ValueError, match="must have a possible answer"):
    check([], [], "parallel")
  with pytest.raises(ValueError, match="unknown BFCL category 'live_simple'"):
    check([TIME], [], "live_simple")
  with pytest.raises(ValueError, match="checker must be"):
    bfcl.ast_match(FUNCS, [TIME], [], "simple", "auto")


def test_reference_calls_take_first_values_and_skip_omittable():
  item = BfclItem("x", "parallel_multiple", ({"role": "user", "content": "q"},), tuple(FUNCS),
                  (WEATHER, TIME, {"update": {"info": [{"email": ["a@b.org"], "phone": [""]}]}}))
  assert reference_calls(item) == [call("weather.get", city="Paris"),
                                   call("time.now", tz="Europe/Paris"),
                                   call("update", info={"email": "a@b.org"})]


# ----------------------------------------------------------------------------- scoring


def _task(*gt, category="parallel_multiple", no_call="match", checker="auto"):
  family = BFCLFamily(no_call=no_call, checker=checker)
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
  assert called.details["ast_error_type"] == "irrelevance_error:decoder_success"
  malformed = _step("<think>x</think>\n<tool_call>{oops</tool_call>")
  out = family.score(task, list(task.messages) + malformed, False)
  assert out.correct and out.reward == 0.0  # BFCL: no decodable call; AWPO: bad format
  family, task = _task(category="irrelevance", no_call="toolrl")
  assert family.score(task, list(task.messages) + answer, False).reward == 1.0


@pytest.mark.parametrize("checker", CHECKERS)
def test_score_malformed_block_fails_decoding(checker):
  """Any malformed block fails the step's decoding, as an exception in a BFCL handler's
  decoder does: wrong where calls are expected, "no call" (right) for irrelevance."""
  good = _calls_step(("time.now", {"tz": "Europe/Paris"}))[0]["content"]
  step = _step(good + "\n<tool_call>{oops</tool_call>")
  family, task = _task(TIME, category="multiple", checker=checker)
  out = family.score(task, list(task.messages) + step, False)
  assert not out.correct and out.details["ast_error_type"] == "ast_decoder:decoder_failed"
  assert family.score(task, list(task.messages) + _step(good), False).correct
  family, task = _task(category="irrelevance", checker=checker)
  assert family.score(task, list(task.messages) + step, False).correct


def test_family_says_which_checker_scored(monkeypatch):
  family, task = _task(TIME, category="multiple", checker="tree_rl")
  episode = list(task.messages) + _calls_step(("time.now", {"tz": "Europe/Paris"}))
  assert family.checker == "tree_rl" and family.score(task, episode, False).details[
      "checker"] == "tree_rl"
  with pytest.raises(ValueError, match="checker must be one of"):
    BFCLFamily(checker="official")
  monkeypatch.setattr(bfcl, "official_checker", lambda: None)  # bfcl-eval not installed
  family = BFCLFamily()
  assert family.checker == "tree_rl"
  out = family.score(task, episode, False)
  assert out.correct and out.details["checker"] == "tree_rl"
  with pytest.raises(ModuleNotFoundError, match="pip install --no-deps bfcl-eval"):
    BFCLFamily(checker="bfcl_eval")


def test_oracle_is_correct_with_full_reward():
  family = BFCLFamily()
  tasks = family.generate("eval", 200, seed=0) + family.generate("train", 200, seed=0)
  for task in tasks:
    out = family.score(task, list(task.messages) + list(task.oracle), truncated=True)
    assert out.correct and out.reward == 2.0, (task.task_id, out)
    tools = {t.name: t for t in family.tools(task)}
    for message in task.oracle[1:]:
      assert message["role"] == "tool" and message["name"] in tools
