"""The one safe arithmetic evaluator behind every calculator tool of the task families.

A policy's calculator call is untrusted text, so it is never given to `eval`:
`evaluate` parses it with `ast` and walks the tree, allowing only numbers, the
constants in `CONSTANTS`, calls of the functions in `FUNCTIONS`, unary +/-
and the binary operators + - * / // % **. Names that reach Python objects,
attribute access, keyword arguments and every other construct are refused
with a message the model can act on. Expressions are at most
`MAX_EXPRESSION_CHARS` long and every exact (integer or fractional) step stays
under `MAX_RESULT_BITS`, so `9**9**9` is refused at once instead of stalling a
rollout worker.

Two callers share it and differ only in arithmetic and result type, hence two
thin entry points:

* `evaluate_to_text` (the math family's `calculator`): exact rational
  arithmetic on the literals (0.1 + 0.2 is 3/10), `^` read as `**`, the value
  as text (`format_number`).
* `evaluate_to_number` (the tool world's `math_calculation`): Python's own
  int/float arithmetic, `^` refused, the value as an int or a float rounded to
  10 significant digits. The tool world's generated tasks record these values
  in their oracle tool messages, so this mode keeps Python's float semantics
  (for instance `round(107 / 40, 2)` is 2.67 on the float 2.675, not 2.68).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

Number = int | float | Fraction

MAX_EXPRESSION_CHARS = 500
# Exact values are kept under this many bits (~3,000 digits) so that no step of
# an expression, e.g. 9**9**9, can hang the host or exceed int->str limits.
MAX_RESULT_BITS = 10_000

_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_DIVISIONS = (ast.Div, ast.FloorDiv, ast.Mod)


def _log(x: Any, base: Any = None) -> float:
  """Natural logarithm, or the logarithm to `base` when one is given."""
  return math.log(x) if base is None else math.log(x, base)


# round()'s digits are bounded before it runs: round(1, n) on an exact value computes
# 10**n first (round(1, 20000000) held the GIL for ~18 s), and no value the calculator
# keeps (MAX_RESULT_BITS) has more digits than this.
MAX_ROUND_DIGITS = 4_000


def _round(x: Any, ndigits: Any = None) -> Any:
  """round(x) or round(x, ndigits), with |ndigits| <= MAX_ROUND_DIGITS and an integer."""
  if ndigits is None:
    return round(x)
  n = _integer(ndigits)
  if n is None or abs(n) > MAX_ROUND_DIGITS:
    raise ValueError(f"ndigits must be an integer between -{MAX_ROUND_DIGITS} and "
                     f"{MAX_ROUND_DIGITS}, got {ndigits}")
  return round(x, n)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": _round, "min": min, "max": max,
    "floor": math.floor, "ceil": math.ceil, "log": _log, "log10": math.log10,
    "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _bits(value: int | Fraction) -> int:
  """The size of an exact value: the longer of its numerator and denominator, in bits."""
  value = Fraction(value)
  return max(value.numerator.bit_length(), value.denominator.bit_length())


def _checked(value: Any, exact: bool) -> Number:
  """`value` as a finite float, or an exact value within MAX_RESULT_BITS.

  In exact mode integers become Fractions, so that `/` on them stays exact.
  """
  if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
    raise ValueError(f"unsupported value {value!r}")
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError("the result is not a finite number")
    return value
  if _bits(value) > MAX_RESULT_BITS:
    raise ValueError("the result is too large")
  return Fraction(value) if exact else value


def _integer(value: Number) -> int | None:
  """The value as an int when it is an exact integer (int or whole Fraction), else None."""
  if isinstance(value, int):
    return value
  if isinstance(value, Fraction) and value.denominator == 1:
    return value.numerator
  return None


def _power(base: Number, exponent: Number, exact: bool) -> Number:
  """base ** exponent: exact for an exact base and integer exponent, else a float.

  Outside exact mode a negative integer exponent gives a float, as in Python.
  """
  n = _integer(exponent)
  if n is not None and isinstance(base, (int, Fraction)) and (exact or n >= 0):
    # 0, 1 and -1 stay small; anything else grows by its size per unit of exponent.
    if _bits(base) > 1 and _bits(base) * abs(n) > MAX_RESULT_BITS:
      raise ValueError("the result is too large")
    if base == 0 and n < 0:
      raise ValueError("division by zero")
    return base**n
  base, exponent = float(base), float(exponent)
  if base < 0 and not exponent.is_integer():
    raise ValueError("a negative number to a fractional power is not real")
  return base**exponent


def _eval(node: ast.AST, exact: bool) -> Number:
  """Evaluates one node of the restricted grammar, raising ValueError on anything else."""
  if isinstance(node, ast.Expression):
    return _eval(node.body, exact)
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise ValueError(f"only numbers are allowed, got {node.value!r}")
    if exact and isinstance(node.value, float):
      # repr() keeps a decimal literal exact: 0.1 is 1/10, not its binary neighbour.
      return _checked(Fraction(repr(node.value)), exact)
    return _checked(node.value, exact)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = _eval(node.operand, exact)
    return -value if isinstance(node.op, ast.USub) else value
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
    raise ValueError("'^' is not a power operator here; use '**'")
  if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY_OPS or isinstance(node.op, ast.Pow)):
    left, right = _eval(node.left, exact), _eval(node.right, exact)
    if isinstance(node.op, ast.Pow):
      return _checked(_power(left, right, exact), exact)
    if isinstance(node.op, _DIVISIONS) and right == 0:
      raise ValueError("division by zero")
    return _checked(_BINARY_OPS[type(node.op)](left, right), exact)
  if isinstance(node, ast.Name):
    if node.id in CONSTANTS:
      return CONSTANTS[node.id]
    raise ValueError(f"unknown name '{node.id}'; allowed functions: {', '.join(FUNCTIONS)}; "
                     f"constants: {', '.join(CONSTANTS)}")
  if isinstance(node, ast.Call):
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
      raise ValueError(f"only these functions can be called: {', '.join(FUNCTIONS)}")
    if node.keywords:
      raise ValueError("keyword arguments are not allowed")
    args = [_eval(a, exact) for a in node.args]
    try:
      return _checked(FUNCTIONS[node.func.id](*args), exact)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
      raise ValueError(f"{node.func.id}(): {e}") from None
  if isinstance(node, ast.Attribute):
    raise ValueError("attribute access is not allowed")
  if isinstance(node, ast.Tuple):
    raise ValueError("unsupported syntax: Tuple (write numbers without thousands separators: "
                     "1000, not 1,000)")
  raise ValueError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str, *, exact: bool = True, caret_is_power: bool = True) -> Number:
  """The value of an arithmetic expression, evaluated without eval/exec.

  Allowed: numbers, + - * / // % **, unary +/-, parentheses, calls of
  FUNCTIONS (positional arguments only) and the CONSTANTS pi and e.

  Args:
    expression: the expression, at most MAX_EXPRESSION_CHARS characters.
    exact: evaluate number literals exactly (as Fractions: 0.1 + 0.2 == 3/10)
      rather than as Python ints and floats (7 / 2 is then the float 3.5).
      Function results and irrational constants are floats either way.
    caret_is_power: read `^` as `**` (same precedence); otherwise `^` is an
      error that points to `**`.

  Returns:
    A Fraction or float (exact mode), or an int or float.

  Raises:
    ValueError: a syntax error, a disallowed construct, division by zero, a
      math domain error or a result that is too large; the message says which.
  """
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
  text = expression.strip()
  if caret_is_power:
    text = text.replace("^", "**")
  if not text:
    raise ValueError("the expression is empty")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"invalid expression: {e.msg}") from None
  except (RecursionError, MemoryError):
    raise ValueError("the expression is nested too deeply") from None
  try:
    return _eval(tree, exact)
  except (ZeroDivisionError, OverflowError) as e:
    raise ValueError(str(e)) from None
  except RecursionError:
    raise ValueError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
  """Integers without a decimal point, other values as the shortest float repr."""
  if isinstance(value, int) and not isinstance(value, bool):
    return str(value)
  if isinstance(value, Fraction) and value.denominator == 1:
    return str(value.numerator)
  value = float(value)
  if value.is_integer() and abs(value) < 1e16:
    return str(int(value))
  return repr(value)


def evaluate_to_text(expression: str) -> str:
  """The exact value of `expression` as text; `^` is a power (the math family's calculator).

  See `evaluate` (exact mode) for the grammar and `format_number` for the text.

  Raises:
    ValueError: as `evaluate`.
  """
  value = evaluate(expression, exact=True, caret_is_power=True)
  try:
    return format_number(value)
  except OverflowError as e:  # a huge non-integral Fraction has no float to show
    raise ValueError(str(e)) from None


def evaluate_to_number(expression: str) -> int | float:
  """The value of `expression` with Python int/float arithmetic; `^` is refused.

  The tool world's `math_calculation`: e.g. "(1234 - 1987) / 3 + sqrt(16)".

  Returns:
    An int when the value is integral and below 1e15 in size (an int result
    always is one), else a float rounded to 10 significant digits.

  Raises:
    ValueError: as `evaluate`, or a result too large for a float.
  """
  value = evaluate(expression, exact=False, caret_is_power=False)
  try:
    if isinstance(value, Fraction):  # not produced in this mode; kept total for safety
      value = value.numerator if value.denominator == 1 else float(value)
    if isinstance(value, int) and abs(value) >= 1e15:
      value = float(value)
  except OverflowError:
    raise ValueError("the result is too large") from None
  if isinstance(value, int) or (value.is_integer() and abs(value) < 1e15):
    return int(value)
  return float(f"{value:.10g}")
