"""BFCL-style single-step function calling, scored as AWPO scores it and as BFCL scores it.

AWPO (arXiv 2512.19126) §3.2, Eqs. 14-19 trains on single-step function calling; BFCL is
where it is evaluated (§4.1). One task is one user request and a handful of function docs;
the policy answers in a single step with one <tool_call> block per call, or with a plain
<answer> when no function fits (irrelevance). Two verdicts come out of `score`:

  - reward (AWPO Eqs. 14-19): S_format + S_exec in [0, 2]. S_format is 1 when the step
    has a think block and either well-formed calls or, without calls, a non-empty answer.
    S_exec compares the well-formed calls with one reference call list: the first
    acceptable value of every argument of BFCL's possible answer, leaving out optional
    arguments that may be omitted ("" among their acceptable values). An irrelevance task
    has no reference call; AWPO leaves that case open and we use the "match" convention by
    default: S_exec = 1 when the step makes no call either, so the right behaviour earns 2.
  - correct: BFCL's AST verdict (`ast_match`), from BFCL's own checker in the bfcl-eval
    package when it is installed, else from our branch-for-branch restatement of it; the
    family's `checker` attribute and every outcome's details["checker"] say which one
    scored ("bfcl_eval" or "tree_rl"). docs/bfcl.md describes both and where BFCL's checker
    is inconsistent.

Calls are never executed for scoring (AWPO trains single steps against ground-truth calls),
so each function's Tool returns a deterministic echo of its call; it exists so that
rollouts that execute calls anyway, and the oracle's tool messages, have something to show.
The `truncated` flag is ignored: with one turn allowed, every step with calls ends at the
turn limit, and a step cut off by the token limit already fails the format check.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import random
import re
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

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
# BFCL scores a single-turn answer in two stages (bfcl_eval/eval_checker/eval_runner.py): the
# model handler decodes the text into calls [{name: {param: value}}], then
#   - irrelevance: correct when the decoded list is empty or decoding failed;
#   - the other categories: a decoding failure is wrong, else `ast_checker(functions, decoded,
#     possible_answer, Language.PYTHON, test_category, model_name)` decides.
# `ast_checker` dispatches on the test category's name: "parallel" in it -> every answer call,
# in order, takes the first still-unused output call that passes it (first fit, so the verdict
# can depend on the order of the calls); "multiple" -> exactly one call, checked against the
# doc named by the answer; otherwise (simple) -> exactly one call, checked against the first doc.
# `_ast_checker` below is our restatement of that checker, branch for branch, including its
# quirks (docs/bfcl.md lists them); `_official` calls the checker shipped in bfcl-eval, and
# `ast_match` runs either one on tree_rl's parsed calls.

CHECKERS = ("auto", "bfcl_eval", "tree_rl")
# BFCL's test-category name of each family category (the name the checker dispatches on).
BFCL_TEST_CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
                        "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance"}
# The BFCL model entry whose decoding we mirror: Qwen3 in function-calling mode reads each
# <tool_call> block as JSON {"name", "arguments"} and keeps dotted names (underscore_to_dot is
# False), the only model setting the checker reads. BFCL passes it with "/" written as "_".
BFCL_MODEL = "Qwen/Qwen3-8B-FC"
_CHECKER_MODULE = "bfcl_eval.eval_checker.ast_eval.ast_checker"
_MODEL_CONFIG_MODULE = "bfcl_eval.constants.model_config"
_CHECKER_ARGS = ("func_description", "model_output", "possible_answer", "language",
                 "test_category", "model_name")
# Exceptions BFCL's checker raises on inputs it does not handle (docs/bfcl.md, "crashes").
_CHECKER_CRASHES = (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError)

# BFCL's Python type of each schema type name ("any" is checked as a string).
PYTHON_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                "tuple": list, "dict": dict, "any": str}
_NESTED_TYPES = ("array", "tuple")  # the types whose items are type-checked, one level deep
# Strings are compared after dropping ASCII spaces and , . / - _ * ^, lowercasing and reading
# ' as ": "New York" == "new-york", but "Toronto\n" != "Toronto" (only " " is dropped).
_IGNORED = re.compile(r"[ ,./\-_*^]")


class Verdict(NamedTuple):
  """One AST verdict.

  Attributes:
    valid: the answer counts as correct.
    error_type: BFCL's error type ("simple_function_checker:missing_required", ...), "" when
      valid; "ast_checker:raised" when BFCL's checker raises on the input.
    error: a readable reason, "" when valid.
  """

  valid: bool
  error_type: str = ""
  error: str = ""


_VALID = Verdict(True)


@functools.lru_cache(maxsize=1 << 16)  # the same acceptable values come back for every sample
def normalize_string(text: str) -> str:
  """BFCL's `standardize_string`: the form in which strings are compared."""
  return _IGNORED.sub("", text).lower().replace("'", '"')


