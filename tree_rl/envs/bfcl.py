"""BFCL-style single-step function calling, scored as AWPO scores it (specs/awpo.md §2.1, §5.4).

One task is one user request and a handful of function docs; the policy answers in a
single step with one <tool_call> block per call, or with a plain <answer> when no function
fits (irrelevance). Two verdicts come out of `score`:

  - reward (AWPO eqs. 14-19): S_format + S_exec in [0, 2]. S_format is 1 when the step
    has a think block and either well-formed calls or, without calls, a non-empty answer.
    S_exec compares the well-formed calls with one reference call list: the first
    acceptable value of every argument of BFCL's possible answer, leaving out optional
    arguments that may be omitted ("" among their acceptable values). An irrelevance task
    has no reference call; AWPO leaves that case open (spec §7 E8) and we use the "match"
    convention by default: S_exec = 1 when the step makes no call either, so the right
    behaviour earns the full 2.
  - correct: our own implementation of BFCL's AST rule (`ast_match`), which accepts every
    acceptable value, not just the first one.

Calls are never executed for scoring (AWPO trains single steps against ground-truth calls,
§2.1), so each function's Tool returns a deterministic echo of its call; it exists so that
rollouts that execute calls anyway, and the oracle's tool messages, have something to show.
The `truncated` flag is ignored: with one turn allowed, every step with calls ends at the
turn limit, and a step cut off by the token limit already fails the format check.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tree_rl.envs.base import (Message, Outcome, Task, Tool, render_tool_output,
                               render_tool_prompt)
from tree_rl.envs.bfcl_data import CATEGORIES, BfclItem, load_eval_items, synthetic_items
from tree_rl.envs.parsing import format_tool_call, parse_step
from tree_rl.rewards.execution_match import (NO_CALL_CONVENTIONS, awpo_outcome_reward,
                                             execution_match)

REWARDS = ("awpo", "ast")
PREAMBLE = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, make the function calls that achieve its purpose. If "
    "none of the functions can be used, point it out and do not call any function.")
FINISH = (
    "Make every call the request needs in this single step, one <tool_call> block per call. "
    "If no function fits the request, make no call and explain why inside <answer></answer>.")
_MISSING = object()


# ----------------------------------------------------------------------------- tools


def _free_form_objects(schema: Any) -> Any:
  """A copy of a BFCL schema where objects without "properties" accept any key.

  BFCL uses {"type": "dict"} with no properties for free-form maps (subject -> score);
  a JSON-schema validator would otherwise reject every key of such a map.
  """
  if isinstance(schema, Mapping):
    out = {k: _free_form_objects(v) for k, v in schema.items()}
    if out.get("type") in ("dict", "object") and "properties" not in out:
      out.setdefault("additionalProperties", True)
    return out
  if isinstance(schema, list):
    return [_free_form_objects(v) for v in schema]
  return schema


def function_tool(doc: Mapping[str, Any]) -> Tool:
  """The Tool of one BFCL function doc; its fn echoes the call instead of running anything.

  The name is kept as written (dots included) and BFCL's type names stay as they are
  (the executor reads "dict"/"float"/"tuple" as object/number/array and "any" as any).
  """
  name = doc["name"]

  def simulated(**arguments: Any) -> dict[str, Any]:
    return {"status": "ok", "function": name, "arguments": arguments}

  return Tool(name=name, description=doc.get("description", ""),
              parameters=_free_form_objects(doc["parameters"]), fn=simulated)


# ----------------------------------------------------------------------------- AST checker

# BFCL compares strings after dropping spaces and the characters , . / - _ * ^, lowercasing
# and reading ' as " (so "New York" == "new-york" and "2024-01-05" == "20240105").
_IGNORED = re.compile(r"[\s,./\-_*^]")


def normalize_string(text: str) -> str:
  """BFCL's string normalisation for the AST comparison."""
  return _IGNORED.sub("", text).lower().replace("'", '"')


def _type_ok(type_name: Any, value: Any) -> bool:
  """BFCL's Python type check; an int passes for a float parameter, a bool never for a number."""
  if type_name == "integer":
    return type(value) is int
  if type_name in ("float", "number"):
    return type(value) in (int, float)
  if type_name == "string":
    return isinstance(value, str)
  if type_name == "boolean":
    return isinstance(value, bool)
  if type_name in ("array", "tuple", "list"):
    return isinstance(value, list)
  if type_name in ("dict", "object"):
    return isinstance(value, Mapping)
  return True  # "any", or no type given


