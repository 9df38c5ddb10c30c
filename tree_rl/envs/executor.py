"""Runs parsed tool calls: argument validation, parallel execution, timeouts, error messages.

The executor is the only place where model-chosen actions touch Python code, so
it contains every failure: a call that did not parse, an unknown tool, a schema
violation, an exception, a hang, or a return value that cannot be shown to the
model all become a failed `ToolResult` whose content names the problem
("Error [kind]: ..."), and `execute` returns normally.

Calls of one step run in parallel, one daemon thread per call (at most
`max_workers` at a time). A call that outlives its `Tool.timeout_s` is answered
with a TIMEOUT error and its thread is abandoned: Python cannot kill a thread,
so a hung tool leaks one sleeping daemon thread until it returns, but it never
blocks this step, later calls or later steps. Tools must therefore be
thread-safe and should not hold locks other tools need.

Argument validation is a small JSON-schema subset (see `validate_arguments`).
It is stricter than JSON Schema on purpose: unexpected arguments are rejected
unless the schema says "additionalProperties": true, and 5.0 is not an integer.
In RL a lenient check teaches the policy that sloppy calls work.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tree_rl.envs.base import Message, Tool, ToolCall, ToolError, ToolResult
from tree_rl.envs.base import render_tool_output, tool_error_text

# One tool reply's content -> what the model reads (`base.ToolOutputCap`).
OutputCap = Callable[[str], str]

# JSON-schema type names, with BFCL's Python-flavoured aliases.
_TYPE_ALIASES = {"dict": "object", "float": "number", "list": "array", "tuple": "array"}
_MAX_WAIT_S = 60.0
_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string",
               type(None): "null"}


def _describe(value: Any) -> str:
  """The JSON type and a short JSON rendering of a value, as in 'integer 5' or 'string "abc"'."""
  if isinstance(value, Mapping):
    return "object"
  if isinstance(value, (list, tuple)):
    return "array"
  name = next((n for t, n in _JSON_NAMES.items() if type(value) is t), type(value).__name__)
  try:
    text = json.dumps(value, ensure_ascii=False)
  except (TypeError, ValueError):  # not JSON, or an integer too long to print
    text = f"<{type(value).__name__}>"
  return f"{name} {text[:60] + '...' if len(text) > 60 else text}"


def _has_type(value: Any, name: str) -> bool:
  """Whether `value` is of JSON-schema type `name` (unknown names accept anything)."""
  name = _TYPE_ALIASES.get(name, name)
  if name == "object":
    return isinstance(value, Mapping)
  if name == "string":
    return isinstance(value, str)
  if name == "integer":
    return isinstance(value, int) and not isinstance(value, bool)
  if name == "number":
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if name == "boolean":
    return isinstance(value, bool)
  if name == "array":
    return isinstance(value, (list, tuple))
  if name == "null":
    return value is None
  return True  # "any" (BFCL) or a name we do not know: a schema bug is not the model's fault


def _json_equal(a: Any, b: Any) -> bool:
  """JSON equality: True != 1 (unlike Python), 1 == 1.0, containers elementwise."""
  if isinstance(a, bool) or isinstance(b, bool):
    return type(a) is type(b) and a == b
  if isinstance(a, Mapping) and isinstance(b, Mapping):
    return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
  return a == b


def _check(schema: Mapping[str, Any], value: Any, path: str) -> str | None:
  """The first violation of `schema` by `value` at `path`, or None."""
  types = schema.get("type")
  if isinstance(types, str):
    types = [types]
  if isinstance(types, list) and types and not any(_has_type(value, t) for t in types):
    expected = " or ".join(_TYPE_ALIASES.get(t, t) for t in types)
    return f"argument '{path}' must be {expected}, got {_describe(value)}"
  if isinstance(value, float) and not math.isfinite(value):
    return f"argument '{path}' must be a finite number, got {value}"
  if "enum" in schema and not any(_json_equal(value, e) for e in schema["enum"]):
    options = ", ".join(json.dumps(e, ensure_ascii=False) for e in schema["enum"])
    return f"argument '{path}' must be one of {options}; got {_describe(value)}"
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    bounds = (("minimum", ">=", value < schema.get("minimum", -math.inf)),
              ("exclusiveMinimum", ">", value <= schema.get("exclusiveMinimum", -math.inf)),
              ("maximum", "<=", value > schema.get("maximum", math.inf)),
              ("exclusiveMaximum", "<", value >= schema.get("exclusiveMaximum", math.inf)))
    for key, op, violated in bounds:
      if key in schema and violated:
        return f"argument '{path}' must be {op} {schema[key]}, got {value}"
  if isinstance(value, Mapping):
    return _check_object(schema, value, path)
  items = schema.get("items")
  if isinstance(value, (list, tuple)) and items is not None:
    for i, element in enumerate(value):
      item_schema = items[i] if isinstance(items, list) and i < len(items) else items
      if isinstance(item_schema, Mapping):
        error = _check(item_schema, element, f"{path}[{i}]")
        if error:
          return error
  return None


def _check_object(schema: Mapping[str, Any], value: Mapping[str, Any], path: str) -> str | None:
  """Required keys, extra keys and per-property schemas of an object value."""
  props = schema.get("properties")
  props = props if isinstance(props, Mapping) else {}
  missing = [k for k in schema.get("required", ()) if k not in value]
  if missing:
    names = ", ".join(f"'{k}'" for k in missing)
    plural = "s" if len(missing) > 1 else ""
    if not path:
      return f"missing required argument{plural} {names}"
    return f"argument '{path}' is missing required key{plural} {names}"
  # Strict by default where the schema lists the keys (and for the arguments
  # themselves); a nested object schema without "properties" is a free-form dict.
  extra_schema = schema.get("additionalProperties", bool(path) and "properties" not in schema)
  for key, element in value.items():
    sub = f"{path}.{key}" if path else str(key)
    if key in props:
      if isinstance(props[key], Mapping):
        error = _check(props[key], element, sub)
        if error:
          return error
    elif isinstance(extra_schema, Mapping):
      error = _check(extra_schema, element, sub)
      if error:
        return error
    elif extra_schema is not True:
      if not path:
        accepted = (f"accepted arguments: {', '.join(props)}" if props
                    else "this tool takes no arguments")
        return f"unexpected argument '{key}'; {accepted}"
      accepted = f"accepted keys: {', '.join(props)}" if props else "it takes no keys"
      return f"argument '{path}' has unexpected key '{key}'; {accepted}"
  return None


def validate_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
  """Checks tool-call arguments against the tool's JSON schema (a strict subset).

  Supported: "type" (object/dict, string, integer, number/float, boolean,
  array/list/tuple, null, or a list of them; "any" and unknown names accept
  anything), "enum", "required", "properties", "items" (one schema, or a list
  for positions), nested objects, "minimum"/"maximum"/"exclusiveMinimum"/
  "exclusiveMaximum" and "additionalProperties". Deliberate strictness (see the
  module docstring): additionalProperties defaults to false for the arguments
  and for every nested object schema that lists "properties" (a nested object
  schema without "properties" is a free-form dict), booleans are neither
  integers nor numbers, 5.0 is not an integer, and NaN/Infinity are rejected
  wherever a schema checks the value.

  Args:
    schema: the tool's "parameters" schema (an object schema).
    arguments: the call's arguments.

  Returns:
    None if they conform, else a message naming the argument and the rule.
  """
  if not schema.get("type") and "properties" not in schema:
    schema = {**schema, "type": "object"}
  return _check(schema, arguments, "")


def tool_message(result: ToolResult) -> Message:
  """The OpenAI-style tool message of one result."""
  return {"role": "tool", "name": result.name or "unknown", "content": result.content}


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
  """`text` with every lone surrogate replaced by U+FFFD.

  JSON may escape half of a surrogate pair ("\\ud800"); `json.loads` then yields a string
  that is not valid Unicode, which a tool or an error message can echo back, and which no
  tokenizer can encode (the rollout's glue and the reply cap would raise). Valid pairs
  were already joined into one character by the JSON decoder.
  """
  return _LONE_SURROGATE.sub("\ufffd", text)


def _failure(name: str | None, kind: ToolError, message: str, seconds: float = 0.0) -> ToolResult:
  return ToolResult(name=name, content=tool_error_text(kind, message), ok=False, error=kind,
                    seconds=float(seconds))


def _exception_text(e: BaseException) -> str:
  try:
    text = str(e)
  except Exception:  # a broken __str__ must not break the executor
    text = "<unprintable>"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _run_tool(fn: Any, arguments: dict[str, Any], slot: list[Any], index: int,
              done: queue.SimpleQueue) -> None:
  """Thread body: calls the tool, renders its value, puts (kind, payload, end time) in `slot`."""
  try:
    value = fn(**arguments)
    try:
      outcome = ("ok", render_tool_output(value))
    except BaseException as e:  # noqa: BLE001 (TypeError, circular reference, recursion)
      outcome = ("bad_value", e)
  except BaseException as e:  # noqa: BLE001 (everything a tool raises, re-checked in _finish)
    outcome = ("raised", e)
  slot.append((*outcome, time.monotonic()))
  done.put(index)


class ToolExecutor:
  """Executes the calls of one step against a fixed set of tools."""

  def __init__(self, tools: Sequence[Tool], max_workers: int = 8,
               output_cap: OutputCap | None = None):
    """Args:
      tools: the tools offered; names must be unique.
      max_workers: most calls of one step running at the same time.
      output_cap: applied to every result's content, errors included (a huge
        argument echoed in an error is as long as a huge reply); None: no cap.
    """
    if max_workers < 1:
      raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    self.tools = {t.name: t for t in tools}
    if len(self.tools) != len(tools):
      names = [t.name for t in tools]
      raise ValueError(f"duplicate tool names: {sorted({n for n in names if names.count(n) > 1})}")
    for t in tools:
      if not t.timeout_s > 0:  # also rejects NaN; math.inf means no limit
        raise ValueError(f"tool '{t.name}' has timeout_s {t.timeout_s}; it must be > 0")
    self.max_workers = max_workers
    self.output_cap = output_cap

  def _prepare(self, call: ToolCall) -> ToolResult | Tool:
    """The tool to run, or the failed result that answers the call without running it."""
    if call.error is not None:
      return _failure(call.name, call.error, call.error_message or "malformed tool call")
    if call.name is None or call.arguments is None:
      return _failure(call.name, ToolError.FORMAT,
                      'a tool call needs a string "name" and an object "arguments"')
    tool = self.tools.get(call.name)
    if tool is None:
      available = ", ".join(self.tools) or "none"
      return _failure(call.name, ToolError.UNKNOWN_TOOL,
                      f"unknown tool '{call.name}'; available tools: {available}")
    try:
      error = validate_arguments(tool.parameters, call.arguments)
    except Exception as e:  # noqa: BLE001 (a malformed schema, or absurdly deep arguments)
      error = f"the arguments could not be checked ({_exception_text(e)})"
    if error:
      return _failure(call.name, ToolError.INVALID_ARGUMENTS, error)
    return tool

  def execute(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
    """Runs the calls of one step in parallel; never raises for a tool's failure.

    Args:
      calls: the step's calls, as parsed (failed ones are answered, not run).

    Returns:
      One ToolResult per call, in the same order, its content made valid Unicode (see
      `_valid_unicode`) and cut by `output_cap`. `seconds` is each call's wall time (its
      timeout for a hung call).

    Raises:
      KeyboardInterrupt, SystemExit: when a tool raises one of them, as the
        request to stop the process is not the model's failure to answer.
    """
    results: list[ToolResult | None] = [None] * len(calls)
    pending: collections.deque[tuple[int, Tool]] = collections.deque()
    for i, call in enumerate(calls):
      prepared = self._prepare(call)
      if isinstance(prepared, ToolResult):
        results[i] = prepared
      else:
        pending.append((i, prepared))

    done: queue.SimpleQueue = queue.SimpleQueue()  # local: abandoned threads report here, unread
    slots: dict[int, list[Any]] = {}
    running: dict[int, tuple[Tool, float]] = {}  # index -> (tool, start time)
    while pending or running:
      while pending and len(running) < self.max_workers:
        i, tool = pending.popleft()
        slots[i] = []
        thread = threading.Thread(target=_run_tool, name=f"tool-{tool.name}", daemon=True,
                                  args=(tool.fn, dict(calls[i].arguments), slots[i], i, done))
        try:
          running[i] = (tool, time.monotonic())
          thread.start()
        except RuntimeError as e:  # no thread left, e.g. after many abandoned hung calls
          del running[i]
          results[i] = _failure(tool.name, ToolError.EXCEPTION,
                                f"'{tool.name}' could not be started ({_exception_text(e)})")
      if not running:
        continue
      deadline = min(start + tool.timeout_s for tool, start in running.values())
      # Capped so that math.inf (no limit) stays a valid wait; the loop just waits again.
      wait = min(max(0.0, deadline - time.monotonic()), _MAX_WAIT_S)
      try:
        done.get(timeout=wait)  # a wake-up only: the outcome itself is in the slot
      except queue.Empty:
        pass
      now = time.monotonic()
      for i, (tool, start) in list(running.items()):
        if slots[i]:
          kind, payload, end = slots[i][0]
          results[i] = self._finish(tool, kind, payload, end - start)
          del running[i]
        elif now - start >= tool.timeout_s:
          results[i] = _failure(tool.name, ToolError.TIMEOUT,
                                f"'{tool.name}' did not return within {tool.timeout_s:g} s",
                                now - start)
          del running[i]  # abandoned: the daemon thread may run on, nobody waits for it
    out = [dataclasses.replace(r, content=_valid_unicode(r.content)) for r in results
           if r is not None]
    if self.output_cap is None:
      return out
    return [dataclasses.replace(r, content=self.output_cap(r.content)) for r in out]

  def _finish(self, tool: Tool, kind: str, payload: Any, seconds: float) -> ToolResult:
    """The ToolResult of a call that returned or raised."""
    if kind == "ok":
      return ToolResult(name=tool.name, content=payload, ok=True, error=None, seconds=seconds)
    if kind == "raised" and isinstance(payload, (KeyboardInterrupt, SystemExit)):
      raise payload
    if kind == "bad_value":
      message = f"'{tool.name}' returned a value that cannot be shown as JSON " \
                f"({_exception_text(payload)})"
    else:
      message = f"'{tool.name}' raised {_exception_text(payload)}"
    return _failure(tool.name, ToolError.EXCEPTION, message, seconds)
