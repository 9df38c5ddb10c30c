"""Runs flat (non-tree) tool-use episodes of a task family with a batched policy.

This is the reference loop that evaluation, SFT data checks and the harness self-check share:
every open episode advances together, one policy call per turn with every open conversation,
so a batched sampler (vLLM, the JAX sampler) sees one batch per turn. Each step is parsed
(`parsing.parse_step`), its calls run in a `ToolExecutor` over the task's tools, and PORTool's
formatting rubric is recorded per step, following the episode convention of `base.py`:

  - a step with no <tool_call> block ends the episode: its text is the final answer;
  - a step whose calls include a *successful* call of a terminal tool (`Tool.terminal`, e.g.
    `response_gen`) ends it after all its calls ran. A terminal call that fails (bad
    arguments) is answered with the error and the episode goes on, so the model can repair
    it: a failed call carries no answer the verifier could read;
  - a step whose blocks hold no valid call goes on too: broken JSON gets one error message
    per malformed call, an empty list (zero calls) gets no tool message at all;
  - after `max_turns` steps an unfinished episode ends truncated.

The outcome is the judge's verdict (`LLMJudge.judge_outcome`, on its +1/0/-1 scale) when a
judge is given, else the family's verifier (`family.score`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tree_rl.envs.base import (Message, Outcome, ParsedStep, Task, ToolOutputCap, ToolResult,
                               family_max_tool_output_tokens)
from tree_rl.envs.executor import ToolExecutor, tool_message
from tree_rl.envs.parsing import parse_step
from tree_rl.rewards.formatting import formatting_raw
from tree_rl.rewards.judge import LLMJudge

# base.TaskFamily is a plain (not @runtime_checkable) Protocol, which the test-time beartype
# hook cannot check, so families are typed loosely here.
Family = Any
# One assistant step text per conversation, in order.
Policy = Callable[[Sequence[Sequence[Message]]], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One assistant step: its parse, the results of its calls and its formatting score.

  Attributes:
    parsed: the step as parsed.
    results: one result per call, in call order (empty for a final-answer step).
    formatting_raw: PORTool's per-step rubric in [0, 1].
  """

  parsed: ParsedStep
  results: tuple[ToolResult, ...]
  formatting_raw: float


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
  """One finished or truncated episode.

  Attributes:
    task: the task.
    sample_index: which of the task's `num_samples` samples this is.
    messages: the whole episode, prompt messages first (the judge's and verifier's input).
    steps: one record per assistant step.
    num_tool_steps: steps with at least one call (at most max_turns).
    truncated: ended by the turn limit.
    finished: ended by a final answer or a terminal tool (== not truncated).
    outcome: the verifier's or the judge's outcome.
  """

  task: Task
  sample_index: int
  messages: tuple[Message, ...]
  steps: tuple[StepRecord, ...]
  num_tool_steps: int
  truncated: bool
  finished: bool
  outcome: Outcome


@dataclasses.dataclass
class OpenEpisode:
  """An episode in progress (mutable; frozen into an EpisodeRecord at the end)."""

  task: Task
  sample_index: int
  executor: ToolExecutor
  terminal: frozenset[str]
  messages: list[Message]
  steps: list[StepRecord] = dataclasses.field(default_factory=list)
  finished: bool = False


def _call_policy(policy: Policy, conversations: list[list[Message]], turn: int) -> list[str]:
  """The policy's texts for `conversations`, or a ValueError that says what went wrong."""
  try:
    texts = policy(conversations)
  except Exception as e:
    raise ValueError(f"the policy raised at turn {turn} on {len(conversations)} "
                     f"conversations: {type(e).__name__}: {e}") from e
  if isinstance(texts, str) or not isinstance(texts, Sequence):
    raise ValueError(f"the policy must return a list of strings, got {type(texts).__name__}")
  if len(texts) != len(conversations):
    raise ValueError(f"the policy returned {len(texts)} texts for {len(conversations)} "
                     f"conversations at turn {turn}; it must return one per conversation")
  for i, text in enumerate(texts):
    if not isinstance(text, str):
      raise ValueError(f"the policy returned a {type(text).__name__} for conversation {i} at "
                       f"turn {turn}; every step must be a string")
  return list(texts)


