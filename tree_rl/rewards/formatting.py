"""PORTool's per-step formatting reward: a rule-based rubric and its rescaling.

The rubric (PORTool, arXiv 2510.26020, §3.2 Step 2) is a cascade: each term is earned only when
every earlier one was, because "formatting rewards are activated only when a
reasoning block is present" and the later terms apply "only when the above
requirements are met":

  raw = 0
  if the step has <think>...</think>:                           raw += 0.20
    if it has a <tool_call> block:                              raw += 0.10
      if every block parses as JSON:                            raw += 0.10
        if EVERY call has a string "name" and object "arguments": raw += 0.05
          raw += 0.55 * (#successful calls / #calls)

so raw is in [0, 1]. Typical values: no think 0.0; think only 0.2; broken JSON
0.3; fields missing 0.4; fields fine but no call succeeds 0.45; 1 of 2 calls
succeed 0.725; all succeed 1.0. The flags come from `tree_rl.envs.parsing`
(`ParsedStep.think`, `num_tool_call_blocks`, `json_ok`, `fields_ok`) and a
call succeeds when its `ToolResult.ok` is True.

Edge cases (our choices, docs/methods/portool.md#formatting-rubric-edge-cases):
  - a block holding an empty JSON list: zero calls, the field check passes
    vacuously, and 0/0 gives no success credit, so raw = 0.45. Calling nothing
    must not be worth as much as calling something that works.
  - several blocks in one step: every block must parse, and the success
    fraction is over the calls of all blocks together.
  - A step without a think block scores 0 whatever its calls do.

The rescaled reward R_fm = h * (2 * raw - 1) with half-width h = 0.25 (the
paper's "[-0.25, 0.25]"; the map itself is ours,
docs/methods/portool.md#formatting-reward-scale) is added to the decayed outcome in the
step reward (PORTool eq. 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from tree_rl.envs.base import ParsedStep, ToolResult

# Rubric terms in hundredths, summed as integers so that the table's values
# (0.45, 0.725, 1.0) come out exactly as written rather than as 0.45000000000000007.
THINK, TAG, JSON, FIELDS, SUCCESS = 20, 10, 10, 5, 55

FORMAT_HALF_WIDTH = 0.25  # PORTool's stated range "[-0.25, 0.25]" (§3.2 Step 2)


def formatting_raw(step: ParsedStep, results: Sequence[ToolResult]) -> float:
  """PORTool's formatting rubric of one step, in [0, 1].

  Args:
    step: the parsed step.
    results: the executor's results, aligned with `step.calls`.

  Returns:
    The raw rubric score (the cascade in the module docstring).

  Raises:
    ValueError: if `results` and `step.calls` differ in length.
  """
  if len(results) != len(step.calls):
    raise ValueError(f"formatting_raw got {len(results)} results for "
                     f"{len(step.calls)} calls; they must be aligned one to one")
  if step.think is None:
    return 0.0
  hundredths = THINK
  if step.num_tool_call_blocks == 0:
    return hundredths / 100
  hundredths += TAG
  if not step.json_ok:
    return hundredths / 100
  hundredths += JSON
  if not step.fields_ok:
    return hundredths / 100
  hundredths += FIELDS
  if not step.calls:  # an empty list earns no success credit (see the module docstring)
    return hundredths / 100
  succeeded = sum(1 for r in results if r.ok)
  return (hundredths + SUCCESS * succeeded / len(step.calls)) / 100


def rescale_formatting(raw: float, half_width: float = FORMAT_HALF_WIDTH) -> float:
  """Maps the raw rubric [0, 1] affinely onto [-half_width, +half_width].

  Args:
    raw: the rubric score from `formatting_raw`.
    half_width: h; the default 0.25 is the paper's range. Correct outcomes
      still beat wrong ones among siblings while h < gamma^(T_max - 1) / 2
      (docs/methods/portool.md#formatting-reward-scale).

  Returns:
    h * (2 * raw - 1): raw 0 -> -h, 0.5 -> 0, 1 -> +h.

  Raises:
    ValueError: if raw is outside [0, 1] or half_width is negative.
  """
  if not 0.0 <= raw <= 1.0:
    raise ValueError(f"raw formatting score must be in [0, 1], got {raw}")
  if not half_width >= 0.0:
    raise ValueError(f"half_width must be >= 0, got {half_width}")
  return half_width * (2.0 * raw - 1.0)
