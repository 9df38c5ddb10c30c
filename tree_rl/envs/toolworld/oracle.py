"""Shared machinery of the query templates: the oracle recorder and typed answers.

A template draws its parameters, then *solves* its own question by calling the
real tools through a `Solver`, which records the oracle episode exactly as the
executor would show it (assistant steps with `<tool_call>` blocks, then one
tool message per call). Ground truths are read from those tool outputs, so an
oracle replay can never disagree with its answer. A template that draws
parameters it cannot use (a weekend for a stock question, a tie for "which is
warmest") raises `Infeasible` and the generator draws again.

Typed answers are small JSON dicts the verifier (`verify.py`) understands:
{"type": "number", "value": x, "abs": bool, "rel_tol": r}, {"type": "string", "value": s,
"options": [...]}, {"type": "yes_no", "value": "yes"}, {"type": "date", ...},
{"type": "time", "value": "HH:MM"}, {"type": "list", "value": [...],
"ordered": bool} and {"type": "all", "value": [answer, ...]}.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tree_rl.envs.base import Message, Tool, render_tool_output
from tree_rl.envs.parsing import format_tool_call
from tree_rl.envs.toolworld.timeutil import MONTHS, Context
from tree_rl.envs.toolworld.world import City, World

Call = tuple[str, dict[str, Any]]


class Infeasible(Exception):
  """The drawn parameters do not make a well-posed question; draw again."""


@dataclasses.dataclass(frozen=True)
class Query:
  """One generated question with its typed ground truth and oracle episode(s).

  Attributes:
    template: the template's name.
    difficulty: information-gathering steps of the oracle (the final
      response_gen step is not counted).
    question: the user's question.
    answer: the typed ground truth (see the module docstring).
    oracle: assistant/tool messages of the oracle episode.
    alternatives: other valid oracle episodes (another tool route).
  """
  template: str
  difficulty: int
  question: str
  answer: dict[str, Any]
  oracle: tuple[Message, ...]
  alternatives: tuple[tuple[Message, ...], ...] = ()


class Solver:
  """Runs oracle steps with the real tools and records the messages."""

  def __init__(self, tools: Mapping[str, Tool]):
    self.tools = tools
    self.messages: list[Message] = []
    self.steps = 0

  def step(self, think: str, *calls: Call) -> list[Any]:
    """One assistant step with these (parallel) calls; returns the tools' values.

    A tool error here means the template drew a bad case; it surfaces as
    `Infeasible` so the generator draws again instead of recording a failed step.
    """
    try:
      values = [self.tools[name].fn(**args) for name, args in calls]
    except ValueError as e:
      raise Infeasible(str(e)) from e
    blocks = "\n".join(format_tool_call(name, args) for name, args in calls)
    self.messages.append({"role": "assistant", "content": f"<think>{think}</think>\n{blocks}"})
    for (name, _), value in zip(calls, values):
      self.messages.append({"role": "tool", "name": name, "content": render_tool_output(value)})
    self.steps += 1
    return values

  def finish(self, answer: str) -> tuple[Message, ...]:
    """The final response_gen step; returns the whole oracle episode."""
    self.step("I have everything I need to answer.", ("response_gen", {"answer": answer}))
    self.steps -= 1  # the answer step is not an information-gathering step
    return tuple(self.messages)


@dataclasses.dataclass
class Gen:
  """What a template draws from: the rng, the world, the task's present and its tools."""
  rng: random.Random
  world: World
  context: Context
  tools: Mapping[str, Tool]

  @property
  def today(self) -> dt.date:
    return self.context.now.date()

  def day(self, offset: int) -> dt.date:
    return self.today + dt.timedelta(days=offset)

  @property
  def home(self) -> City:
    return self.world.cities[self.context.city]

  def solver(self) -> Solver:
    return Solver(self.tools)

  def pick(self, options: Sequence[Any]) -> Any:
    return options[self.rng.randrange(len(options))]

  def sample(self, options: Sequence[Any], k: int) -> list[Any]:
    return self.rng.sample(list(options), k)

  def cities(self, *, exclude: Sequence[str] = (), region: str | None = None) -> list[str]:
    """Sorted city names, optionally of one region, without `exclude`."""
    return [c.name for c in sorted(self.world.cities.values(), key=lambda c: c.name)
            if c.name not in exclude and (region is None
                                          or self.world.countries[c.country].region == region)]


def require(condition: bool, why: str) -> None:
  """Raises Infeasible(why) unless `condition`."""
  if not condition:
    raise Infeasible(why)


def spoken(day: dt.date) -> str:
  """"June 14, 2025": how a user writes a date."""
  return f"{MONTHS[day.month - 1]} {day.day}, {day.year}"


def number(value: float | int, *, absolute: bool = False, rel_tol: float = 1e-2
           ) -> dict[str, Any]:
  """A numeric answer; `absolute` ignores the sign, rel_tol=0 for counts (days, ages)."""
  return {"type": "number", "value": value, "abs": absolute, "rel_tol": rel_tol}


def string(value: str, options: Sequence[str] = ()) -> dict[str, Any]:
  """A string answer; with `options`, the first option the answer names must be `value`."""
  return {"type": "string", "value": value, "options": list(options)}


def yes_no(value: bool) -> dict[str, Any]:
  return {"type": "yes_no", "value": "yes" if value else "no"}


def date_answer(day: str) -> dict[str, Any]:
  return {"type": "date", "value": day}


def time_answer(hhmm: str) -> dict[str, Any]:
  return {"type": "time", "value": hhmm}


def all_of(*answers: dict[str, Any]) -> dict[str, Any]:
  return {"type": "all", "value": list(answers)}


TemplateFn = Callable[[Gen], Query]
TEMPLATES: dict[str, tuple[int, TemplateFn]] = {}


def template(name: str, difficulty: int) -> Callable[[Callable[..., Any]], TemplateFn]:
  """Registers a template that returns (question, answer, solver[, alternative solvers]).

  The wrapper checks that every oracle route took exactly `difficulty` steps.
  """

  def register(fn: Callable[..., Any]) -> TemplateFn:
    def build(gen: Gen) -> Query:
      question, answer, solver, *alternatives = fn(gen)
      for s in (solver, *alternatives):
        if s.steps != difficulty:
          raise AssertionError(f"template {name} took {s.steps} steps, declared {difficulty}")
      return Query(name, difficulty, question, answer, tuple(solver.messages),
                   tuple(tuple(s.messages) for s in alternatives))

    TEMPLATES[name] = (difficulty, build)
    return build

  return register
