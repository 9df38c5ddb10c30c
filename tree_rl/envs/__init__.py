"""Environments: tools, task families and the python sandbox.

`base.py` is the contract (Tool, Task, Outcome, TaskFamily); `parsing` and
`executor` turn a model step into tool results; the families are

  toolworld   PORTool's 17 tools over a seeded offline world (`toolworld/`)
  math        reasoning-gym problems with a calculator and a python sandbox
  bfcl        single-step function calling in the BFCL format (AWPO's setting)
  search_qa   multi-hop questions over a generated corpus with BM25 search

`make_family(name, **kwargs)` builds one by name (configs use it); a family's
module is imported only when it is asked for. Every family also takes `tool_latency_s`
(`task.kwargs.tool_latency_s` in a config): each of its tool calls then waits that long
before it runs, as a call to a search API or a remote sandbox would (`LatencyFamily`),
and `max_tool_output_tokens` (default 512): every tool reply is cut to that many tokens of
the policy's tokenizer, ending with a "[truncated: N more characters]" marker, in the
rollout and in evaluation alike (`base.ToolOutputCap`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tree_rl.envs.base import (DEFAULT_MAX_TOOL_OUTPUT_TOKENS, Message, Outcome, ParsedStep,
                               Task, TaskFamily, Tool, ToolCall, ToolError, ToolOutputCap,
                               ToolResult, check_max_tool_output_tokens)

# name -> (module, class)
FAMILIES = {
    "toolworld": ("tree_rl.envs.toolworld", "ToolWorldFamily"),
    "math": ("tree_rl.envs.math_family", "MathFamily"),
    "bfcl": ("tree_rl.envs.bfcl", "BFCLFamily"),
    "search_qa": ("tree_rl.envs.search_qa", "SearchQAFamily"),
}


def _delayed(fn: Any, seconds: float) -> Any:
  """`fn` after a `seconds` sleep (which releases the GIL, so concurrent calls overlap)."""

  def call(**arguments: Any) -> Any:
    time.sleep(seconds)
    return fn(**arguments)

  return call


class LatencyFamily:
  """A task family whose every tool call first waits `latency_s` seconds.

  Real agent tools are remote (a search API, a sandbox service): most of a call's wall
  time is spent waiting, not computing. This wrapper simulates that for any family, so a
  benchmark or a test can see how a rollout overlaps tool waits (the tool thread pool of
  the agent loop, several rollout workers, rollouts overlapping updates). The wait is
  added to each tool's `timeout_s`: the latency is the transport's, the timeout still
  bounds the tool's own work. Everything else (tasks, verifier, turn limit and the
  family's own attributes) is the wrapped family's.
  """

  def __init__(self, family: Any, latency_s: float):
    self.family, self.latency_s = family, latency_s

  @property
  def name(self) -> str:
    return self.family.name

  @property
  def max_turns(self) -> int:
    return self.family.max_turns

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    return self.family.generate(split, num_tasks, seed)

  def tools(self, task: Task) -> list[Tool]:
    """The wrapped family's tools of `task`, each call delayed by `latency_s`."""
    return [dataclasses.replace(t, fn=_delayed(t.fn, self.latency_s),
                                timeout_s=t.timeout_s + self.latency_s)
            for t in self.family.tools(task)]

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    return self.family.score(task, episode, truncated)

  def __getattr__(self, attr: str) -> Any:  # the family's own extras (its world, options)
    if attr == "family":  # not set yet (e.g. while unpickling): no recursion
      raise AttributeError(attr)
    return getattr(self.family, attr)


def check_family_options(tool_latency_s: Any = 0.0,
                         max_tool_output_tokens: Any = DEFAULT_MAX_TOOL_OUTPUT_TOKENS) -> None:
  """Fails, naming the config field, on a bad value of an option every family takes."""
  if isinstance(tool_latency_s, bool) or not isinstance(tool_latency_s, (int, float)) or \
      not math.isfinite(tool_latency_s) or tool_latency_s < 0:
    raise ValueError(f"tool_latency_s={tool_latency_s!r} (task.kwargs.tool_latency_s) must "
                     f"be a finite number of seconds >= 0")
  check_max_tool_output_tokens(max_tool_output_tokens,
                               "max_tool_output_tokens (task.kwargs.max_tool_output_tokens)")


def check_family_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
  """Fails naming each option of `kwargs` (config.task.kwargs) that family `name` does not
  take, read from its constructor's signature without building it (a family may load data)."""
  module, cls = FAMILIES[name]
  params = inspect.signature(getattr(importlib.import_module(module), cls)).parameters
  if any(p.kind == p.VAR_KEYWORD for p in params.values()):
    return
  valid = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  valid |= {"tool_latency_s", "max_tool_output_tokens"}  # every family's (`make_family`)
  unknown = sorted(set(kwargs) - valid)
  if unknown:
    raise ValueError(f"config.task.kwargs: unknown option(s) {unknown} for task family "
                     f"{name!r}; valid: {sorted(valid)}")


def make_family(name: str, tool_latency_s: Any = 0.0,
                max_tool_output_tokens: Any = DEFAULT_MAX_TOOL_OUTPUT_TOKENS, **kwargs: Any) -> Any:
  """The task family `name` built with `kwargs`; unknown names list the valid ones.

  Args:
    name: a key of FAMILIES.
    tool_latency_s: seconds every tool call waits before it runs (a number >= 0; 0: none;
      typed Any as it comes from a config and is checked here); see `LatencyFamily`.
    max_tool_output_tokens: the most tokens of one tool reply the model reads (an int >= 32;
      `task.kwargs.max_tool_output_tokens`); set as the family's attribute of that name.
    **kwargs: the family's own options.
  """
  if name not in FAMILIES:
    raise ValueError(f"unknown task family {name!r}; valid: {sorted(FAMILIES)}")
  check_family_options(tool_latency_s, max_tool_output_tokens)
  module, cls = FAMILIES[name]
  family = getattr(importlib.import_module(module), cls)(**kwargs)
  family.max_tool_output_tokens = max_tool_output_tokens
  return LatencyFamily(family, float(tool_latency_s)) if tool_latency_s > 0 else family


__all__ = ["FAMILIES", "LatencyFamily", "check_family_options", "Message", "Outcome", "ParsedStep", "Task", "TaskFamily",
           "Tool", "ToolCall", "ToolError", "ToolOutputCap", "ToolResult", "make_family"]
