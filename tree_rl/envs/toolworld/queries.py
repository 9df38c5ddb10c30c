"""The query generator: a task's present, a template of the wanted difficulty, a split.

Each draw samples a "now" (a local date and time in 2025-01-20..2026-11-30, so
that yesterday, tomorrow and two-week forecasts stay inside the world's data)
and the user's city, then a template of the requested difficulty, which solves
itself (see `oracle.py`). Splits are assigned by a hash of the question text,
so train and eval never share a question text, whatever the seeds: a draw
whose text hashes to the other split is discarded.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random

from tree_rl.envs.toolworld import templates_basic, templates_multi  # noqa: F401 (registers)
from tree_rl.envs.toolworld.oracle import TEMPLATES, Gen, Infeasible, Query
from tree_rl.envs.toolworld.timeutil import Context
from tree_rl.envs.toolworld.tools import make_tools
from tree_rl.envs.toolworld.world import World

CONTEXT_FIRST_DAY = dt.date(2025, 1, 20)
CONTEXT_LAST_DAY = dt.date(2026, 11, 30)
EVAL_BUCKETS = 5  # one question text in five belongs to eval
SPLITS = ("train", "eval")


def split_of(question: str) -> str:
  """The split a question text belongs to (a stable hash, independent of any seed)."""
  digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
  return "eval" if int.from_bytes(digest, "big") % EVAL_BUCKETS == 0 else "train"


def templates_of(difficulty: int) -> list[str]:
  """Names of the registered templates of one difficulty, sorted."""
  return sorted(name for name, (d, _) in TEMPLATES.items() if d == difficulty)


def sample_context(rng: random.Random, world: World) -> Context:
  """A uniformly drawn present: day, time of day (07:00-22:55) and the user's city."""
  span = (CONTEXT_LAST_DAY - CONTEXT_FIRST_DAY).days + 1
  day = CONTEXT_FIRST_DAY + dt.timedelta(days=rng.randrange(span))
  minute = rng.randrange(7 * 60, 23 * 60, 5)
  return Context(dt.datetime.combine(day, dt.time(minute // 60, minute % 60)),
                 rng.choice(sorted(world.cities)))


def draw_query(world: World, rng: random.Random, difficulty: int, split: str,
               max_draws: int = 1000) -> tuple[Context, Query]:
  """One query of `difficulty` whose question text belongs to `split`.

  Args:
    world: the world the tools read.
    rng: the only source of randomness.
    difficulty: oracle steps before the answer (1 to 5).
    split: "train" or "eval".
    max_draws: draws before giving up (a template that cannot be satisfied).

  Returns:
    The task's present and the query.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  names = templates_of(difficulty)
  if not names:
    raise ValueError(f"no template of difficulty {difficulty}")
  for _ in range(max_draws):
    context = sample_context(rng, world)
    name = rng.choice(names)
    tools = {t.name: t for t in make_tools(world, context)}
    try:
      query = TEMPLATES[name][1](Gen(rng, world, context, tools))
    except Infeasible:
      continue
    if split_of(query.question) == split:
      return context, query
  raise RuntimeError(f"no {split} query of difficulty {difficulty} in {max_draws} draws")