def _equal(pred: Any, acc: Any) -> bool:
  """Whether a predicted value equals one acceptable value (dicts are answer templates)."""
  if isinstance(acc, Mapping):
    return isinstance(pred, Mapping) and _template_match(pred, acc)
  if isinstance(acc, list):
    return (isinstance(pred, list) and len(pred) == len(acc)
            and all(_equal(p, a) for p, a in zip(pred, acc)))
  if isinstance(acc, str):
    return isinstance(pred, str) and normalize_string(pred) == normalize_string(acc)
  if isinstance(acc, bool) or isinstance(pred, bool):
    return type(pred) is type(acc) and pred == acc
  if isinstance(acc, (int, float)):
    return type(pred) in (int, float) and pred == acc
  return pred == acc


def _template_match(pred: Mapping[str, Any], template: Mapping[str, Any]) -> bool:
  """A dict value against a possible-answer dict {key: [acceptable, ...]}."""
  for key, value in pred.items():
    accs = template.get(key, _MISSING)
    if accs is _MISSING:
      return False
    if not any(_equal(value, a) for a in (accs if isinstance(accs, list) else [accs])):
      return False
  return all(key in pred or (isinstance(accs, list) and "" in accs)
             for key, accs in template.items())


def _same_kind(pred: Any, acc: Any) -> bool:
  """Whether two values have the same Python types, element by element (5 vs 5.0 differ)."""
  if isinstance(acc, list):
    return (isinstance(pred, list) and len(pred) == len(acc)
            and all(_same_kind(p, a) for p, a in zip(pred, acc)))
  if isinstance(acc, Mapping):
    return isinstance(pred, Mapping)
  return type(pred) is type(acc)


def _value_ok(schema: Mapping[str, Any], value: Any, acceptable: Sequence[Any]) -> bool:
  """One argument value against its schema and its acceptable values."""
  items = schema.get("items") if isinstance(schema.get("items"), Mapping) else {}
  typed = _type_ok(schema.get("type"), value) and not (
      isinstance(value, list) and any(not _type_ok(items.get("type"), v) for v in value))
  if not typed:
    # A type error is forgiven when the possible answer itself holds a value of the same
    # kind: BFCL accepts a string naming a variable ("data['sales']") for an array, and
    # some answers disagree with their own schema (strings for integer items).
    return any(a != "" and _same_kind(value, a) and _equal(value, a) for a in acceptable)
  return any(_equal(value, a) for a in acceptable)


def _call_error(doc: Mapping[str, Any], answer: Mapping[str, Sequence[Any]],
                arguments: Mapping[str, Any]) -> str | None:
  """Why one call's arguments fail one possible-answer call, or None when they match."""
  params = doc.get("parameters", {})
  props = params.get("properties", {})
  for key in params.get("required", ()):
    if key not in arguments:
      return f"missing required parameter '{key}'"
  for key, value in arguments.items():
    if key not in props:
      return f"unexpected parameter '{key}'"
    if key not in answer:
      return f"parameter '{key}' should not be set"
    if not _value_ok(props[key], value, answer[key]):
      return f"wrong value for '{key}': {value!r}"
  for key, accs in answer.items():
    if key not in arguments and "" not in accs:
      return f"missing parameter '{key}'"
  return None


