"""An offline, deterministic reasoning score: AWPO's four judge dimensions rated by rules
against the task's oracle trajectory (AWPO, arXiv 2512.19126, Eq. 20 and App. B, Fig. 2).

AWPO's R_reason comes from an LLM judge that grades the chain of thought and the tool calls
against the ground-truth trajectory on four weighted dimensions. A run without a judge
endpoint (no network at run time, CPU smoke runs) needs the same kind of signal from rules.
Each dimension is a number in [0, 1], computed from the episode's assistant steps and a
reference route: the assistant steps of `task.oracle`, or of any route in
`task.metadata["oracle_alternatives"]` (the tool world's other valid routes); the best route
counts. Any family whose tasks carry an oracle works; BFCL's oracle step holds its reference
calls (the first acceptable value of every argument, as S_exec uses).

  reasoning_path (35%)      half for thinking first: the fraction of steps that open with a
                            <think> block of at least MIN_THINK_WORDS words, before any call;
                            half for the path: the longest common subsequence of the called
                            tool names and the reference's, over the longer of the two (names
                            sorted within a step: one step's calls run together, so only the
                            order across steps counts; 1 when neither side calls).
  tool_selection (30%)      Jaccard of the sets of called and reference tool names (1 when
                            both are empty: nothing to call and nothing called).
  parameter_setting (25%)   each reference call, in order, takes the unused well-formed call
                            of the same name with the most credit, where credit = |arguments
                            with equal values| / |argument names of either| (1 for two empty
                            argument lists); an unmatched reference call gets 0; the mean over
                            reference calls (without a reference call: 1 if no call is made).
  execution_strategy (10%)  min(#good, |reference|) / max(#attempts, |reference|): an
                            attempt is every call block entry, malformed ones included; a good
                            call is well-formed and not a repeat of an earlier identical call
                            (1 when neither side calls).

R_reason = sum_k weight_k * dimension_k with AWPO's weights (`judge.REASONING_WEIGHTS`). An
episode without an assistant step scores 0. Argument values compare after a light
normalisation a judge would also forgive (numbers by value, strings case- and
whitespace-insensitive); S_exec (`execution_match`) stays exact. Free-text arguments (the tool
world's `response_gen` answer) rarely match; the outcome reward grades those.

These rules are ours (docs/methods/awpo.md): the paper's judge prompt and tier values are
not available, and the rubric is no substitute for a judge reading the reasoning itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tree_rl.envs.base import Message, ParsedStep, Task
from tree_rl.envs.parsing import CALL_OPEN, THINK_OPEN, parse_step
from tree_rl.rewards.judge import REASONING_WEIGHTS

MIN_THINK_WORDS = 3  # "<think>ok</think>" is not reasoning; the oracles' shortest have 7 words.
# The weights in percent, summed as integers first so that a perfect episode scores exactly
# 1.0 (0.35 + 0.30 + 0.25 + 0.10 is 0.9999999999999999 in floats).
_PERCENT = {k: round(100 * w) for k, w in REASONING_WEIGHTS.items()}

Call = tuple[int, str, Mapping[str, Any]]  # (step index, tool name, arguments)


def _norm(value: Any) -> Any:
  """A comparable form of a JSON value: numbers by value, strings casefolded with runs of
  whitespace collapsed, dicts as sorted items."""
  if isinstance(value, bool) or value is None:
    return value
  if isinstance(value, (int, float)):
    # Unconverted: ints and floats already compare and hash by value (5 == 5.0), and
    # float() of a model's 400-digit integer argument raises OverflowError.
    return value
  if isinstance(value, str):
    return " ".join(value.split()).casefold()
  if isinstance(value, Mapping):
    return tuple(sorted((str(k), _norm(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_norm(v) for v in value)
  return repr(value)


def _steps(messages: Sequence[Message]) -> list[ParsedStep]:
  return [parse_step(str(m.get("content") or "")) for m in messages
          if m.get("role") == "assistant"]


def _calls(steps: Sequence[ParsedStep]) -> list[Call]:
  """The well-formed calls, in order (the parser guarantees a name and an arguments dict)."""
  return [(i, c.name, c.arguments) for i, s in enumerate(steps) for c in s.calls
          if c.error is None]


def _thinks_first(step: ParsedStep) -> bool:
  if step.think is None or len(step.think.split()) < MIN_THINK_WORDS:
    return False
  call = step.text.find(CALL_OPEN)
  return call < 0 or step.text.find(THINK_OPEN) < call


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
  """Length of the longest common subsequence (one DP row; `diag` is the row above, j - 1)."""
  row = [0] * (len(b) + 1)
  for x in a:
    diag = 0
    for j, y in enumerate(b, start=1):
      above = row[j]
      row[j] = diag + 1 if x == y else max(above, row[j - 1])
      diag = above
  return row[-1]


def _path(calls: Sequence[Call]) -> list[str]:
  return [name for _, name, _ in sorted(calls, key=lambda c: (c[0], c[1]))]


def _credit(ref: Mapping[str, Any], pred: Mapping[str, Any]) -> float:
  keys = set(ref) | set(pred)
  if not keys:
    return 1.0
  same = sum(1 for k in ref if k in pred and _norm(pred[k]) == _norm(ref[k]))
  return same / len(keys)


def _parameter_setting(ref: Sequence[Call], calls: Sequence[Call]) -> float:
  if not ref:
    return 0.0 if calls else 1.0
  used, total = set(), 0.0
  for _, name, args in ref:
    best, best_credit = None, -1.0
    for j, (_, p_name, p_args) in enumerate(calls):
      if j not in used and p_name == name and _credit(args, p_args) > best_credit:
        best, best_credit = j, _credit(args, p_args)  # strict: the earliest wins a tie
    if best is not None:
      used.add(best)
      total += best_credit
  return total / len(ref)


def _execution_strategy(steps: Sequence[ParsedStep], calls: Sequence[Call],
                        num_ref: int) -> float:
  attempts = sum(len(s.calls) for s in steps)
  seen, good = set(), 0
  for _, name, args in calls:
    key = (name, _norm(args))
    good += key not in seen
    seen.add(key)
  if max(attempts, num_ref) == 0:
    return 1.0
  return min(good, num_ref) / max(attempts, num_ref)


def dimensions(steps: Sequence[ParsedStep], reference: Sequence[ParsedStep]) -> dict[str, float]:
  """The four dimension scores of parsed assistant steps against a reference route's."""
  calls, ref = _calls(steps), _calls(reference)
  think = sum(_thinks_first(s) for s in steps) / len(steps) if steps else 0.0
  path, ref_path = _path(calls), _path(ref)
  longest = max(len(path), len(ref_path))
  order = _lcs(path, ref_path) / longest if longest else 1.0
  names, ref_names = {c[1] for c in calls}, {c[1] for c in ref}
  union = names | ref_names
  return {
      "reasoning_path": 0.5 * think + 0.5 * order,
      "tool_selection": len(names & ref_names) / len(union) if union else 1.0,
      "parameter_setting": _parameter_setting(ref, calls),
      "execution_strategy": _execution_strategy(steps, calls, len(ref)),
  }