def _type_check(value: Any, acceptable: Any, expected: type,
                nested: type | None) -> tuple[bool, bool, str]:
  """BFCL's `type_checker`: (ok, is_variable, error_type).

  A value of another type than the schema's still passes when it has the type of the
  possible answer (BFCL's "variable" case: the answer holds a string naming a variable); the
  possible answer's type is that of its first acceptable value other than "". A list's items
  are checked, by the same rule one level down, against each acceptable list in turn; an
  acceptable value that is not a list (the "" of an optional parameter) passes the items
  unchecked.
  """
  answer_type = next((type(a) for a in acceptable if a != ""), None)
  is_variable = answer_type is not None and answer_type != expected
  if type(value) == expected:  # exact types: a bool is not an int here
    if nested is None:
      return True, is_variable, ""
    for option in acceptable:  # items: the item type, or the type of the option's items
      if type(option) != list:
        return True, is_variable, ""
      item_type = next((type(a) for a in option if a != ""), None)
      if all(type(v) == nested or type(v) == item_type for v in value):
        return True, is_variable, ""
    # BFCL names the failure "nested" only when the list also has the answer's type.
    return False, False, "type_error:nested" if type(value) == answer_type else "type_error:simple"
  if answer_type is not None and type(value) == answer_type:
    return True, True, ""
  return False, False, "type_error:simple"


def _list_ok(value: list, acceptable: Sequence[Any]) -> bool:
  """BFCL's `list_checker`: the list, strings normalised, equals one acceptable list."""
  options = [[normalize_string(x) if type(x) is str else x
              for x in (option[j] for j in range(len(option)))] for option in acceptable]
  return [normalize_string(v) if type(v) is str else v for v in value] in options


def _dict_check(value: Any, acceptable: Sequence[Any]) -> Verdict:
  """BFCL's `dict_checker`: the dict against each acceptable template {key: [values]}.

  Keys must be known to the template, values (strings normalised, one level only) among the
  key's acceptable values, and a key may be left out only where "" is acceptable. `value` is
  a dict except in the item of a list that skipped its type check (see `_type_check`), where
  BFCL raises AttributeError, and so does this.
  """
  result = Verdict(False, "dict_checker:unclear", "no acceptable dict")
  for template in acceptable:
    if template == "":
      continue
    result, ok = Verdict(False, "dict_checker:unclear"), True
    for key, item in value.items():
      if key not in template:
        result, ok = Verdict(False, "value_error:dict_key", f"unexpected dict key {key!r}"), False
        break
      options = [normalize_string(x) if type(x) is str else x
                 for x in (template[key][i] for i in range(len(template[key])))]
      if (normalize_string(item) if type(item) is str else item) not in options:
        result, ok = Verdict(False, "value_error:dict_value",
                             f"invalid value for key {key!r}: {item!r}"), False
        break
    for key, options in template.items():  # BFCL runs this even after a failure above
      if key not in value and "" not in options:
        result, ok = Verdict(False, "value_error:dict_key", f"missing dict key {key!r}"), False
        break
    if ok:
      return _VALID
  return result


def _list_dict_check(value: list, acceptable: Sequence[Any]) -> Verdict:
  """BFCL's `list_dict_checker`: a list of dicts, position by position, against each
  acceptable list of templates (an acceptable "" has length 0, so it accepts [])."""
  result = Verdict(False, "list_dict_checker:unclear", "no acceptable list")
  for option in acceptable:
    if len(value) != len(option):
      result = Verdict(False, "value_error:list_dict_count", "wrong number of dicts in the list")
      continue
    ok = True
    for i in range(len(value)):
      result = _dict_check(value[i], [option[i]])
      if not result.valid:
        ok = False
        break
    if ok:
      return _VALID
  return result