def ast_match(functions: Sequence[Mapping[str, Any]],
              ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]],
              calls: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
  """BFCL's AST verdict on a step's calls (our implementation of its rule).

  The calls must pair one-to-one with the possible-answer calls, in any order: same
  function names as a multiset, every required parameter present, no unknown parameter,
  optional ones omitted only where "" is acceptable, and every value among the acceptable
  ones (strings normalised, an int accepted for a float). With no possible-answer call
  (irrelevance) the verdict is True exactly when there is no call.

  Returns:
    (match, reason): the reason names the first problem found, "" on a match.
  """
  if not ground_truth:
    return (not calls), ("" if not calls else "a call was made but none was expected")
  if len(calls) != len(ground_truth):
    return False, f"expected {len(ground_truth)} call(s), got {len(calls)}"
  docs = {f["name"]: f for f in functions}
  fits: list[list[int]] = []  # fits[i]: the calls that satisfy answer call i
  reasons = []
  for answer in ground_truth:
    (name, args), = answer.items()
    ok, why = [], f"no call to '{name}'"
    for j, call in enumerate(calls):
      if call.get("name") != name or name not in docs:
        continue
      error = _call_error(docs[name], args, call.get("arguments") or {})
      if error is None:
        ok.append(j)
      else:
        why = f"'{name}': {error}"
    fits.append(ok)
    reasons.append(why)
  owner = [-1] * len(calls)  # Kuhn's augmenting paths: a greedy pairing can miss a match

  def assign(i: int, seen: set[int]) -> bool:
    for j in fits[i]:
      if j not in seen:
        seen.add(j)
        if owner[j] < 0 or assign(owner[j], seen):
          owner[j] = i
          return True
    return False

  for i in range(len(ground_truth)):
    if not assign(i, set()):
      return False, reasons[i] if not fits[i] else f"calls cannot be paired ({reasons[i]})"
  return True, ""


# ----------------------------------------------------------------------------- reference calls


def _first_value(accs: Sequence[Any]) -> Any:
  """The first acceptable value that is not "", with answer templates inside reduced."""
  for a in accs:
    if not (isinstance(a, str) and a == ""):
      return _reduce(a)
  return _MISSING


def _reduce(value: Any) -> Any:
  if isinstance(value, Mapping):  # a template {key: [acceptable]}: optional keys dropped
    out = {}
    for key, accs in value.items():
      accs = accs if isinstance(accs, list) else [accs]
      first = _first_value(accs)
      if "" not in accs and first is not _MISSING:
        out[key] = first
    return out
  if isinstance(value, list):
    return [_reduce(v) for v in value]
  return value


def reference_calls(item: BfclItem) -> list[dict[str, Any]]:
  """The calls S_exec compares against, and the oracle makes: first acceptable values.

  Optional arguments whose acceptable values include "" are left out; a required one takes
  its first non-empty value (BFCL's answers sometimes list "" for a required parameter).
  Arguments the function doc does not declare are left out too.
  """
  docs = {f["name"]: f for f in item.functions}
  calls = []
  for answer in item.ground_truth:
    (name, args), = answer.items()
    params = docs[name]["parameters"]
    required, props = set(params.get("required", ())), params.get("properties", {})
    arguments = {}
    for key, accs in args.items():
      if key not in props or (key not in required and "" in accs):
        continue
      value = _first_value(accs)
      if value is not _MISSING:
        arguments[key] = value
    calls.append({"name": name, "arguments": arguments})
  return calls


# ----------------------------------------------------------------------------- family


def _oracle(tools: Sequence[Tool], calls: Sequence[Mapping[str, Any]]) -> tuple[Message, ...]:
  if not calls:
    return ({"role": "assistant",
             "content": ("<think>None of the offered functions can do what the user asks, so I "
                         "should not call any.</think>\n<answer>None of the available functions "
                         "can be used for this request.</answer>")},)
  by_name = {t.name: t for t in tools}
  names = ", ".join(dict.fromkeys(c["name"] for c in calls))
  plural = "s" if len(calls) > 1 else ""
  think = f"<think>The request needs {len(calls)} call{plural} to {names}.</think>\n"
  blocks = "\n".join(format_tool_call(c["name"], c["arguments"]) for c in calls)
  messages: list[Message] = [{"role": "assistant", "content": think + blocks}]
  for c in calls:
    value = by_name[c["name"]].fn(**copy.deepcopy(c["arguments"]))
    messages.append({"role": "tool", "name": c["name"], "content": render_tool_output(value)})
  return tuple(messages)


