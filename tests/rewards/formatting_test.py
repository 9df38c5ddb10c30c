"""Tests of PORTool's formatting rubric, plus a fuzz test of parser + executor + rubric.

The fuzz test mutates valid steps thousands of times (seeded, deterministic) and
checks the whole host-side path against an independently written cascade: a
regex/`str.split` reading of the raw text that shares no code with
`tree_rl.envs.parsing`.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tree_rl.envs.base import ParsedStep, Tool, ToolError, ToolResult, render_tool_output
from tree_rl.envs.executor import ToolExecutor
from tree_rl.envs.parsing import format_tool_call, parse_step
from tree_rl.rewards.formatting import formatting_raw, rescale_formatting

# ---------------------------------------------------------------- hand cases

OK = ToolResult(name="f", content="1", ok=True)
FAIL = ToolResult(name="f", content="Error [exception]: x", ok=False, error=ToolError.EXCEPTION)
GOOD = '{"name": "f", "arguments": {}}'


def _raw(text, results=()):
  return formatting_raw(parse_step(text), list(results))


@pytest.mark.parametrize("text, results, expected", [
    (f"<tool_call>{GOOD}</tool_call>", [OK], 0.0),  # no think block
    ("<think>hm</think>The answer is 4.", [], 0.2),  # think only
    ("<think>hm</think><tool_call>{broken</tool_call>", [FAIL], 0.3),
    ('<think>hm</think><tool_call>{"name": "f"}</tool_call>', [FAIL], 0.4),
    (f"<think>hm</think><tool_call>{GOOD}</tool_call>", [FAIL], 0.45),
    (f"<think>hm</think><tool_call>[{GOOD}, {GOOD}]</tool_call>", [OK, FAIL], 0.725),
    (f"<think>hm</think><tool_call>[{GOOD}, {GOOD}]</tool_call>", [OK, OK], 1.0),
    (f"<think>hm</think><tool_call>{GOOD}</tool_call>", [OK], 1.0),
])
def test_typical_values(text, results, expected):
  assert _raw(text, results) == pytest.approx(expected, abs=1e-12)


def test_exact_table_values():
  # Summed in hundredths, so the table's values come out exactly.
  assert _raw(f"<think>hm</think><tool_call>{GOOD}</tool_call>", [FAIL]) == 0.45
  assert _raw(f"<think>hm</think><tool_call>[{GOOD}, {GOOD}]</tool_call>", [OK, FAIL]) == 0.725
  assert _raw(f"<think>hm</think><tool_call>{GOOD}</tool_call>", [OK]) == 1.0


def test_e10_empty_list_gets_no_success_credit():
  assert _raw("<think>hm</think><tool_call>[]</tool_call>") == 0.45
  # An empty list beside a real call: the fraction is over the real calls only.
  text = f"<think>hm</think><tool_call>[]</tool_call><tool_call>{GOOD}</tool_call>"
  assert _raw(text, [OK]) == 1.0


def test_multiple_blocks():
  two = f"<think>hm</think><tool_call>{GOOD}</tool_call>\n<tool_call>[{GOOD}, {GOOD}]</tool_call>"
  assert _raw(two, [OK, FAIL, FAIL]) == pytest.approx(0.45 + 0.55 / 3)
  # Every block must parse: one broken block caps the step at 0.3.
  broken = f"<think>hm</think><tool_call>{GOOD}</tool_call><tool_call>{{</tool_call>"
  assert _raw(broken, [OK, FAIL]) == pytest.approx(0.3)
  unterminated = f"<think>hm</think><tool_call>{GOOD}</tool_call><tool_call>{GOOD}"
  assert _raw(unterminated, [OK, FAIL]) == pytest.approx(0.3)
  # One call with bad fields caps it at 0.4 even if the others succeed.
  fields = f'<think>hm</think><tool_call>[{GOOD}, {{"name": "f", "arguments": []}}]</tool_call>'
  assert _raw(fields, [OK, FAIL]) == pytest.approx(0.4)


def test_misaligned_results_raise():
  with pytest.raises(ValueError, match="2 results for 1 calls"):
    _raw(f"<think>hm</think><tool_call>{GOOD}</tool_call>", [OK, OK])


def test_rescale():
  assert rescale_formatting(0.0) == -0.25
  assert rescale_formatting(1.0) == 0.25
  assert rescale_formatting(0.5) == 0.0
  assert rescale_formatting(0.725) == pytest.approx(0.1125)
  assert rescale_formatting(1.0, half_width=0.5) == 0.5
  with pytest.raises(ValueError):
    rescale_formatting(1.5)


# ---------------------------------------------------------------- fuzz: independent cascade

_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_FENCE = re.compile(r"\A```(?:json)?(.*?)(?:```)?\Z", re.S | re.I)


def _reject(name):
  raise ValueError(name)


def _expected_raw(text: str, results) -> tuple[float, int]:
  """(rubric, number of calls) read from the raw text alone, by a second implementation."""
  match = _THINK.search(text)
  if match is None:
    return 0.0, -1
  rest = text[:match.start()] + "\n" + text[match.end():]
  pieces = rest.split("<tool_call>")[1:]
  if not pieces:
    return 0.2, 0
  values = []
  for piece in pieces:
    if "</tool_call>" not in piece:
      return 0.3, -1
    body = piece.split("</tool_call>", 1)[0].strip()
    fence = _FENCE.match(body)
    body = fence.group(1).strip() if fence else body
    try:
      values.append(json.loads(body, parse_constant=_reject))
    except (ValueError, RecursionError):
      return 0.3, -1
  calls = [c for v in values for c in (v if isinstance(v, list) else [v])]
  if not all(isinstance(c, dict) and isinstance(c.get("name"), str)
             and isinstance(c.get("arguments"), dict) for c in calls):
    return 0.4, len(calls)
  if not calls:
    return 0.45, 0
  return 0.45 + 0.55 * sum(r.ok for r in results) / len(calls), len(calls)


def _boom():
  raise RuntimeError("boom")


def _lookup(key):
  return {"a": [1, 2], "b": {"x": None}}[key]  # "c" passes the schema and raises KeyError


FUZZ_TOOLS = [
    Tool("add", "Adds.", {"type": "object", "required": ["a", "b"],
                          "properties": {"a": {"type": "integer"},
                                         "b": {"type": "integer", "minimum": 0}}},
         lambda a, b: a + b),
    Tool("echo", "Echoes.", {"type": "object", "required": ["text"],
                             "properties": {"text": {"type": "string"}}}, lambda text: text),
    Tool("lookup", "Looks up.", {"type": "object", "required": ["key"],
                                 "properties": {"key": {"enum": ["a", "b", "c"]}}}, _lookup),
    Tool("total", "Sums.", {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": ["integer", "number"]}}}},
         lambda xs=(): sum(xs)),
    Tool("free", "Anything.", {"type": "object", "additionalProperties": True},
         lambda **kw: sorted(kw)),
    Tool("boom", "Raises.", {"type": "object", "properties": {}}, _boom),
    Tool("opaque", "Returns a non-JSON value.", {"type": "object", "properties": {}}, object),
]
_FUNCTIONS = {t.name: t.fn for t in FUZZ_TOOLS}
_GOOD_ARGS = {"add": {"a": 2, "b": 3}, "echo": {"text": "héllo ✓"}, "lookup": {"key": "a"},
              "total": {"xs": [1, 2.5]}, "free": {"q": 1, "z": [None]}, "boom": {},
              "opaque": {}}
_JUNK = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<answer>", "</answer>", "{",
         "}", "[", "]", '"', ",", ":", "\\", "```", "null", "NaN", "1e400", "é", "🌧", "\x00",
         "\n", " ", "name", "arguments", "\u202e"]


def _value(rng: random.Random, depth: int = 0):
  """A random JSON value of any type, nested at most 3 deep."""
  kind = rng.randrange(9 if depth < 3 else 6)
  if kind == 6:
    return [_value(rng, depth + 1)]
  if kind == 7:
    return {"k": _value(rng, depth + 1)}
  return [rng.randint(-5, 5), rng.random() * 1e6, True, None, "文字 ✓",
          10 ** rng.choice([3, 30, 300]), None, None, [1, "x", {}]][kind]


def _call(rng: random.Random):
  name = rng.choice(list(_GOOD_ARGS))
  call = {"name": name, "arguments": dict(_GOOD_ARGS[name])}
  roll = rng.random()
  if roll < 0.15 and call["arguments"]:  # a wrong value type
    call["arguments"][rng.choice(list(call["arguments"]))] = _value(rng)
  elif roll < 0.22:
    call["arguments"]["extra"] = _value(rng)
  elif roll < 0.27:
    call["arguments"] = {}
  elif roll < 0.32:
    call["name"] = rng.choice(["nope", "", "ADD", 5, None, ["add"]])
  elif roll < 0.37:
    del call["arguments"]
  elif roll < 0.42:
    call["arguments"] = rng.choice(['{"a": 1}', [], 3, None])
  elif roll < 0.45:
    call = _value(rng)
  elif roll < 0.5 and name == "lookup":
    call["arguments"]["key"] = "c"
  return call


def _block(rng: random.Random) -> str:
  roll = rng.random()
  if roll < 0.4:
    body = json.dumps(_call(rng), ensure_ascii=rng.random() < 0.5)
  elif roll < 0.6:
    body = json.dumps([_call(rng) for _ in range(rng.randrange(4))])
  elif roll < 0.65:
    body = "[" * 5000 + "]" * 5000 if rng.random() < 0.5 else "[" * 50 + "{}" + "]" * 50
  elif roll < 0.7:
    body = '{"name": "add", "arguments": {"a": ' + "7" * 5000 + ', "b": 1}}'
  elif roll < 0.75:
    body = '{"name": "total", "arguments": {"xs": [1e400, -Infinity]}}'
  elif roll < 0.8:
    body = "".join(rng.choice(_JUNK) for _ in range(rng.randrange(12)))
  else:
    name = rng.choice(list(_GOOD_ARGS))
    return format_tool_call(name, _GOOD_ARGS[name])
  if rng.random() < 0.1:
    body = f"```json\n{body}\n```"
  return f"<tool_call>\n{body}\n</tool_call>"


def _mutate(rng: random.Random, text: str) -> str:
  roll = rng.random()
  pos = rng.randrange(len(text) + 1)
  if roll < 0.3:
    return text[:pos]
  if roll < 0.6:
    return text[:pos] + rng.choice(_JUNK) + text[pos:]
  if roll < 0.8:
    return text[:pos] + text[pos + rng.randrange(1, 20):]
  return text[:pos] + text[rng.randrange(len(text) + 1):]  # splice: duplicates or drops a span


def _fuzz_step(rng: random.Random) -> str:
  think = rng.choice(["<think>plan ✓</think>\n", "<think></think>", "", "<think>unclosed ",
                      "</think>", "<think>a<think>b</think>c</think>",
                      "<think><tool_call>{}</tool_call></think>"])
  parts = [think] + [_block(rng) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
  if rng.random() < 0.2:
    parts.append(rng.choice(["<answer>42</answer>", "The answer is 42.", "<answer>open"]))
  text = "".join(parts)
  if rng.random() < 0.6:
    for _ in range(rng.randrange(1, 4)):
      text = _mutate(rng, text)
  return text


def _check_step(executor: ToolExecutor, text: str) -> tuple[ParsedStep, float]:
  step = parse_step(text)
  results = executor.execute(step.calls)
  assert len(results) == len(step.calls)
  for call, result in zip(step.calls, results):
    if result.ok:
      assert result.error is None and call.error is None
      expected = render_tool_output(_FUNCTIONS[call.name](**call.arguments))
      assert result.content == expected
    else:
      assert result.error is not None and result.content.startswith("Error [")
      assert call.error is None or result.error == call.error
  raw = formatting_raw(step, results)
  expected_raw, num_calls = _expected_raw(text, results)
  assert 0.0 <= raw <= 1.0
  assert abs(raw - expected_raw) <= 1e-12, (text, raw, expected_raw)
  assert num_calls in (-1, len(step.calls))
  return step, raw


def test_fuzz_parser_executor_rubric():
  rng = random.Random(20240611)
  executor = ToolExecutor(FUZZ_TOOLS)
  seen_raw, seen_errors = set(), set()
  for _ in range(5000):
    text = _fuzz_step(rng)
    step, raw = _check_step(executor, text)
    seen_raw.add(round(raw, 6))
    seen_errors.update(c.error for c in step.calls)
  # The generator reaches every rung of the cascade and every parser error.
  assert {0.0, 0.2, 0.3, 0.4, 0.45, 1.0} <= seen_raw
  assert {None, ToolError.PARSE, ToolError.FORMAT} <= seen_errors


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_JUNK), st.text(max_size=8)), max_size=30))
def test_hypothesis_fragments(fragments):
  _check_step(ToolExecutor(FUZZ_TOOLS), "".join(fragments))