def _call_check(doc: Mapping[str, Any], output: Mapping[str, Mapping[str, Any]],
                answer: Mapping[str, Mapping[str, Sequence[Any]]]) -> Verdict:
  """BFCL's `simple_function_checker` (Python): one decoded call against one answer call.

  Args:
    doc: the function doc to check against (its name must be the call's).
    output: one decoded call {name: {param: value}}.
    answer: one possible-answer call {name: {param: [acceptable values]}}.
  """
  expected_args = list(answer.values())[0]
  name, params = doc["name"], doc["parameters"]
  properties, required = params["properties"], params["required"]
  if name not in output:
    return Verdict(False, "simple_function_checker:wrong_func_name",
                   f"function {name!r} not found in the output")
  arguments = output[name]
  for param in required:
    if param not in arguments:
      return Verdict(False, "simple_function_checker:missing_required",
                     f"missing required parameter {param!r}")
  for param, value in arguments.items():
    if param not in properties or param not in expected_args:
      return Verdict(False, "simple_function_checker:unexpected_param",
                     f"unexpected parameter {param!r}")
    schema, acceptable = properties[param], expected_args[param]
    type_name = schema["type"]
    expected = PYTHON_TYPES[type_name]
    nested = PYTHON_TYPES[schema["items"]["type"]] if type_name in _NESTED_TYPES else None
    if type_name == "float" and type(value) is int:  # Python's int -> float promotion
      value = float(value)
    ok, is_variable, error_type = _type_check(value, acceptable, expected, nested)
    if not ok:
      return Verdict(False, error_type,
                     f"wrong type for {param!r}: expected {type_name}, got {value!r}")
    if not is_variable:
      if expected is dict:
        result = _dict_check(value, acceptable)
      elif expected is list and nested is dict:
        result = _list_dict_check(value, acceptable)
      elif expected is str:
        options = [normalize_string(a) for a in acceptable if type(a) is str]
        result = (_VALID if normalize_string(value) in options else
                  Verdict(False, "value_error:string", f"invalid value for {param!r}: {value!r}"))
      elif expected is list:
        result = (_VALID if _list_ok(value, acceptable) else
                  Verdict(False, "value_error:list/tuple",
                          f"invalid value for {param!r}: {value!r}"))
      else:
        result = None
      if result is not None:
        if not result.valid:
          return result
        continue
    if value not in acceptable:  # Python equality: 5.0 == 5 and True == 1
      return Verdict(False, "value_error:others", f"invalid value for {param!r}: {value!r}")
  for param, acceptable in expected_args.items():
    if param not in arguments and "" not in acceptable:
      return Verdict(False, "simple_function_checker:missing_optional",
                     f"parameter {param!r} not provided and not optional")
  return _VALID


def _find_doc(functions: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any]:
  for doc in functions:
    if doc["name"] == name:
      return doc
  # BFCL's checker goes on with None and raises TypeError: the answer names a function that
  # is not offered, a data error no output can fix.
  raise TypeError(f"the possible answer calls {name!r}, which is not among the functions")


def _ast_checker(functions: Sequence[Mapping[str, Any]],
                 decoded: Sequence[Mapping[str, Mapping[str, Any]]],
                 ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]],
                 test_category: str) -> Verdict:
  """BFCL's `ast_checker` for Python categories, dispatching on the test category's name."""
  if "parallel" in test_category:
    if len(decoded) != len(ground_truth):
      return Verdict(False, "parallel_function_checker_no_order:wrong_count",
                     f"expected {len(ground_truth)} call(s), got {len(decoded)}")
    used: list[int] = []
    for i, answer in enumerate(ground_truth):
      doc = _find_doc(functions, list(answer)[0])
      reasons = []
      for j, output in enumerate(decoded):
        if j in used:
          continue
        result = _call_check(doc, output, answer)
        if result.valid:
          used.append(j)
          break
        reasons.append(f"call {j}: {result.error}")
      else:  # first fit: an earlier answer may have taken the only call that fits this one
        return Verdict(False, "parallel_function_checker_no_order:cannot_find_match",
                       f"no unused call matches answer call {i} ({'; '.join(reasons)})")
    return _VALID
  if "multiple" in test_category:
    if len(decoded) != len(ground_truth):
      return Verdict(False, "multiple_function_checker:wrong_count",
                     f"expected {len(ground_truth)} call(s), got {len(decoded)}")
    return _call_check(_find_doc(functions, list(ground_truth[0])[0]), decoded[0],
                       ground_truth[0])
  if len(decoded) != 1:
    return Verdict(False, "simple_function_checker:wrong_count",
                   f"expected 1 call, got {len(decoded)}")
  return _call_check(functions[0], decoded[0], ground_truth[0])


