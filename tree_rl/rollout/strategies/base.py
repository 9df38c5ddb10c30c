"""The BranchingStrategy protocol and the registry of strategies by name.

A strategy decides how one `AgentLoop.rollout` call grows its trees: how many
episodes start at each prompt, when and where they fork (between turns, or at a
token position inside a step) and when growth stops. It only drives a
`tree_rl.rollout.branching.Forest` (start / step / fork / branch_at / run);
the Forest owns the engine calls, the tools and the tree bookkeeping, so every
strategy gets the same endings, tags and `check()`-clean trees.

Strategies register under the name a config uses (`make_strategy("portool",
fork_factor=3)`); an unknown name fails with the list of valid ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from tree_rl.rollout.branching import Forest


@runtime_checkable
class BranchingStrategy(Protocol):
  """How the trees of one rollout call grow.

  Attributes:
    name: the registry name.
  """

  name: str

  def grow(self, forest: Forest) -> None:
    """Grows every tree of `forest`; every branch started must end (or be discarded)."""
    ...

  def leaves_per_task(self) -> int | None:
    """Leaves each tree gets when nothing is dropped (the rollout budget), None if it varies."""
    ...


STRATEGIES: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
  """Class decorator: registers a strategy class under `name` and sets its `name`."""

  def wrap(cls: type) -> type:
    if name in STRATEGIES:
      raise ValueError(f"strategy {name!r} is already registered")
    cls.name = name
    STRATEGIES[name] = cls
    return cls

  return wrap


def make_strategy(name: str, **kwargs: Any) -> BranchingStrategy:
  """The strategy registered as `name`, built with `kwargs` (its documented knobs)."""
  if name not in STRATEGIES:
    raise ValueError(f"unknown branching strategy {name!r}; valid: {sorted(STRATEGIES)}")
  return STRATEGIES[name](**kwargs)