def reference_routes(task: Task) -> list[tuple[Message, ...]]:
  """The oracle route and its alternatives; ValueError naming the task when it has none."""
  routes = [tuple(task.oracle), *(tuple(r) for r in task.metadata.get("oracle_alternatives", ()))]
  routes = [r for r in routes if any(m.get("role") == "assistant" for m in r)]
  if not routes:
    raise ValueError(
        f"task {task.task_id!r} of family {task.family!r} has no oracle trajectory (no "
        f"assistant message in task.oracle); the rubric judge grades against one. Use a "
        f"family whose tasks carry `oracle` messages, or judge.kind='llm'")
  return routes


def rubric_dimensions(task: Task, episode: Sequence[Message]) -> dict[str, float]:
  """The dimensions of the episode against its best-scoring reference route.

  Args:
    task: the task; its oracle (and alternatives) is the reference.
    episode: the whole episode, prompt messages first.
  """
  steps = _steps(episode[len(task.messages):])
  if not steps:
    return dict.fromkeys(REASONING_WEIGHTS, 0.0)
  return max((dimensions(steps, _steps(route)) for route in reference_routes(task)),
             key=_weighted)


def _weighted(dims: Mapping[str, float]) -> float:
  return sum(_PERCENT[k] * dims[k] for k in _PERCENT) / 100


def rubric_score(task: Task, episode: Sequence[Message]) -> float:
  """R_reason in [0, 1]: the weighted sum of `rubric_dimensions` (AWPO's weights)."""
  return _weighted(rubric_dimensions(task, episode))
