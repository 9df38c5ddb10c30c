"""`ToolWorldFamily`: PORTool's tool-use setting (arXiv 2510.26020, §4.1, App. C.1) as a
seeded, offline task family (docs/methods/portool.md#tool-world).

Tasks mix time-invariant and time-sensitive questions over a fictional world,
with difficulty 1-5 (information-gathering steps of the oracle; the final
`response_gen` step comes on top, so the default 6-turn limit of the paper fits
the hardest oracle exactly). The outcome reward is PORTool's (§3.2 Step 2) with a
rule-based verifier in place of the GPT-4o judge:

  +1  the `response_gen` answer matches the typed ground truth;
   0  the answer says it is unable to answer;
  -1  any other answer, or a `response_gen` call without a string answer;
  truncated_outcome (default -1, docs/methods/portool.md#truncated-trajectories)
      truncated, or the last step did not call `response_gen` (a free-text
      answer is not a final answer here).

Two options reshape it (docs/methods/appo.md#the-format-gated-reward): `wrong_outcome`
replaces the -1 of a well-formed wrong answer, and `malformed_outcome`, when set, is the
reward of any answered episode with a step whose tool calls did not parse (invalid JSON,
an unclosed block, a call without a string name or object arguments), whatever its
answer. `wrong_outcome=0, malformed_outcome=-1` is the shape of APPO's public reward
script (bad format -1, otherwise the answer's score, 0 when wrong). Only the reward
changes: `correct` and `answered` stay what the answer was.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Sequence

from tree_rl.envs.base import Message, Outcome, Task, Tool, render_tool_prompt
from tree_rl.envs.parsing import parse_step
from tree_rl.envs.toolworld import verify
from tree_rl.envs.toolworld.queries import draw_query
from tree_rl.envs.toolworld.timeutil import Context
from tree_rl.envs.toolworld.tools import TOOL_NAMES, make_tools
from tree_rl.envs.toolworld.world import World

PREAMBLE = """You are a helpful assistant that answers the user's questions with tools.
The tools give real-time and factual information about the user's world; do not rely on your own knowledge for facts, dates, prices or the current time.
get_current_context tells you the current date, time, time zone and the user's location."""
FINISH = ("When you have the answer, call response_gen with it. If the tools cannot provide "
          "the information, call response_gen with an answer that says you are unable to answer.")
_DEDUPE_DRAWS = 20  # redraws for a question+answer already in this batch, before accepting it