# ----------------------------------------------------------------------------- the two checkers


@functools.lru_cache(maxsize=1)
def official_checker() -> types.ModuleType | None:
  """BFCL's `ast_checker` module from the installed bfcl-eval, or None when it is absent.

  The module itself needs only the standard library, but one of its imports,
  `bfcl_eval.constants.model_config`, builds BFCL's registry of every model handler and so
  imports every vendor SDK (anthropic, openai, boto3, ...), which `pip install --no-deps`
  leaves out. The checker reads one thing from that registry, `underscore_to_dot` of the
  model it scores, so the module is executed with a stand-in registry holding the entry of
  BFCL_MODEL (its value in BFCL's registry is False as well); the stand-in is only visible
  while the module runs its imports, and the module is not registered in `sys.modules`. A
  registry that is already imported (bfcl-eval installed with its dependencies and in use)
  is used as it is.

  Raises:
    ImportError: bfcl-eval is installed but has no `ast_checker` with BFCL's signature.
  """
  if importlib.util.find_spec("bfcl_eval") is None:
    return None
  spec = importlib.util.find_spec(_CHECKER_MODULE)
  if spec is None or spec.loader is None:
    raise ImportError(f"bfcl-eval is installed but has no {_CHECKER_MODULE}; "
                      "use checker='tree_rl'")
  module = importlib.util.module_from_spec(spec)
  registry = types.ModuleType(_MODEL_CONFIG_MODULE)
  registry.MODEL_CONFIG_MAPPING = {BFCL_MODEL: types.SimpleNamespace(underscore_to_dot=False)}
  standin = _MODEL_CONFIG_MODULE not in sys.modules
  if standin:
    sys.modules[_MODEL_CONFIG_MODULE] = registry
  try:
    spec.loader.exec_module(module)
  except ImportError as e:
    raise ImportError(f"bfcl-eval's checker does not import ({e}); use checker='tree_rl'") from e
  finally:
    if standin and sys.modules.get(_MODEL_CONFIG_MODULE) is registry:
      del sys.modules[_MODEL_CONFIG_MODULE]
  checker = getattr(module, "ast_checker", None)
  args = tuple(inspect.signature(checker).parameters) if callable(checker) else ()
  if args != _CHECKER_ARGS:
    raise ImportError(f"bfcl-eval's ast_checker takes {args}, expected {_CHECKER_ARGS}; "
                      "use checker='tree_rl'")
  return module


def resolve_checker(checker: str) -> str:
  """The checker that scores accuracy: "bfcl_eval" (the official one) or "tree_rl".

  "auto" picks bfcl_eval when the package is installed, else tree_rl.
  """
  if checker not in CHECKERS:
    raise ValueError(f"checker must be one of {CHECKERS}, got {checker!r}")
  if checker == "tree_rl":
    return checker
  if official_checker() is not None:
    return "bfcl_eval"
  if checker == "bfcl_eval":
    raise ModuleNotFoundError("checker='bfcl_eval' needs the bfcl-eval package; install it "
                              "with `pip install --no-deps bfcl-eval`")
  return "tree_rl"


def _official(functions: Sequence[Mapping[str, Any]],
              decoded: Sequence[Mapping[str, Mapping[str, Any]]],
              ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]],
              test_category: str) -> Verdict:
  """BFCL's own `ast_checker` on decoded calls, its result dict read into a Verdict."""
  module = official_checker()
  if module is None:
    raise ModuleNotFoundError("the official BFCL checker needs the bfcl-eval package")
  # A list of docs (BFCL's find_description reads a non-list as the one doc), Python typing,
  # and the model name as BFCL's runner spells it.
  result = module.ast_checker(list(functions), list(decoded), list(ground_truth),
                              module.Language.PYTHON, test_category,
                              BFCL_MODEL.replace("/", "_"))
  if result["valid"]:
    return _VALID
  errors = result.get("error", [])
  errors = errors if isinstance(errors, list) else [errors]
  return Verdict(False, result.get("error_type", ""),
                 "; ".join(e if isinstance(e, str) else repr(e) for e in errors))


_RULES = {"tree_rl": _ast_checker, "bfcl_eval": _official}


