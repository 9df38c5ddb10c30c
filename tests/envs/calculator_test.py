"""Tests of the shared safe evaluator: grammar, precedence, functions, limits, exactness."""

from __future__ import annotations

import inspect
import math
import sys
import time
from fractions import Fraction

import pytest

from tree_rl.envs.calculator import (FUNCTIONS, MAX_EXPRESSION_CHARS, MAX_RESULT_BITS, evaluate,
                                     evaluate_to_number, evaluate_to_text, format_number)

# -- values -------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("2 + 3 * 4", "14"),            # * before +
    ("(2 + 3) * 4", "20"),
    ("2 ** 3 ** 2", "512"),         # ** is right-associative: 2 ** 9
    ("2^10", "1024"),               # ^ is read as a power
    ("2^3*2", "16"),                # ... with the precedence of **
    ("-3 ** 2", "-9"),              # unary minus binds looser than **
    ("10 - 4 - 3", "3"),            # left-associative
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),                 # exact, shown without a decimal point
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),              # floor division rounds down
    ("7 % 3", "1"),
    ("0.1 + 0.2", "0.3"),           # exact decimal arithmetic
    ("0.1 * 3 * 10", "3"),
    ("1 / 3", repr(1 / 3)),
    ("2 ** -2", "0.25"),
    ("sqrt(16) + abs(-5)", "9"),
    ("max(3, 9, 2) - min(4, 1)", "8"),
    ("floor(2.7) + ceil(2.1)", "5"),
    ("round(2.567, 2)", "2.57"),
    ("round(7 / 2)", "4"),
    ("log(exp(2))", "2"),
    ("log(8, 2)", "3"),
    ("log10(1000)", "3"),
    ("sin(0) + cos(0) + tan(0)", "1"),
    ("2 * pi", repr(2 * math.pi)),
    ("e", repr(math.e)),
    ("9568 + -3477", "6091"),
    ("+5", "5"),
    ("-" * 100 + "1", "1"),
])
def test_text_values(expression, expected):
  assert evaluate_to_text(expression) == expected


@pytest.mark.parametrize("expression, expected", [
    ("2 + 3 * 4", 14), ("(2025 - 1987) / 2", 19), ("2 ** 10", 1024), ("sqrt(144)", 12),
    ("round(10 / 3, 2)", 3.33), ("-7 // 2", -4), ("17 % 5", 2), ("max(3, 9, 4)", 9),
    ("1 / 3", 0.3333333333), ("pi * 2", 6.283185307), ("7 / 2", 3.5), ("0.1 + 0.2", 0.3),
    ("2 ** -1", 0.5), ("(-8) ** 2.0", 64), ("log(8, 2)", 3), ("log10(1000)", 3),
    ("10 ** 15", 1e15), ("2 ** 100", 1.2676506e30),
])
def test_number_values(expression, expected):
  value = evaluate_to_number(expression)
  assert value == expected
  assert isinstance(value, int) == isinstance(expected, int)


def test_number_results_are_ints_below_1e15_and_10_digit_floats_otherwise():
  assert evaluate_to_number("999999999999999") == 999_999_999_999_999
  assert isinstance(evaluate_to_number("10 ** 15"), float)
  assert evaluate_to_number("2 / 3") == 0.6666666667
  assert evaluate_to_number("1.5 * 2") == 3 and isinstance(evaluate_to_number("1.5 * 2"), int)


# -- exactness ------------------------------------------------------------------


def test_exact_mode_keeps_fractions_and_float_mode_uses_python_arithmetic():
  assert evaluate("0.1 + 0.2") == Fraction(3, 10)
  assert evaluate("0.1 + 0.2", exact=False) == 0.1 + 0.2
  assert evaluate("7 / 2") == Fraction(7, 2)
  assert evaluate("7 / 2", exact=False) == 3.5 and isinstance(evaluate("7 / 2", exact=False), float)
  assert evaluate("7 // 2", exact=False) == 3 and isinstance(evaluate("7 // 2", exact=False), int)
  assert evaluate("2 ** 200") == 2**200  # exact integer powers within the size bound
  assert evaluate("2 ** 200", exact=False) == 2**200
  assert evaluate("(1 / 3) * 3") == 1
  assert isinstance(evaluate("sqrt(2)"), float)  # irrational results are floats either way


def test_round_on_an_exact_tie_differs_from_its_float():
  # 107 / 40 is exactly 2.675, a tie that rounds to even; the float 2.675 lies below it.
  assert evaluate_to_text("round(107 / 40, 2)") == "2.68"
  assert evaluate_to_number("round(107 / 40, 2)") == 2.67