class ToolWorldFamily:
  """The tool world's tasks, bound tools and outcome verifier (TaskFamily protocol)."""

  name = "toolworld"

  def __init__(self, seed_world: int = 0, max_turns: int = 6, truncated_outcome: float = -1.0,
               difficulties: Sequence[int] = (1, 2, 3, 4, 5), tools_per_task: int = 0,
               wrong_outcome: float = -1.0, malformed_outcome: float | None = None):
    """Args:
      seed_world: seed of the world every task of this family lives in.
      max_turns: assistant steps per episode (PORTool caps at 6).
      truncated_outcome: reward of a truncated episode or one without response_gen.
      difficulties: the difficulties `generate` cycles through, in order.
      tools_per_task: 0 offers all 17 tools (PORTool's setting, a ~2.3k-token system
        prompt); k > 0 offers the tools of the task's oracle routes, `response_gen`
        and `get_current_context`, plus seeded distractors up to k tools. Small
        models on CPUs train much faster on the shorter prompt.
      wrong_outcome: reward of a well-formed, answered, wrong episode (PORTool: -1).
      malformed_outcome: None (PORTool), or the reward of an answered episode with a step
        whose tool calls did not parse, in place of its answer's reward.
    """
    if tools_per_task < 0:
      raise ValueError(f"tools_per_task={tools_per_task} must be >= 0 (0: all tools)")
    self.tools_per_task = tools_per_task
    if not difficulties or any(d not in (1, 2, 3, 4, 5) for d in difficulties):
      raise ValueError(f"difficulties must be a non-empty subset of 1..5, got {difficulties}")
    if max_turns < max(difficulties) + 1:
      raise ValueError(f"max_turns={max_turns} cannot fit a difficulty-{max(difficulties)} "
                       "oracle plus its response_gen step")
    self.seed_world = seed_world
    self.max_turns = max_turns
    self.truncated_outcome = float(truncated_outcome)
    self.wrong_outcome = float(wrong_outcome)
    self.malformed_outcome = None if malformed_outcome is None else float(malformed_outcome)
    self.difficulties = tuple(difficulties)
    self.world = World.build(seed_world)

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    """`num_tasks` tasks of `split`; difficulty i-th task = difficulties[i % len].

    Deterministic in (seed_world, split, num_tasks, seed). No question text of
    one split ever appears in the other (see `queries.split_of`).
    """
    rng = random.Random(f"toolworld|{self.seed_world}|{split}|{seed}")
    tasks, seen = [], set()
    for i in range(num_tasks):
      difficulty = self.difficulties[i % len(self.difficulties)]
      for _ in range(_DEDUPE_DRAWS):
        context, query = draw_query(self.world, rng, difficulty, split)
        key = (query.question, json.dumps(query.answer, sort_keys=True))
        if key not in seen:
          break
      seen.add(key)
      tools = make_tools(self.world, context)
      offered = self._offered(query, random.Random(f"toolworld-tools|{split}|{seed}|{i}"))
      tools = [t for t in tools if t.name in offered]
      system = render_tool_prompt(tools, preamble=PREAMBLE, finish=FINISH)
      tasks.append(Task(
          task_id=f"{self.name}/{split}/{seed}/{i}", family=self.name, split=split,
          messages=({"role": "system", "content": system},
                    {"role": "user", "content": query.question}),
          tool_names=tuple(t.name for t in tools), answer=query.answer, oracle=query.oracle,
          difficulty=query.difficulty,
          metadata={"world_seed": self.seed_world, "now": context.now.isoformat(timespec="minutes"),
                    "city": context.city, "template": query.template,
                    "oracle_alternatives": query.alternatives}))
    return tasks

  def _offered(self, query, rng: random.Random) -> frozenset[str]:
    """The tool names a task offers (see `tools_per_task`)."""
    if not self.tools_per_task:
      return frozenset(TOOL_NAMES)
    needed = {"response_gen", "get_current_context"}
    for route in (query.oracle, *query.alternatives):
      for m in route:
        if m.get("role") == "assistant":
          needed.update(c.name for c in parse_step(m["content"]).calls if c.name)
    spare = [n for n in TOOL_NAMES if n not in needed]
    rng.shuffle(spare)
    return frozenset(needed) | frozenset(spare[:max(0, self.tools_per_task - len(needed))])

  def tools(self, task: Task) -> list[Tool]:
    """The task's tools, rebuilt from its metadata (world seed, now, user city)."""
    seed = task.metadata["world_seed"]
    world = self.world if seed == self.seed_world else World.build(seed)
    context = Context(dt.datetime.fromisoformat(task.metadata["now"]), task.metadata["city"])
    return [t for t in make_tools(world, context) if t.name in task.tool_names]

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    """PORTool's outcome reward of one episode (see the module docstring).

    Args:
      task: the task the episode answers.
      episode: prompt messages, then assistant and tool messages.
      truncated: the episode hit the turn limit without a terminal call.

    Returns:
      The outcome; details hold the reason, the extracted answer and the truth.
    """
    details = {"ground_truth": task.answer, "answer": None}
    no_answer = Outcome(self.truncated_outcome, correct=False, answered=False,
                        details={**details, "reason": "truncated"})
    if truncated:
      return no_answer
    replies = [m for m in episode if m.get("role") == "assistant"]  # prompts have none
    if not replies:
      return Outcome(self.truncated_outcome, False, False, {**details, "reason": "no_step"})
    calls = [c for c in parse_step(str(replies[-1].get("content") or "")).calls
             if c.name == "response_gen" and c.error is None]
    if not calls:
      return Outcome(self.truncated_outcome, False, False,
                     {**details, "reason": "no_response_gen"})
    answer = (calls[-1].arguments or {}).get("answer")
    if not isinstance(answer, str) or not answer.strip():
      return Outcome(-1.0, False, False, {**details, "reason": "malformed_answer"})
    details["answer"] = answer
    if verify.is_unable(answer):
      outcome = Outcome(0.0, False, False, {**details, "reason": "unable_to_answer"})
    else:
      correct = verify.matches(task.answer, answer)
      outcome = Outcome(1.0 if correct else self.wrong_outcome, correct, True,
                        {**details, "reason": "correct" if correct else "wrong"})
    if self.malformed_outcome is not None and any(
        not parse_step(str(m.get("content") or "")).fields_ok for m in replies):
      return Outcome(self.malformed_outcome, outcome.correct, outcome.answered,
                     {**outcome.details, "malformed": True})
    return outcome
