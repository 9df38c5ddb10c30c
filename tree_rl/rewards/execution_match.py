"""AWPO's outcome reward: format score plus execution match against the ground-truth calls
(AWPO, arXiv 2512.19126, §3.2, Eqs. 14-19).

A tool call is a plain dict {"name": str, "arguments": {name: value}} (a missing "arguments"
means a call without arguments). The paper scores calls with sets; the conventions it leaves
open are tree_rl's choices, following ToolRL's rule (docs/methods/awpo.md):

  - matching: each ground-truth call, in order, takes the best still-unused predicted
    call with the same name, scored by Jaccard of argument names plus the number of exactly
    matching values; ties go to the earliest prediction. Unmatched calls add nothing.
  - r_name (eq. 16): Jaccard of the two sets of tool names, 0 when both are empty.
  - r_para (eq. 17): sum over matched ground-truth calls of the Jaccard of argument names, with
    Jaccard(empty, empty) = 1 for a matched call without arguments.
  - r_value (eq. 18): number of ground-truth arguments whose predicted value is exactly equal;
    v(T_i) is every argument of T_i. "Exactly" is equality of canonical JSON (keys sorted),
    so "5" != 5, 5 != 5.0 and True != 1, but dict key order does not matter.
  - S_exec (eq. 19) = (r_name + r_para + r_value) / (1 + |T| + sum_i |v(T_i)|), in [0, 1].
  - no ground-truth call: the formula gives 0 (r_name = 0 by the rule above, and nothing
    to match): ToolRL's convention, the default. `no_call="match"` instead scores 1 when the
    prediction makes no call either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

NO_CALL_CONVENTIONS = ("toolrl", "match")


def _name(call: Mapping[str, Any]) -> str:
  if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
    raise TypeError(f"a tool call must be a dict with a string 'name', got {call!r}")
  return call["name"]


def _arguments(call: Mapping[str, Any]) -> Mapping[str, Any]:
  args = call.get("arguments", {})
  if not isinstance(args, Mapping):
    raise TypeError(f"tool call {call.get('name')!r}: 'arguments' must be a dict, got {args!r}")
  return args


def _canonical(value: Any) -> str | tuple[str, Any]:
  """JSON text with sorted keys; values JSON cannot hold compare by type and ==."""
  try:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=True)
  except (TypeError, ValueError):
    return (type(value).__name__, value)


def _jaccard(a: set, b: set) -> float:
  union = a | b
  return len(a & b) / len(union) if union else 1.0


def _pair_score(gt_args: Mapping[str, Any], pred_args: Mapping[str, Any]) -> tuple[float, int]:
  """(Jaccard of argument names, number of ground-truth values matched exactly)."""
  para = _jaccard(set(gt_args), set(pred_args))
  value = sum(1 for key, v in gt_args.items()
              if key in pred_args and _canonical(pred_args[key]) == _canonical(v))
  return para, value


def execution_match(
    gt_calls: Sequence[Mapping[str, Any]],
    pred_calls: Sequence[Mapping[str, Any]],
    no_call: str = "toolrl",
) -> float:
  """S_exec of AWPO eq. 19, in [0, 1]; 1.0 for an exact match.

  Args:
    gt_calls: ground-truth tool calls T.
    pred_calls: predicted tool calls P (already parsed).
    no_call: what an empty `gt_calls` scores: "toolrl" (0, the formula as written) or "match"
      (1 if `pred_calls` is empty too, else 0).

  Returns:
    (r_name + r_para + r_value) / (1 + |T| + sum_i |v(T_i)|).
  """
  if no_call not in NO_CALL_CONVENTIONS:
    raise ValueError(f"no_call must be one of {NO_CALL_CONVENTIONS}, got {no_call!r}")
  gt_names = [_name(c) for c in gt_calls]
  pred_names = [_name(c) for c in pred_calls]
  gt_args = [_arguments(c) for c in gt_calls]
  pred_args = [_arguments(c) for c in pred_calls]
  if not gt_calls and no_call == "match":
    return 0.0 if pred_calls else 1.0

  names_t, names_p = set(gt_names), set(pred_names)
  union = names_t | names_p
  r_name = len(names_t & names_p) / len(union) if union else 0.0  # eq. 16

  used = [False] * len(pred_calls)
  r_para, r_value = 0.0, 0
  for name, args in zip(gt_names, gt_args):
    best, best_score = None, None
    for j, (p_name, p_args) in enumerate(zip(pred_names, pred_args)):
      if used[j] or p_name != name:
        continue
      score = _pair_score(args, p_args)
      if best is None or sum(score) > sum(best_score):  # strict: earliest wins a tie
        best, best_score = j, score
    if best is not None:
      used[best] = True
      r_para += best_score[0]  # eq. 17
      r_value += best_score[1]  # eq. 18

  denom = 1 + len(gt_calls) + sum(len(a) for a in gt_args)  # eq. 19
  return (r_name + r_para + r_value) / denom


def awpo_outcome_reward(
    format_ok: bool,
    gt_calls: Sequence[Mapping[str, Any]],
    pred_calls: Sequence[Mapping[str, Any]],
    no_call: str = "toolrl",
) -> float:
  """R_out = S_format + S_exec (AWPO eqs. 14-15), in [0, 2].

  S_format is 1 for a valid output structure, else 0. S_exec is 0 when the format is invalid
  (the calls of a malformed output are not scored; docs/methods/awpo.md).
  """
  if not format_ok:
    return 0.0
  return 1.0 + execution_match(gt_calls, pred_calls, no_call=no_call)
