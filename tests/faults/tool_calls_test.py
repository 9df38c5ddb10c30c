"""Malformed assistant steps never break a run: property-based, over the tool world's real tools.

Thousands of generated steps (random text, truncated JSON, wrong argument types, unknown
tools, huge arguments, deep nesting, calls nested in arguments, several calls per block,
stray and unclosed tags, JSON escapes of lone surrogates) go through the whole step path
of both harnesses: `parse_step` -> `ToolExecutor` (capped like the rollout's) -> `advance`
(the step logic) -> `ChatFormat.glue_tokens` (the env node). Not one may raise; every
malformed call must come back as an "Error [kind]: ..." tool reply that the model reads,
every step must carry its formatting score, and every env node must hold exactly the
step's replies.
"""

from __future__ import annotations

import collections
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests.strategies import examples
from tree_rl.envs import make_family
from tree_rl.envs.base import ToolError, ToolOutputCap
from tree_rl.envs.episode import OpenEpisode, advance
from tree_rl.envs.executor import ToolExecutor
from tree_rl.models import gguf_import
from tree_rl.rollout.chat import ChatFormat

FAMILY = make_family("toolworld")
TASK = FAMILY.generate("train", 1, 0)[0]
TOOLS = FAMILY.tools(TASK)
BY_NAME = {t.name: t for t in TOOLS}
TERMINAL = frozenset(t.name for t in TOOLS if t.terminal)
CAP_TOKENS = 128  # small, so huge replies and huge echoed arguments are cut often
STEPS_PER_EXAMPLE = 10
MAX_EXAMPLES = examples(520)  # 5,200 steps in CI
TOOL_TURN = "<|im_start|>tool\n"

# What was generated and answered, over the whole run (checked at the end).
SEEN: collections.Counter = collections.Counter()

# ------------------------------------------------------------------------------------------
# Generators
# ------------------------------------------------------------------------------------------

# Text a model could write, tags and JSON punctuation included (no chat-template markers:
# those are the engine's special tokens, not text a step can hold).
_ALPHABET = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_FRAGMENTS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>",
              "{", "}", "[", "]", '"', ":", ",", "```json", "```", "\n", "name", "arguments",
              "null", "NaN", "Infinity", "\\u", "\\ud800")
_TEXT = st.lists(st.one_of(st.text(_ALPHABET, max_size=12), st.sampled_from(_FRAGMENTS)),
                 max_size=8).map("".join)

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(_ALPHABET,
                                                                             max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(_ALPHABET, max_size=8), inner,
                                                 max_size=4)), max_leaves=10)


@st.composite
def _value_for(draw, schema):
  """A value for one argument: usually of the schema's type (or enum), sometimes not."""
  if draw(st.integers(0, 4)) == 0:
    return draw(_JSON)  # any type at all: mostly a wrong one
  if "enum" in schema:
    return draw(st.sampled_from(list(schema["enum"])))
  kind = schema.get("type", "string")
  kind = draw(st.sampled_from(kind)) if isinstance(kind, list) else kind
  if kind == "string":
    return draw(st.one_of(st.text(_ALPHABET, max_size=30),
                          st.sampled_from(["Paris", "2024-05-01", "AAPL", "EUR", "USD", "1+2",
                                           "2024-05-01T10:00+02:00", "Europe/Paris"])))
  if kind == "integer":
    return draw(st.integers(-10**6, 10**6))
  if kind == "number":
    return draw(st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False)))
  if kind == "boolean":
    return draw(st.booleans())
  if kind == "array":
    return draw(st.lists(_JSON, max_size=5))
  return draw(_JSON)