class BFCLFamily:
  """BFCL single-turn categories: eval from the bfcl-eval package, train synthetic."""

  name = "bfcl"
  max_turns = 1

  def __init__(self, categories: Sequence[str] = CATEGORIES, reward: str = "awpo",
               no_call: str = "match"):
    """Args:
      categories: any of "simple", "multiple", "parallel", "parallel_multiple",
        "irrelevance" (BFCL's simple category is its Python file).
      reward: "awpo" (S_format + S_exec in [0, 2]) or "ast" (1 if `ast_match`, else 0).
      no_call: S_exec of a task without a reference call (execution_match's `no_call`).
    """
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
      raise ValueError(f"categories must be a non-empty subset of {CATEGORIES}, got {categories}")
    if reward not in REWARDS:
      raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    if no_call not in NO_CALL_CONVENTIONS:
      raise ValueError(f"no_call must be one of {NO_CALL_CONVENTIONS}, got {no_call!r}")
    self.categories = tuple(categories)
    self.reward = reward
    self.no_call = no_call

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    """Eval: a seeded sample of the BFCL items of the chosen categories; train: synthetic."""
    if split == "eval":
      items = [it for c in self.categories for it in load_eval_items(c)]
      if num_tasks > len(items):
        raise ValueError(f"only {len(items)} BFCL eval items in {self.categories}, "
                         f"asked for {num_tasks}")
      order = list(range(len(items)))
      random.Random(f"bfcl-eval:{seed}").shuffle(order)
      chosen = [items[i] for i in order[:num_tasks]]
      return [self.task_from_item(it, "eval", f"bfcl/eval/{it.item_id}") for it in chosen]
    if split == "train":
      return [self.task_from_item(it, "train", f"bfcl/train/{seed}/{it.item_id}")
              for it in synthetic_items(self.categories, num_tasks, seed)]
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

  def task_from_item(self, item: BfclItem, split: str, task_id: str) -> Task:
    """The Task of any BFCL-format item: system prompt with its functions, the user turn,
    the possible answer as `answer` and the reference calls and oracle derived from it."""
    tools = [function_tool(f) for f in item.functions]
    calls = reference_calls(item)
    system = render_tool_prompt(tools, PREAMBLE, FINISH)
    return Task(task_id=task_id, family=self.name, split=split,
                messages=({"role": "system", "content": system},)
                + tuple(dict(m) for m in item.messages),
                tool_names=tuple(t.name for t in tools),
                answer=copy.deepcopy(list(item.ground_truth)),
                oracle=_oracle(tools, calls), difficulty=1 if calls else 0,
                metadata={"category": item.category, "bfcl_id": item.item_id,
                          "functions": copy.deepcopy(list(item.functions)),
                          "reference_calls": calls})

  def tools(self, task: Task) -> list[Tool]:
    """One echoing Tool per function doc of the task."""
    return [function_tool(f) for f in task.metadata["functions"]]

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    """AWPO reward and BFCL AST correctness of the episode's single assistant step."""
    del truncated  # see the module docstring
    step = next((m for m in episode[len(task.messages):] if m.get("role") == "assistant"), None)
    if step is None:
      return Outcome(reward=0.0, correct=False, answered=False,
                     details={"s_exec": 0.0, "format_ok": False, "pred_calls": [],
                              "ast_reason": "no assistant step",
                              "category": task.metadata["category"]})
    parsed = parse_step(step.get("content") or "")
    pred = [{"name": c.name, "arguments": dict(c.arguments)} for c in parsed.calls
            if c.error is None and c.name is not None and c.arguments is not None]
    has_blocks = parsed.num_tool_call_blocks > 0
    format_ok = parsed.think is not None and (parsed.fields_ok if has_blocks
                                              else bool(parsed.answer))
    gt = task.metadata["reference_calls"]
    s_exec = execution_match(gt, pred, no_call=self.no_call) if format_ok else 0.0
    match, reason = ast_match(task.metadata["functions"], task.answer, pred)
    # A malformed block fails BFCL's decoding: wrong for a task that needs calls, but still
    # "no call" for an irrelevance task, as in BFCL.
    correct = match and (not task.answer or parsed.fields_ok)
    if self.reward == "awpo":
      reward = awpo_outcome_reward(format_ok, gt, pred, no_call=self.no_call)
    else:
      reward = 1.0 if correct else 0.0
    return Outcome(reward=reward, correct=correct, answered=has_blocks or bool(parsed.answer),
                   details={"s_exec": s_exec, "format_ok": format_ok, "pred_calls": pred,
                            "ast_reason": reason, "category": task.metadata["category"]})