def ast_match(functions: Sequence[Mapping[str, Any]],
              ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]],
              calls: Sequence[Mapping[str, Any]], category: str,
              checker: str = "tree_rl") -> Verdict:
  """BFCL's AST verdict on one step's decoded calls.

  Args:
    functions: the function docs offered (BFCL schema dialect).
    ground_truth: the possible answer, one {name: {param: [acceptable]}} per call; empty
      exactly for irrelevance.
    calls: the step's calls [{"name": str, "arguments": {...}}], in the order written.
    category: the family category (a key of BFCL_TEST_CATEGORIES).
    checker: "tree_rl" (our restatement) or "bfcl_eval" (the checker in bfcl-eval).

  Returns:
    The Verdict. Irrelevance is valid exactly when there is no call (BFCL's relevance rule).
    An input on which BFCL's checker raises is not valid, with error_type
    "ast_checker:raised" (docs/bfcl.md lists the inputs that do this).
  """
  if category not in BFCL_TEST_CATEGORIES:
    raise ValueError(f"unknown BFCL category {category!r}; choose from {CATEGORIES}")
  if checker not in _RULES:
    raise ValueError(f"checker must be 'tree_rl' or 'bfcl_eval', got {checker!r}")
  if (category == "irrelevance") != (not ground_truth):
    raise ValueError(f"a {category!r} task must have {'no' if category == 'irrelevance' else 'a'}"
                     f" possible answer, got {len(ground_truth)} answer call(s)")
  if category == "irrelevance":
    return _VALID if not calls else Verdict(
        False, "irrelevance_error:decoder_success", f"{len(calls)} call(s) made, none expected")
  # The decoded form BFCL's handlers produce: one {name: {param: value}} per call, in order.
  decoded = [{c["name"]: dict(c.get("arguments") or {})} for c in calls]
  try:
    return _RULES[checker](functions, decoded, ground_truth, BFCL_TEST_CATEGORIES[category])
  except _CHECKER_CRASHES as e:
    return Verdict(False, "ast_checker:raised", f"BFCL's checker raises {type(e).__name__}: {e}")


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
               no_call: str = "match", checker: str = "auto"):
    """Args:
      categories: any of "simple", "multiple", "parallel", "parallel_multiple",
        "irrelevance" (BFCL's simple category is its Python file).
      reward: "awpo" (S_format + S_exec in [0, 2]) or "ast" (1 if `ast_match`, else 0).
      no_call: S_exec of a task without a reference call (execution_match's `no_call`).
      checker: who decides `correct`: "bfcl_eval" (BFCL's checker; needs the package),
        "tree_rl" (our restatement) or "auto" (bfcl_eval when installed). The resolved
        choice is the `checker` attribute.
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
    self.checker = resolve_checker(checker)

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
    category = task.metadata["category"]
    step = next((m for m in episode[len(task.messages):] if m.get("role") == "assistant"), None)
    if step is None:
      return Outcome(reward=0.0, correct=False, answered=False,
                     details={"s_exec": 0.0, "format_ok": False, "pred_calls": [],
                              "ast_reason": "no assistant step", "ast_error_type": "no_step",
                              "checker": self.checker, "category": category})
    parsed = parse_step(step.get("content") or "")
    pred = [{"name": c.name, "arguments": dict(c.arguments)} for c in parsed.calls
            if c.error is None and c.name is not None and c.arguments is not None]
    has_blocks = parsed.num_tool_call_blocks > 0
    format_ok = parsed.think is not None and (parsed.fields_ok if has_blocks
                                              else bool(parsed.answer))
    gt = task.metadata["reference_calls"]
    s_exec = execution_match(gt, pred, no_call=self.no_call) if format_ok else 0.0
    if has_blocks and not parsed.fields_ok:
      # A malformed block fails decoding, as an exception in a BFCL handler's decode does:
      # wrong where calls are expected, "no call" (right) for irrelevance.
      verdict = Verdict(category == "irrelevance", "ast_decoder:decoder_failed",
                        "a <tool_call> block is malformed")
    else:
      verdict = ast_match(task.metadata["functions"], task.answer, pred, category, self.checker)
    if self.reward == "awpo":
      reward = awpo_outcome_reward(format_ok, gt, pred, no_call=self.no_call)
    else:
      reward = 1.0 if verdict.valid else 0.0
    return Outcome(reward=reward, correct=verdict.valid,
                   answered=has_blocks or bool(parsed.answer),
                   details={"s_exec": s_exec, "format_ok": format_ok, "pred_calls": pred,
                            "ast_reason": verdict.error, "ast_error_type": verdict.error_type,
                            "checker": self.checker, "category": category})