@st.composite
def _call(draw, depth=0):
  """One call object: well formed, wrong in one of many ways, or nested in another call."""
  kind = draw(st.sampled_from(["valid", "valid", "valid", "unknown", "bad_name", "bad_args",
                               "missing", "extra", "nested", "huge"]))
  tool = draw(st.sampled_from(TOOLS))
  props = dict(tool.parameters.get("properties", {}))
  args = {k: draw(_value_for(s)) for k, s in props.items()
          if k in tool.parameters.get("required", ()) or draw(st.booleans())}
  SEEN[f"call:{kind}"] += 1
  if kind == "valid":
    return {"name": tool.name, "arguments": args}
  if kind == "unknown":
    return {"name": draw(st.text(_ALPHABET, max_size=40)), "arguments": args}
  if kind == "bad_name":
    return {"name": draw(st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=3)),
                                   st.dictionaries(st.text(max_size=3), st.integers()))),
            "arguments": args}
  if kind == "bad_args":
    return {"name": tool.name, "arguments": draw(st.one_of(st.none(), st.text(max_size=20),
                                                           st.lists(_SCALARS), _SCALARS))}
  if kind == "missing":
    return draw(st.sampled_from([{"name": tool.name}, {"arguments": args}, {}]))
  if kind == "extra":
    return {"name": tool.name, "arguments": {**args, draw(st.text(max_size=10)): draw(_JSON)},
            draw(st.text(max_size=10)): draw(_JSON)}
  if kind == "nested" and depth < 3:
    inner = draw(_call(depth + 1))
    key = draw(st.sampled_from(sorted(props) or ["call"]))
    return {"name": tool.name, "arguments": {**args, key: draw(st.sampled_from(
        [inner, [inner, inner], json.dumps(inner)]))}}
  # huge: one argument (or the name) is tens to hundreds of thousands of characters
  size = draw(st.integers(10_000, 300_000))
  blob = draw(st.sampled_from("ab é\n{"))[0] * size
  key = draw(st.sampled_from(sorted(props) or ["x"]))
  if draw(st.booleans()):
    return {"name": blob, "arguments": args}
  return {"name": tool.name, "arguments": {**args, key: blob}}


