"""Systematic perturbations of BFCL answers, for comparing AST checkers on the shipped data.

`answer_variants(item)` yields `Variant`s: the reference answer (first acceptable values),
other acceptable answers, and every perturbation of them that BFCL's AST rule is
sensitive to: whitespace in strings, numeric and boolean types, string numbers, call order,
missing required or optional arguments, extra arguments, wrong function names and extra or
missing calls. Everything is deterministic (no randomness), so a disagreement names its label.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from tree_rl.envs.bfcl import reference_calls
from tree_rl.envs.bfcl_data import BfclItem

Call = dict[str, Any]
MAX_ORDERS = 24  # call orders tried per answer (every order up to 4 calls)


def _string_variants(s: str) -> list[tuple[str, Any]]:
  out = [("trailing_newline", s + "\n"), ("leading_tab", "\t" + s),
         ("padded_spaces", f" {s} "), ("trailing_nbsp", s + "\u00a0"),
         ("upper", s.upper()), ("changed", s + "zz"), ("empty_string", ""),
         ("string_to_list", [s])]
  if " " in s:
    out += [("nbsp_inside", s.replace(" ", "\u00a0")), ("newline_inside", s.replace(" ", "\n")),
            ("tab_inside", s.replace(" ", "\t")), ("no_spaces", s.replace(" ", ""))]
  try:
    number = float(s)
  except ValueError:
    pass
  else:
    out.append(("string_to_float", number))
    if number.is_integer():
      out.append(("string_to_int", int(number)))
  return out


def _number_variants(x: int | float) -> list[tuple[str, Any]]:
  out = [("number_to_string", str(x)), ("plus_one", x + 1), ("negated", -x if x else 1)]
  if type(x) is int:
    out += [("int_to_float", float(x)), ("huge_int", 10 ** 400)]
    if x in (0, 1):
      out.append(("int_to_bool", bool(x)))
  else:
    out.append(("plus_half", x + 0.5))
    if x.is_integer():
      out.append(("float_to_int", int(x)))
  return out


def value_variants(value: Any, depth: int = 0) -> list[tuple[str, Any]]:
  """Perturbations of one argument value: (kind, new value). Inside a list the first item
  is perturbed ("item0_" kinds), inside a dict every value ("dict_value_" kinds)."""
  if isinstance(value, bool):
    return [("bool_to_int", int(value)), ("bool_to_string", str(value).lower()),
            ("negated", not value)]
  if isinstance(value, (int, float)):
    return _number_variants(value)
  if isinstance(value, str):
    return _string_variants(value)
  if value is None:
    return [("none_to_empty", ""), ("none_to_zero", 0)]
  if isinstance(value, list):
    out = [("empty_list", []), ("reversed", value[::-1]), ("list_to_string", str(value))]
    if value:
      out += [("drop_last", value[:-1]), ("repeat_first", value + value[:1])]
      if all(type(v) in (int, float) for v in value):
        out += [("items_to_float", [float(v) for v in value]),
                ("items_to_int", [int(v) if float(v).is_integer() else v for v in value]),
                ("items_to_string", [str(v) for v in value])]
      if depth == 0:
        out += [(f"item0_{kind}", [v] + value[1:]) for kind, v in value_variants(value[0], 1)]
    return out
  if isinstance(value, Mapping):
    out = [("empty_dict", {}), ("dict_extra_key", {**value, "zz_extra": 1})]
    for key in value:
      out.append(("dict_drop_key", {k: v for k, v in value.items() if k != key}))
      if depth == 0:
        out += [(f"dict_value_{kind}", {**value, key: v})
                for kind, v in value_variants(value[key], 1)]
    return out
  return []


def _concrete(value: Any) -> Any:
  """The value one acceptable entry stands for (a dict template: first values, "" left out)."""
  if isinstance(value, Mapping):
    out = {}
    for key, accs in value.items():
      firsts = [a for a in (accs if isinstance(accs, list) else [accs]) if a != ""]
      if firsts:
        out[key] = _concrete(firsts[0])
    return out
  if isinstance(value, list):
    return [_concrete(v) for v in value]
  return value


def _alternatives(item: BfclItem, base: list[Call]) -> list[tuple[str, list[Call]]]:
  """The reference answer with other acceptable values: the last one of every argument, and
  every optional argument of the possible answer given its first non-"" value."""
  last, full = copy.deepcopy(base), copy.deepcopy(base)
  for k, answer in enumerate(item.ground_truth):
    (_, args), = answer.items()
    for key, accs in args.items():
      values = [a for a in accs if a != ""]
      if not values:
        continue
      if key in last[k]["arguments"]:
        last[k]["arguments"][key] = _concrete(values[-1])
      full[k]["arguments"].setdefault(key, _concrete(values[0]))
  return [("last_values", last), ("all_optionals", full)]


def _orders(calls: list[Call]) -> Iterator[list[Call]]:
  for order in itertools.islice(itertools.permutations(range(len(calls))), 1, MAX_ORDERS):
    yield [calls[i] for i in order]


class Variant(NamedTuple):
  """One answer to score.

  Attributes:
    label: unique within the item, e.g. "last_values/call_1.city:3:upper".
    kind: the perturbation alone ("upper", "order", "missing_required", ...).
    call: the index of the perturbed call, None for list-level changes.
    calls: the answer, [{"name": str, "arguments": {...}}].
  """

  label: str
  kind: str
  call: int | None
  calls: list[Call]


def answer_variants(item: BfclItem) -> Iterator[Variant]:
  """Every answer to score for one item; the first is the reference answer."""
  names = [f["name"] for f in item.functions]
  docs = {f["name"]: f for f in item.functions}
  base = reference_calls(item)
  yield Variant("reference", "reference", None, base)
  if not base:  # irrelevance: any call is wrong, no call is right
    for name in names:
      props = docs[name]["parameters"].get("properties", {})
      yield Variant(f"call:{name}", "extra_call", None, [{"name": name, "arguments": {}}])
      if props:
        first = next(iter(props))
        yield Variant(f"call:{name}.{first}", "extra_call", None,
                      [{"name": name, "arguments": {first: "x"}}])
    return
  answers = [("reference", base)] + _alternatives(item, base)
  for label, calls in answers[1:]:
    yield Variant(label, label, None, calls)
  for label, calls in answers:
    for k, order in enumerate(_orders(calls)):
      yield Variant(f"{label}/order_{k}", "order", None, order)
  yield Variant("no_calls", "missing_call", None, [])
  yield Variant("duplicate_first", "extra_call", None, base + base[:1])
  for i in range(len(base)):
    if len(base) > 1:
      yield Variant(f"drop_call_{i}", "missing_call", i, base[:i] + base[i + 1:])
    for other in names:
      if other != base[i]["name"]:
        yield Variant(f"extra_call:{other}", "extra_call", None,
                      base + [{"name": other, "arguments": {}}])
        yield Variant(f"call_{i}:renamed_to:{other}", "wrong_name", i,
                      _with(base, i, name=other))
    yield Variant(f"call_{i}:wrong_name", "wrong_name", i,
                  _with(base, i, name=base[i]["name"] + "_x"))
    if "." in base[i]["name"]:
      yield Variant(f"call_{i}:dots_to_underscores", "wrong_name", i,
                    _with(base, i, name=base[i]["name"].replace(".", "_")))
  for label, calls in answers:
    for i, call in enumerate(calls):
      doc = docs[call["name"]]["parameters"]
      required = set(doc.get("required", ()))
      args = call["arguments"]
      where = f"{label}/call_{i}"
      yield Variant(f"{where}:extra_arg", "extra_arg", i,
                    _with(calls, i, arguments={**args, "zz_extra": 1}))
      for key in doc.get("properties", {}):
        if key not in args:
          yield Variant(f"{where}.{key}:added", "undeclared_in_answer", i,
                        _with(calls, i, arguments={**args, key: "x"}))
      for key, value in args.items():
        yield Variant(f"{where}.{key}:dropped",
                      "missing_required" if key in required else "missing_optional", i,
                      _with(calls, i, arguments={k: v for k, v in args.items() if k != key}))
        yield Variant(f"{where}.{key}:null", "null", i,
                      _with(calls, i, arguments={**args, key: None}))
        for n, (kind, v) in enumerate(value_variants(value)):
          yield Variant(f"{where}.{key}:{n}:{kind}", kind, i,
                        _with(calls, i, arguments={**args, key: v}))


def _with(calls: Sequence[Call], i: int, **fields: Any) -> list[Call]:
  """`calls` with call i's fields replaced (the others shared, never mutated)."""
  out = list(calls)
  out[i] = {**calls[i], **fields}
  return out