def advance(episode: OpenEpisode, text: str) -> None:
  """Appends one assistant step (and its tool messages) to `episode`."""
  parsed = parse_step(text)
  episode.messages.append({"role": "assistant", "content": text})
  if parsed.num_tool_call_blocks == 0:
    results: list[ToolResult] = []
    episode.finished = True  # a step without a tool call is the final answer
  else:
    results = episode.executor.execute(parsed.calls)
    episode.messages.extend(tool_message(r) for r in results)
    episode.finished = any(r.ok and r.name in episode.terminal for r in results)
  episode.steps.append(StepRecord(parsed=parsed, results=tuple(results),
                                  formatting_raw=formatting_raw(parsed, results)))


def run_episodes(family: Family, tasks: Sequence[Task], policy: Policy, *,
                 num_samples: int = 1, max_turns: int | None = None,
                 judge: LLMJudge | None = None, max_workers: int = 8,
                 encode: Callable[[str], Sequence[int]] | None = None,
                 progress: Callable[[int, int, int], None] | None = None
                 ) -> list[EpisodeRecord]:
  """Runs `num_samples` episodes of every task, all advancing together turn by turn.

  Args:
    family: the task family (its tools, turn limit and verifier).
    tasks: the tasks.
    policy: a batched callable: conversations (message lists) -> one step text each. Each
      turn it receives every open conversation, ordered by (task, sample).
    num_samples: episodes per task.
    max_turns: assistant steps per episode; None uses `family.max_turns`.
    judge: when given, outcomes come from `judge.judge_outcome` (concurrently) instead of
      `family.score`.
    max_workers: episodes whose tool calls run at the same time, and concurrent judgements.
    encode: the policy's tokenizer (text -> ids, `ChatFormat.encode`): every tool reply is
      cut to the family's `max_tool_output_tokens` tokens of it, as in the rollout; None
      counts 4 characters a token (scripted policies without a tokenizer).
    progress: called after each turn with (turns done, episodes finished, episodes).

  Returns:
    One record per episode, ordered by (task, sample).

  Raises:
    ValueError: bad arguments, or a policy that raises or returns something other than one
      string per conversation.
  """
  max_turns = family.max_turns if max_turns is None else max_turns
  if max_turns < 1 or num_samples < 1 or max_workers < 1:
    raise ValueError(f"max_turns, num_samples and max_workers must be >= 1, got "
                     f"{max_turns}, {num_samples}, {max_workers}")
  episodes = []
  cap = ToolOutputCap(family_max_tool_output_tokens(family), encode)
  for task in tasks:
    tools = family.tools(task)
    executor = ToolExecutor(tools, max_workers=max_workers, output_cap=cap)
    terminal = frozenset(t.name for t in tools if t.terminal)
    episodes.extend(OpenEpisode(task=task, sample_index=s, executor=executor, terminal=terminal,
                          messages=list(task.messages)) for s in range(num_samples))

  # Tool calls of different episodes run in parallel: a slow tool (or a timeout) in one
  # episode must not serialise the whole batch.
  with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
    for turn in range(max_turns):
      active = [e for e in episodes if not e.finished]
      if not active:
        break
      # Shallow copies: a policy that edits its input must not corrupt the episodes.
      texts = _call_policy(policy, [list(e.messages) for e in active], turn)
      list(pool.map(advance, active, texts))  # list(): re-raises a worker's exception
      if progress is not None:
        progress(turn + 1, sum(e.finished for e in episodes), len(episodes))

  truncated = [not e.finished for e in episodes]
  if judge is not None:
    verdicts = judge.judge_many([(e.task, e.messages, t) for e, t in zip(episodes, truncated)],
                                max_workers=max_workers)
    outcomes = [v.to_outcome(t) for v, t in zip(verdicts, truncated)]
  else:
    outcomes = [family.score(e.task, e.messages, t) for e, t in zip(episodes, truncated)]

  return [EpisodeRecord(task=e.task, sample_index=e.sample_index, messages=tuple(e.messages),
                        steps=tuple(e.steps),
                        num_tool_steps=sum(1 for s in e.steps if s.parsed.calls),
                        truncated=t, finished=not t, outcome=o)
          for e, t, o in zip(episodes, truncated, outcomes)]