@st.composite
def _block_content(draw):
  """The text inside one <tool_call> block."""
  kind = draw(st.sampled_from(["one", "one", "list", "truncated", "fenced", "deep", "constant",
                               "big_int", "surrogate", "text", "empty", "duplicate",
                               "not_object"]))
  SEEN[f"block:{kind}"] += 1
  if kind == "one":
    return json.dumps(draw(_call()), ensure_ascii=draw(st.booleans()))
  if kind == "list":
    return json.dumps(draw(st.lists(_call(), max_size=5)))
  if kind == "truncated":
    text = json.dumps(draw(_call()))
    return text[:draw(st.integers(0, max(0, len(text) - 1)))]
  if kind == "fenced":
    return "```json\n" + json.dumps(draw(_call())) + draw(st.sampled_from(["\n```", ""]))
  if kind == "deep":
    n = draw(st.integers(500, 200_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"),
                                           ('{"name": "sort_list", "arguments": {"items": [',
                                            "]}}")]))
    return opener * n + "1" + closer * draw(st.sampled_from([n, n // 2]))
  if kind == "constant":
    value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
    return '{"name": "math_calculation", "arguments": {"expression": %s}}' % value
  if kind == "big_int":
    digits = "9" * draw(st.integers(4000, 50_000))
    return '{"name": "holiday_search", "arguments": {"country": "FR", "year": %s}}' % digits
  if kind == "surrogate":
    name = draw(st.sampled_from(['"\\ud800"', '"news_search"', '"\\udfff\\ud83d"']))
    arg = draw(st.sampled_from(['"\\ud800abc"', '"Paris"', '"\\udc80"']))
    return '{"name": %s, "arguments": {"query": %s, "city": %s}}' % (name, arg, arg)
  if kind == "text":
    return draw(_TEXT)
  if kind == "empty":
    return draw(st.sampled_from(["", " ", "\n\n", "```json\n```"]))
  if kind == "duplicate":
    return '{"name": "weather_search", "name": 3, "arguments": {"city": "Paris"}, "arguments": 1}'
  return json.dumps(draw(_JSON))  # not_object: a scalar, a list of scalars, a bare dict


@st.composite
def _step(draw):
  """One assistant step: segments of text, think blocks, tool_call blocks and stray tags."""
  parts = []
  for _ in range(draw(st.integers(0, 5))):
    kind = draw(st.sampled_from(["text", "think", "call", "call", "call", "stray", "answer"]))
    SEEN[f"segment:{kind}"] += 1
    if kind == "text":
      parts.append(draw(_TEXT))
    elif kind == "think":
      inner = draw(st.one_of(_TEXT, _block_content().map(lambda c: f"<tool_call>{c}</tool_call>")))
      parts.append("<think>" + inner + draw(st.sampled_from(["</think>", "</think>", ""])))
    elif kind == "call":
      close = draw(st.sampled_from(["\n</tool_call>", "</tool_call>", "", "</tool_call"]))
      parts.append("<tool_call>\n" + draw(_block_content()) + close)
    elif kind == "stray":
      parts.append(draw(st.sampled_from(["</tool_call>", "<tool_call>", "</think>", "<think>",
                                         "<answer>", "</answer>", "<tool_call></tool_call>",
                                         "<tool_call><tool_call>", "</tool_call></tool_call>"])))
    else:
      parts.append("<answer>" + draw(_TEXT) + draw(st.sampled_from(["</answer>", ""])))
  return draw(st.sampled_from(["", "\n", " "])).join(parts)


# ------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat():
  return ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(
      str(gguf_import.default_model_dir())))


def _check_step(chat, executor, text):
  """One step through advance and the env node, with every property asserted."""
  episode = OpenEpisode(task=TASK, sample_index=0, executor=executor, terminal=TERMINAL,
                        messages=list(TASK.messages))
  advance(episode, text)
  step = episode.steps[-1]
  parsed, results = step.parsed, step.results
  assert isinstance(step.formatting_raw, float) and 0.0 <= step.formatting_raw <= 1.0
  assert math.isfinite(step.formatting_raw)
  assert episode.messages[len(TASK.messages)] == {"role": "assistant", "content": text}
  tool_messages = episode.messages[len(TASK.messages) + 1:]
  if parsed.num_tool_call_blocks == 0:
    assert episode.finished and results == () and tool_messages == []
    SEEN["final_answer"] += 1
    return
  assert len(results) == len(parsed.calls) == len(tool_messages)
  for call, result, message in zip(parsed.calls, results, tool_messages):
    assert message["role"] == "tool" and message["content"] == result.content
    assert len(chat.encode(result.content)) <= CAP_TOKENS
    if not result.ok:
      assert result.content.startswith(f"Error [{result.error.value}]: "), result.content[:200]
    if call.error is not None:  # did not parse, or not {"name": str, "arguments": object}
      assert not result.ok and result.error == call.error
    elif call.name not in BY_NAME:
      assert not result.ok and result.error == ToolError.UNKNOWN_TOOL
    SEEN[f"result:{result.error.value if result.error else 'ok'}"] += 1
  assert episode.finished == any(r.ok and r.name in TERMINAL for r in results)
  if episode.finished:
    return
  # The env node: the step's replies, each in its own tool turn, then the next header.
  glue = chat.glue_tokens(episode.messages[:len(TASK.messages)], text, tool_messages)
  assert all(0 <= t < len(chat.tokenizer) for t in glue)
  rendered = chat.decode(glue)
  assert rendered.count(TOOL_TURN) == len(tool_messages), rendered[:500]
  assert rendered.endswith("<|im_start|>assistant\n")
  SEEN["env_nodes"] += 1


def test_generated_malformed_steps_never_raise_and_are_answered_with_errors(chat):
  executor = ToolExecutor(TOOLS, output_cap=ToolOutputCap(CAP_TOKENS, chat.encode))
  SEEN.clear()

  @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
  @given(st.lists(_step(), min_size=STEPS_PER_EXAMPLE, max_size=STEPS_PER_EXAMPLE))
  def check(steps):
    for text in steps:
      _check_step(chat, executor, text)
      SEEN["steps"] += 1

  check()
  assert SEEN["steps"] >= examples(500) * STEPS_PER_EXAMPLE, SEEN
  # The generator reached every kind of failure, and successes and env nodes too.
  for kind in ("parse", "format", "unknown_tool", "invalid_arguments", "exception", "ok"):
    assert SEEN[f"result:{kind}"] > 0, (kind, SEEN)
  assert SEEN["env_nodes"] > 0 and SEEN["final_answer"] > 0, SEEN


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "news_search", "arguments": {"query": "\\ud800x"}}</tool_call>',
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    '<tool_call>{"name": "holiday_search", "arguments": {"country": "FR", "year": '
    + "9" * 20_000 + "}}</tool_call>",
    '<tool_call>{"name": "' + "n" * 1_000_000 + '", "arguments": {}}</tool_call>',
    '<tool_call>[{"name": "sort_list", "arguments": {"items": [3, 1, 2]}}, '
    '{"name": "sort_list", "arguments": {"items": "x"}}, 5]</tool_call>',
])
def test_known_hard_steps(chat, text):
  """Steps that once broke (or nearly broke) a stage, kept as fixed regression cases."""
  executor = ToolExecutor(TOOLS, output_cap=ToolOutputCap(CAP_TOKENS, chat.encode))
  _check_step(chat, executor, text)
