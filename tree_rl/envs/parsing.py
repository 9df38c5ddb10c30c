"""Splits one assistant step into think, tool calls and answer (Qwen/Hermes convention).

A step looks like

  <think>reasoning</think>
  <tool_call>
  {"name": "get_weather", "arguments": {"city": "Paris"}}
  </tool_call>

The parser is deliberately total: it never raises on any string, because the
policy's text is adversarial input during RL. Everything that is wrong with a
step is recorded on the `ParsedStep` (`json_ok`, `fields_ok`) and on each
`ToolCall` (`error`, `error_message`), so the executor can answer the model with
a precise error and PORTool's formatting rubric can grade the step.

Conventions (the rubric depends on them, see `tree_rl/rewards/formatting.py`):

  - think: the content of the first complete <think>...</think> block. Tool-call
    and answer tags inside it are reasoning, not actions (as vLLM's Qwen3
    reasoning parser treats them), so the block is cut out before the rest is
    scanned. A step whose prompt already opened the think block (some chat
    templates end the generation prompt with "<think>\n") must be re-joined with
    that prefix by the caller.
  - every <tool_call> opening tag outside the think block starts a block. A
    block is closed by the first </tool_call> before the next opening tag; a
    block that is not closed (the final one cut by the token limit, or one
    followed by another opening tag) counts and fails with ToolError.PARSE.
  - a block's content, stripped and with an optional ```json fence removed, is
    strict JSON (NaN and Infinity are rejected, and so is nesting deeper than
    MAX_JSON_DEPTH, a PARSE error too): an object is one call, a list
    is several calls (PORTool's "calls that can be executed simultaneously"),
    an empty list is zero calls, anything else is one malformed call.
  - a call must be an object with a string "name" and an object "arguments"; a
    missing "arguments" is a FORMAT error too (the rubric asks for both).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tree_rl.envs.base import ParsedStep, ToolCall, ToolError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# Removed blocks are replaced by a newline: whitespace cannot complete a tag, so
# cutting a block out never creates a new one, and words on either side stay apart.
_GAP = "\n"
MAX_NAME_CHARS = 256  # a tool name longer than this is cut (it names no tool anyway)
# Deepest JSON nesting a block may hold (a list of calls, each call, its arguments and their
# values count one level each). JSON's own limit is the recursion limit (~1,000), and every
# recursive walk of the arguments after parsing (`_valid` here, schema checks, rewards) takes
# one or more frames per level, so a value ~500 deep parsed but then failed each of them with
# RecursionError. Real arguments are a few levels deep.
MAX_JSON_DEPTH = 100


def valid_text(text: str) -> str:
  """`text` with every lone surrogate (JSON's "\\ud800" decodes to one) replaced by
  U+FFFD, so it encodes to UTF-8 wherever it is written next."""
  try:
    text.encode("utf-8")
    return text
  except UnicodeEncodeError:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _valid(value: Any) -> Any:
  """A parsed JSON value with `valid_text` applied to every string, keys included."""
  if isinstance(value, str):
    return valid_text(value)
  if isinstance(value, list):
    return [_valid(v) for v in value]
  if isinstance(value, Mapping):
    return {valid_text(k) if isinstance(k, str) else k: _valid(v) for k, v in value.items()}
  return value


def _first_block(text: str, open_tag: str, close_tag: str) -> tuple[int, int, str] | None:
  """(start, end, content) of the first complete open...close block, or None."""
  start = text.find(open_tag)
  if start < 0:
    return None
  close = text.find(close_tag, start + len(open_tag))
  if close < 0:
    return None
  return start, close + len(close_tag), text[start + len(open_tag):close]


def _strip_fence(content: str) -> str:
  """The content without surrounding whitespace and an optional ```json ... ``` fence."""
  content = content.strip()
  if content.startswith("```"):
    content = content[3:]
    if content[:4].lower() == "json":
      content = content[4:]
    if content.endswith("```"):
      content = content[:-3]
    content = content.strip()
  return content


def _too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
  """Whether a parsed JSON value nests lists and objects more than `limit` levels deep
  (iterative: it must not recurse on the very values it guards against)."""
  stack = [(value, 1)]
  while stack:
    item, depth = stack.pop()
    if isinstance(item, (list, dict)):
      if depth > limit:
        return True
      stack.extend((child, depth + 1) for child in
                   (item.values() if isinstance(item, dict) else item))
  return False


def _reject_constant(name: str) -> Any:
  raise ValueError(f"{name} is not valid JSON (write a number or null)")


def _safe_dumps(value: Any, fallback: str) -> str:
  """JSON text of one parsed element (its `raw`); `fallback` if it cannot be written back."""
  try:
    return json.dumps(value, ensure_ascii=False)
  except (RecursionError, ValueError, TypeError):
    return fallback


def _json_type(value: Any) -> str:
  """The JSON name of a parsed value's type, for error messages."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  if isinstance(value, str):
    return "string"
  if isinstance(value, list):
    return "array"
  return "object"


def _check_call(value: Any, raw: str, where: str) -> ToolCall:
  """One ToolCall from one parsed JSON value; FORMAT error if its fields are wrong."""
  if not isinstance(value, Mapping):
    return ToolCall(name=None, arguments=None, raw=raw, error=ToolError.FORMAT,
                    error_message=(f"{where}a tool call must be a JSON object "
                                   '{"name": <function-name>, "arguments": {...}}, '
                                   f"got {_json_type(value)}"))
  problems = []
  name = value.get("name")
  if "name" not in value:
    problems.append('the call has no "name" field')
  elif not isinstance(name, str):
    problems.append(f'"name" must be a string, got {_json_type(name)}')
  arguments = value.get("arguments")
  if "arguments" not in value:
    problems.append('the call has no "arguments" field '
                    '(write "arguments": {} for a function without arguments)')
  elif not isinstance(arguments, Mapping):
    problems.append(f'"arguments" must be a JSON object, got {_json_type(arguments)}')
  return ToolCall(name=valid_text(name)[:MAX_NAME_CHARS] if isinstance(name, str) else None,
                  arguments=_valid(arguments) if isinstance(arguments, Mapping) else None,
                  raw=raw,
                  error=ToolError.FORMAT if problems else None,
                  error_message=where + "; ".join(problems) if problems else None)


def _parse_block(block: str, closed: bool) -> tuple[bool, list[ToolCall]]:
  """(parsed as JSON, calls) of one <tool_call> block's content."""
  if not closed:
    return False, [ToolCall(name=None, arguments=None, raw=block, error=ToolError.PARSE,
                            error_message=(f"the {CALL_OPEN} block is not closed with "
                                           f"{CALL_CLOSE}"))]
  content = _strip_fence(block)
  if not content:
    message = f"the {CALL_OPEN} block is empty"
  else:
    try:
      value = json.loads(content, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
      message = f"{e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
    except RecursionError:
      message = "the JSON is nested too deeply"
    except ValueError as e:  # a rejected constant, or an integer with too many digits
      message = str(e)
    else:
      if _too_deep(value):  # parsed, but too deep for what reads it next
        message = f"the JSON is nested more than {MAX_JSON_DEPTH} levels deep"
      elif isinstance(value, list):
        calls = [_check_call(v, _safe_dumps(v, block), f"list element {i}: ")
                 for i, v in enumerate(value)]
        return True, calls
      else:
        return True, [_check_call(value, block, "")]
  return False, [ToolCall(name=None, arguments=None, raw=block, error=ToolError.PARSE,
                          error_message=f"invalid JSON in the {CALL_OPEN} block: {message}")]


def _split_blocks(rest: str) -> tuple[list[tuple[str, bool]], str]:
  """([(block content, closed)], text outside the blocks) of the text without think."""
  blocks, outside = [], []
  pos = 0
  start = rest.find(CALL_OPEN)
  while start >= 0:
    outside.append(rest[pos:start])
    body = start + len(CALL_OPEN)
    next_open = rest.find(CALL_OPEN, body)
    limit = len(rest) if next_open < 0 else next_open
    close = rest.find(CALL_CLOSE, body, limit)
    if close >= 0:
      blocks.append((rest[body:close], True))
      pos = close + len(CALL_CLOSE)
    else:
      blocks.append((rest[body:limit], False))
      pos = limit
    outside.append(_GAP)
    start = next_open
  outside.append(rest[pos:])
  return blocks, "".join(outside)


def parse_step(text: str) -> ParsedStep:
  """Parses one assistant step; never raises.

  Args:
    text: the exact text the model produced for this step.

  Returns:
    The ParsedStep: think, every call in order (failed ones carry an error
    kind and a message for the model), the rubric flags and the answer.
  """
  think_block = _first_block(text, THINK_OPEN, THINK_CLOSE)
  if think_block is None:
    think, rest = None, text
  else:
    start, end, think = think_block
    rest = text[:start] + _GAP + text[end:]

  blocks, outside = _split_blocks(rest)
  calls: list[ToolCall] = []
  json_ok = bool(blocks)
  for block, closed in blocks:
    parsed, block_calls = _parse_block(block, closed)
    json_ok = json_ok and parsed
    calls.extend(block_calls)
  fields_ok = json_ok and all(c.error is None for c in calls)

  answer_block = _first_block(outside, ANSWER_OPEN, ANSWER_CLOSE)
  answer = (answer_block[2] if answer_block is not None else outside).strip()
  return ParsedStep(text=text, think=think, num_tool_call_blocks=len(blocks),
                    calls=tuple(calls), json_ok=json_ok, fields_ok=fields_ok,
                    answer=answer)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """One well-formed <tool_call> block, as families write oracle steps.

  Args:
    name: the tool name.
    arguments: JSON-serialisable keyword arguments.

  Returns:
    "<tool_call>\\n{json}\\n</tool_call>", the JSON without ASCII escaping.
  """
  payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
  return f"{CALL_OPEN}\n{payload}\n{CALL_CLOSE}"
