"""Tests of argument validation and `ToolExecutor`: every failure kind, timeouts, parallelism."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest

from tree_rl.envs.base import Tool, ToolCall, ToolError, render_tool_output
from tree_rl.envs import executor as executor_lib
from tree_rl.envs.executor import ToolExecutor, tool_message, validate_arguments
from tree_rl.envs.parsing import parse_step

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "filter": {"type": "dict", "properties": {"min": {"type": "float"}},
                   "required": ["min"]},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city"],
}


def _call(name, **arguments):
  return ToolCall(name=name, arguments=arguments, raw="")


def _tool(name, fn, parameters=None, timeout_s=10.0):
  params = parameters if parameters is not None else {"type": "object", "properties": {},
                                                      "additionalProperties": True}
  return Tool(name=name, description=name, parameters=params, fn=fn, timeout_s=timeout_s)


# ---------------------------------------------------------------- validate_arguments


@pytest.mark.parametrize("arguments, fragment", [
    ({}, "missing required argument 'city'"),
    ({"city": 3}, "argument 'city' must be string, got integer 3"),
    ({"city": "P", "days": True}, "argument 'days' must be integer, got boolean true"),
    ({"city": "P", "days": 2.0}, "argument 'days' must be integer, got number 2.0"),
    ({"city": "P", "days": 0}, "argument 'days' must be >= 1, got 0"),
    ({"city": "P", "days": 8}, "argument 'days' must be <= 7, got 8"),
    ({"city": "P", "unit": "kelvin"}, "argument 'unit' must be one of \"celsius\", \"fahrenheit\""),
    ({"city": "P", "hours": [1, "2"]}, "argument 'hours[1]' must be integer, got string \"2\""),
    ({"city": "P", "filter": {}}, "argument 'filter' is missing required key 'min'"),
    ({"city": "P", "filter": {"min": False}}, "argument 'filter.min' must be number"),
    ({"city": "P", "filter": {"min": float("nan")}}, "must be a finite number"),
    ({"city": "P", "filter": {"min": 1, "max": 2}}, "argument 'filter' has unexpected key 'max'"),
    ({"city": "P", "note": 1}, "argument 'note' must be string or null"),
    ({"city": "P", "country": "FR"},
     "unexpected argument 'country'; accepted arguments: city, days, unit, hours, filter, note"),
])
def test_validate_arguments_rejects(arguments, fragment):
  error = validate_arguments(WEATHER, arguments)
  assert error is not None and fragment in error, error


def test_validate_arguments_accepts():
  ok = {"city": "P", "days": 7, "unit": "celsius", "hours": [0, 23],
        "filter": {"min": 1}, "note": None}
  assert validate_arguments(WEATHER, ok) is None
  assert validate_arguments(WEATHER, {**ok, "filter": {"min": 0.5}, "note": "x"}) is None
  assert validate_arguments({"type": "object", "properties": {}}, {}) is None
  assert "takes no arguments" in validate_arguments({"type": "object"}, {"x": 1})
  lenient = {**WEATHER, "additionalProperties": True}
  assert validate_arguments(lenient, {"city": "P", "country": "FR"}) is None
  # JSON equality in enums: True is not 1.
  assert validate_arguments({"properties": {"x": {"enum": [1]}}}, {"x": True}) is not None
  assert validate_arguments({"properties": {"x": {"type": "tuple"}}}, {"x": [1]}) is None
  # A nested object schema without "properties" is a free-form dict.
  free = {"type": "object", "properties": {"opts": {"type": "dict"}}}
  assert validate_arguments(free, {"opts": {"anything": [1]}}) is None
  assert "'opts' must be object" in validate_arguments(free, {"opts": []})


# ---------------------------------------------------------------- ToolExecutor


def _weather(city, days=1, unit="celsius", hours=(), filter=None, note=None):  # noqa: A002
  if city == "Atlantis":
    raise ValueError("no such city: Atlantis")
  return {"city": city, "temp": 21, "days": days}


def test_success_failure_kinds_and_order():
  def bad_value():
    return {1, 2}

  def exit_like():
    raise GeneratorExit("closing")  # a BaseException that is not a stop request

  executor = ToolExecutor([_tool("weather", _weather, WEATHER), _tool("bad", bad_value),
                           _tool("gen", exit_like)])
  parsed = parse_step("<think>x</think><tool_call>{oops</tool_call>")
  calls = [_call("weather", city="Paris", days=2), _call("nope"),
           _call("weather", city="Paris", days="2"), _call("weather", city="Atlantis"),
           _call("bad"), parsed.calls[0], _call("gen")]
  results = executor.execute(calls)
  assert [r.error for r in results] == [
      None, ToolError.UNKNOWN_TOOL, ToolError.INVALID_ARGUMENTS, ToolError.EXCEPTION,
      ToolError.EXCEPTION, ToolError.PARSE, ToolError.EXCEPTION]
  assert results[0].ok and results[0].content == render_tool_output(_weather("Paris", 2))
  assert results[0].name == "weather" and results[0].seconds >= 0.0
  assert all(not r.ok and r.content.startswith(f"Error [{r.error.value}]: ") for r in results[1:])
  assert "available tools: weather, bad, gen" in results[1].content
  assert "'days' must be integer" in results[2].content
  assert "ValueError: no such city: Atlantis" in results[3].content
  assert "Traceback" not in results[3].content
  assert "cannot be shown as JSON" in results[4].content and "TypeError" in results[4].content
  assert results[5].content == f"Error [parse]: {parsed.calls[0].error_message}"
  assert "GeneratorExit" in results[6].content
  assert tool_message(results[0]) == {"role": "tool", "name": "weather",
                                      "content": results[0].content}
  assert tool_message(results[5])["name"] == "unknown"


def test_string_values_are_passed_through():
  executor = ToolExecutor([_tool("echo", lambda text: text)])
  (result,) = executor.execute([_call("echo", text="plain text")])
  assert result.ok and result.content == "plain text"
  assert executor.execute([]) == []


def test_timeout_does_not_block():
  def hang():
    time.sleep(30)

  executor = ToolExecutor([_tool("hang", hang, timeout_s=0.2), _tool("fast", lambda: "ok")])
  start = time.monotonic()
  results = executor.execute([_call("hang"), _call("fast")])
  elapsed = time.monotonic() - start
  assert elapsed < 2.0
  assert results[0].error == ToolError.TIMEOUT and not results[0].ok
  assert results[0].content.startswith("Error [timeout]: ") and results[0].seconds >= 0.19
  assert results[1].ok and results[1].content == "ok"
  # The abandoned thread does not starve a later step, even with one worker.
  single = ToolExecutor([_tool("hang", hang, timeout_s=0.1), _tool("fast", lambda: "ok")],
                        max_workers=1)
  start = time.monotonic()
  results = single.execute([_call("hang"), _call("hang"), _call("fast")])
  assert [r.error for r in results] == [ToolError.TIMEOUT, ToolError.TIMEOUT, None]
  assert time.monotonic() - start < 2.0


def test_calls_of_a_step_run_in_parallel():
  def nap(i):
    time.sleep(0.3)
    return i

  executor = ToolExecutor([_tool("nap", nap)])
  start = time.monotonic()
  results = executor.execute([_call("nap", i=i) for i in range(4)])
  elapsed = time.monotonic() - start
  assert [r.content for r in results] == ["0", "1", "2", "3"]
  assert elapsed < 0.9, elapsed
  assert all(0.25 < r.seconds < 0.9 for r in results)


def test_stop_requests_propagate_and_config_is_checked():
  def stop():
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    ToolExecutor([_tool("stop", stop)]).execute([_call("stop")])
  with pytest.raises(ValueError, match="duplicate"):
    ToolExecutor([_tool("a", print), _tool("a", print)])
  with pytest.raises(ValueError, match="max_workers"):
    ToolExecutor([], max_workers=0)


def test_unprintable_exception_and_infinite_timeout():
  class Weird(Exception):
    def __str__(self):
      raise RuntimeError("no")

  def weird():
    raise Weird

  executor = ToolExecutor([_tool("weird", weird, timeout_s=math.inf),
                           _tool("nan", lambda: float("nan"))])
  weird_result, nan_result = executor.execute([_call("weird"), _call("nan")])
  assert weird_result.error == ToolError.EXCEPTION
  assert "Weird: <unprintable>" in weird_result.content
  assert nan_result.ok and nan_result.content == render_tool_output(float("nan"))
  with pytest.raises(ValueError, match="timeout_s"):
    ToolExecutor([_tool("t", print, timeout_s=0.0)])
  with pytest.raises(SystemExit):
    ToolExecutor([_tool("exit", lambda: sys.exit(3))]).execute([_call("exit")])


def test_thread_start_failure_is_contained(monkeypatch):
  class NoThread(threading.Thread):
    def start(self):
      raise RuntimeError("can't start new thread")

  monkeypatch.setattr(executor_lib.threading, "Thread", NoThread)
  (result,) = ToolExecutor([_tool("fast", lambda: "ok")]).execute([_call("fast")])
  assert result.error == ToolError.EXCEPTION and "could not be started" in result.content
