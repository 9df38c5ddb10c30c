"""Environments: tools, task families and the python sandbox.

`base.py` is the contract (Tool, Task, Outcome, TaskFamily); `parsing` and
`executor` turn a model step into tool results; the families are

  toolworld   PORTool's 17 tools over a seeded offline world (`toolworld/`)
  math        reasoning-gym problems with a calculator and a python sandbox
  bfcl        single-step function calling in the BFCL format (AWPO's setting)
  search_qa   multi-hop questions over a generated corpus with BM25 search

`make_family(name, **kwargs)` builds one by name (configs use it); a family's
module is imported only when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from tree_rl.envs.base import (Message, Outcome, ParsedStep, Task, TaskFamily, Tool, ToolCall,
                               ToolError, ToolResult)

# name -> (module, class)
FAMILIES = {
    "toolworld": ("tree_rl.envs.toolworld", "ToolWorldFamily"),
    "math": ("tree_rl.envs.math_family", "MathFamily"),
    "bfcl": ("tree_rl.envs.bfcl", "BFCLFamily"),
    "search_qa": ("tree_rl.envs.search_qa", "SearchQAFamily"),
}


def make_family(name: str, **kwargs: Any) -> Any:
  """The task family `name` built with `kwargs`; unknown names list the valid ones."""
  if name not in FAMILIES:
    raise ValueError(f"unknown task family {name!r}; valid: {sorted(FAMILIES)}")
  module, cls = FAMILIES[name]
  return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["FAMILIES", "Message", "Outcome", "ParsedStep", "Task", "TaskFamily", "Tool",
           "ToolCall", "ToolError", "ToolResult", "make_family"]