def test_large_exact_values_are_exact():
  assert evaluate_to_text("3 ** 100 - 3 ** 100 + 1") == "1"
  assert evaluate_to_text("2 ** 64") == str(2**64)
  assert evaluate_to_text("10 ** 20 + 1") == "100000000000000000001"


# -- errors ---------------------------------------------------------------------


_COMMON_ERRORS = [
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('ls')", "only these functions can be called"),
    ("open('x')", "only these functions can be called"),
    ("eval('1')", "only these functions can be called"),
    ("(lambda: 1)()", "only these functions can be called"),
    ("round(2.5, ndigits=1)", "keyword arguments are not allowed"),
    ("(1).real", "attribute access is not allowed"),
    ("math.pi", "attribute access is not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("1j * 2", "only numbers are allowed"),
    ("[1] * 3", "unsupported syntax: List"),
    ("lambda: 1", "unsupported syntax: Lambda"),
    ("1 < 2", "unsupported syntax: Compare"),
    ("~1", "unsupported syntax: UnaryOp"),
    ("1,000 + 1", "thousands separators"),
    ("9 ** 9 ** 9", "too large"),
    ("10 ** 100000", "too large"),
    (f"2 ** {MAX_RESULT_BITS}", "too large"),
    ("(-8) ** 0.5", "not real"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("7 // 0.0", "division by zero"),
    ("sqrt(-1)", "sqrt()"),
    ("log(0)", "log()"),
    ("exp(10000)", "exp()"),
    ("max()", "max()"),
    ("2 +", "invalid expression"),
    ("", "empty"),
    ("   ", "empty"),
    ("1 + " * 300 + "1", "longer than"),
]


@pytest.mark.parametrize("expression, message", _COMMON_ERRORS + [("0 ** -1", "division by zero"),
                                                                  ("2 ** -20000", "too large")])
def test_text_errors(expression, message):
  start = time.monotonic()
  with pytest.raises(ValueError) as info:
    evaluate_to_text(expression)
  assert message in str(info.value)
  assert time.monotonic() - start < 1.0  # huge powers are refused, not computed


@pytest.mark.parametrize("expression, message", _COMMON_ERRORS + [
    ("2 ^ 3", "use '**'"),
    ("10 ** 400", "too large"),  # exact, but no float holds it
    ("1e308 * 10", "not a finite number"),
])
def test_number_errors(expression, message):
  start = time.monotonic()
  with pytest.raises(ValueError) as info:
    evaluate_to_number(expression)
  assert message in str(info.value)
  assert time.monotonic() - start < 1.0


def test_the_length_limit_is_inclusive():
  expression = "1" * MAX_EXPRESSION_CHARS
  assert len(expression) == MAX_EXPRESSION_CHARS
  assert evaluate(expression) == int(expression)
  with pytest.raises(ValueError, match="longer than"):
    evaluate(expression + "1")


def test_deep_nesting_is_an_error_not_a_crash():
  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(len(inspect.stack()) + 100)
  try:
    with pytest.raises(ValueError, match="nested too deeply"):
      evaluate("-" * 300 + "1")
  finally:
    sys.setrecursionlimit(limit)


def test_unknown_name_lists_what_is_allowed():
  with pytest.raises(ValueError) as info:
    evaluate("foo(1)")
  assert all(name in str(info.value) for name in FUNCTIONS)
  with pytest.raises(ValueError) as info:
    evaluate("tau")
  assert "pi" in str(info.value) and "sqrt" in str(info.value)


# -- formatting -----------------------------------------------------------------


@pytest.mark.parametrize("value, text", [
    (Fraction(6, 3), "2"), (Fraction(7, 2), "3.5"), (Fraction(1, 3), repr(1 / 3)), (5, "5"),
    (2.0, "2"), (1e16, "1e+16"), (0.1, "0.1"), (Fraction(10**30), str(10**30)), (-0.5, "-0.5"),
])
def test_format_number(value, text):
  assert format_number(value) == text


@pytest.mark.parametrize("expression", ["round(1, 20000000)", "round(1, 999999999)",
                                        "round(1/3, -5000)", "round(2, 1.5)"])
def test_round_bounds_its_digits_before_computing(expression):
  """round(1, n) on an exact value computes 10**n first: a huge n once held the GIL for
  ~18 s (every rollout thread froze). Now it is refused at once."""
  start = time.perf_counter()
  with pytest.raises(ValueError, match=r"round\(\): ndigits must be an integer between "
                                       r"-4000 and 4000"):
    evaluate(expression)
  assert time.perf_counter() - start < 0.5
  assert evaluate("round(1234, -2)") == 1200 and evaluate("round(2.675, 2)") == Fraction(268, 100)
