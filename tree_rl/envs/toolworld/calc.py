"""World-independent tool logic: unit conversion, list sort and filter.

The tool world's arithmetic (`math_calculation`) is not here: it is the shared
safe evaluator `tree_rl.envs.calculator.evaluate_to_number`, one evaluator for
every family's calculator tool.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

Number = int | float


# -- Units ----------------------------------------------------------------------

# (category, symbol, size in the category's base unit, aliases)
_UNITS = (
    ("length", "m", 1.0, ("meter", "meters", "metre", "metres")),
    ("length", "km", 1000.0, ("kilometer", "kilometers", "kilometre", "kilometres")),
    ("length", "cm", 0.01, ("centimeter", "centimeters", "centimetre", "centimetres")),
    ("length", "mi", 1609.344, ("mile", "miles")),
    ("length", "ft", 0.3048, ("foot", "feet")),
    ("length", "in", 0.0254, ("inch", "inches")),
    ("length", "yd", 0.9144, ("yard", "yards")),
    ("mass", "kg", 1.0, ("kilogram", "kilograms")),
    ("mass", "g", 0.001, ("gram", "grams")),
    ("mass", "lb", 0.45359237, ("lbs", "pound", "pounds")),
    ("mass", "oz", 0.028349523125, ("ounce", "ounces")),
    ("volume", "l", 1.0, ("liter", "liters", "litre", "litres")),
    ("volume", "ml", 0.001, ("milliliter", "milliliters", "millilitre", "millilitres")),
    ("volume", "gal", 3.785411784, ("gallon", "gallons")),
    ("speed", "km/h", 1 / 3.6, ("kph", "kmh")),
    ("speed", "mph", 0.44704, ("miles per hour",)),
    ("speed", "m/s", 1.0, ("meters per second", "metres per second")),
    ("temperature", "C", 0.0, ("c", "celsius", "°c", "degc")),
    ("temperature", "F", 0.0, ("f", "fahrenheit", "°f", "degf")),
    ("temperature", "K", 0.0, ("k", "kelvin")),
)
_UNIT_BY_NAME = {}
for _category, _symbol, _size, _aliases in _UNITS:
  for _name in (_symbol.lower(), *_aliases):
    _UNIT_BY_NAME[_name] = (_category, _symbol, _size)


def unit_of(name: str) -> tuple[str, str, float] | None:
  """(category, symbol, size) of a unit name or alias, None if it is not a unit."""
  return _UNIT_BY_NAME.get(name.strip().lower())


def convert_units(value: Number, source: str, target: str) -> tuple[float, str, str]:
  """Converts between two units of one category; returns (result, source symbol, target symbol)."""
  a, b = unit_of(source), unit_of(target)
  if a is None or b is None:
    raise ValueError(f"unknown unit '{source if a is None else target}'")
  if a[0] != b[0]:
    raise ValueError(f"cannot convert {a[0]} ({a[1]}) to {b[0]} ({b[1]})")
  if a[0] == "temperature":
    kelvin = {"C": value + 273.15, "F": (value - 32) * 5 / 9 + 273.15, "K": value}[a[1]]
    result = {"C": kelvin - 273.15, "F": (kelvin - 273.15) * 9 / 5 + 32, "K": kelvin}[b[1]]
  else:
    result = value * a[2] / b[2]
  return round(result, 4), a[1], b[1]


# -- Lists ----------------------------------------------------------------------

def _field(item: Any, key: str | None) -> Any:
  """`item` itself, or its value at a dotted `key` ("record.points")."""
  if key is None:
    return item
  value = item
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      raise ValueError(f"an item has no key '{key}'")
    value = value[part]
  return value


def _kind(value: Any) -> str:
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  if isinstance(value, str):
    return "string"
  return "other"


def sort_items(items: Sequence[Any], key: str | None, descending: bool) -> list[Any]:
  """A stable sort of `items` (numbers, strings, or objects by a dotted key)."""
  values = [_field(item, key) for item in items]
  kinds = {_kind(v) for v in values}
  if len(kinds) > 1 or kinds & {"other", "boolean"}:
    raise ValueError("items must be compared by values of one type (all numbers or all strings)")
  order = sorted(range(len(items)), key=lambda i: values[i], reverse=descending)
  return [items[i] for i in order]


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
FILTER_OPERATORS = ("==", "!=", ">", ">=", "<", "<=", "contains")


def filter_items(items: Sequence[Any], key: str | None, op: str, value: Any) -> list[Any]:
  """The items whose value (at `key`) satisfies `op value`; strings compare case-insensitively."""
  kept = []
  for item in items:
    field = _field(item, key)
    if op == "contains":
      if isinstance(field, str) and isinstance(value, str):
        ok = value.lower() in field.lower()
      elif isinstance(field, list):
        ok = any(_kind(x) == _kind(value) and
                 (x.lower() == value.lower() if isinstance(x, str) else x == value) for x in field)
      else:
        raise ValueError("'contains' needs string or list values")
    elif _kind(field) != _kind(value) or _kind(value) == "other":
      if op in ("==", "!="):
        ok = op == "!="
      else:
        raise ValueError(f"cannot compare {_kind(field)} {field!r} with {_kind(value)} {value!r}")
    elif isinstance(field, str):
      a, b = field.lower(), value.lower()
      ok = a == b if op == "==" else a != b if op == "!=" else _COMPARE[op](a, b)
    else:
      ok = field == value if op == "==" else field != value if op == "!=" else _COMPARE[op](field, value)
    if ok:
      kept.append(item)
  return kept
