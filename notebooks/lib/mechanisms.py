"""Mechanism claims measured at one fixed policy: each arm's trees of the same prompts
(`launch/measure_rollouts.py`), compared prompt by prompt (notebooks/mechanisms.py,
docs/notebooks.md#mechanisms).

A unit is one (repeat, prompt): the tree the arm grew of that prompt on that repeat's
sampling stream. Two arms are paired on their shared units; the test is a paired t-test
over units, with a bootstrap interval over units beside it, and the power analysis asks how
many units a paired t-test needs for 80% power at a stated effect (`tree_rl.stats
.seeds_for_power` with units in place of seeds). `step_row` does the same for a per-step
metric of committed training runs, with (seed, RL step) as the unit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats

from lib.arms import Arm, config_file, overrides
from lib.results import curve
from lib.running import launch, provenance
from tree_rl import stats
from tree_rl.rollout.measure import per_prompt

ALPHA = 0.05
POWER = 0.8
MOST_UNITS = 100_000  # seeds_for_power's cap: "at least this many"


def measure_arm(paper: str, arm: Arm, seed: int, scale: str, root: str | pathlib.Path,
                model: str | pathlib.Path, repeats: int, task_ids: Sequence[int],
                replot_only: bool = False) -> dict[str, Any] | None:
  """`arm`'s trees of training tasks `task_ids`, grown `repeats` times by run directory
  `model`'s policy, in `<root>/<paper>/<arm>_s<seed>.json` (a launch/measure_rollouts.py
  process; a file already there is read, not redone), with the arm and where it ran (commit,
  machine: `lib.running.provenance`). With `replot_only`, a missing file gives None."""
  out = pathlib.Path(root) / paper / f"{arm.name}_s{seed}.json"
  if not out.is_file():
    if replot_only:
      print(f"no measurement at {out}: left out (replot only)", flush=True)
      return None
    path, arg = config_file(arm, scale)
    where = provenance()  # at the start: the code that measures, not a later edit
    print(f"=== {paper}/{out.name}: {len(task_ids)} prompts x {repeats}", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    launch(["launch/measure_rollouts.py", f"--model={model}",
            f"--config={path}" + (f":{arg}" if arg else ""),
            "--overrides=" + json.dumps({**overrides(arm, seed, scale),
                                         "rollout.task_ids": [int(i) for i in task_ids]}),
            f"--repeats={int(repeats)}", f"--seed={int(seed)}", f"--out={tmp}"])
    result = {**json.loads(tmp.read_text(encoding="utf-8")), "arm": arm.name,
              "config": arm.config, "overrides": dict(arm.overrides), **where}
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    tmp.unlink()
  return json.loads(out.read_text(encoding="utf-8"))


@dataclasses.dataclass(frozen=True)
class MechanismRow:
  """One arm against a reference on one per-prompt metric, paired over shared units.

  Attributes:
    label: "<arm> - <reference>".
    metric: the per-prompt metric (`tree_rl.rollout.measure.per_prompt`).
    units: units both arms have a finite value on.
    mean_a, mean_b: the arm's and the reference's means over those units.
    difference: mean of (arm - reference).
    ci: 95% t-interval of the difference over units.
    ci_boot: 95% bootstrap interval of the difference over units.
    p_value: paired t-test p (two-sided).
    effect: the effect the power analysis is for (absolute, in the metric's units).
    needs: units a paired t-test needs for 80% power at `effect` (the observed spread).
    needs_observed: the same at the observed difference (None when it is 0): what a
      follow-up needs to confirm the direction seen here.
    claimed: +1 when the claim is that the arm is higher, -1 lower.
    unit: what a unit is, for the verdict ("prompts", "seed-steps").
  """

  label: str
  metric: str
  units: int
  mean_a: float
  mean_b: float
  difference: float
  ci: tuple[float, float]
  ci_boot: tuple[float, float]
  p_value: float
  effect: float
  needs: int
  needs_observed: int | None
  claimed: int
  unit: str = "prompts"

  @property
  def verdict(self) -> str:
    """"reproduced" (the claimed direction, with a t-interval that excludes 0),
    "contradicted" (the opposite direction, excluding 0), "equal on every unit"; else not
    separable from 0, and either `effect` lies outside the interval (an effect that large
    is ruled out) or the units 80% power at `effect` needs."""
    low, high = self.ci
    if low == high == self.difference == 0:
      return "equal on every unit"
    if low > 0 or high < 0:
      return "reproduced" if (low > 0) == (self.claimed > 0) else "contradicted"
    far = high if self.claimed > 0 else -low  # how far the interval reaches the claimed way
    if far < self.effect:
      return (f"not separable from 0; an effect of {self.effect:.3f} is outside the interval "
              f"(ruled out at this scale)")
    needs = f"≥ {self.needs}" if self.needs >= MOST_UNITS else f"≈ {self.needs}"
    return f"not separable at this power (needs {needs} {self.unit})"


def paired_row(label: str, metric: str, va: dict[Any, float], vb: dict[Any, float], *,
               effect: float | None = None, relative_effect: float = 0.2,
               claimed: int = 1, unit: str = "prompts") -> MechanismRow:
  """`va` against `vb` ({unit: value}) over the units both have a finite value on. The power
  analysis is for `effect`, else a change of `relative_effect` times `vb`'s mean.

  Raises:
    ValueError: fewer than 2 shared units with finite values.
  """
  keys = sorted(k for k in va.keys() & vb.keys()
                if math.isfinite(va[k]) and math.isfinite(vb[k]))
  if len(keys) < 2:
    raise ValueError(f"{label}: {len(keys)} shared units with a finite {metric}; need 2")
  xa, xb = np.array([va[k] for k in keys]), np.array([vb[k] for k in keys])
  d = xa - xb
  n, sd = len(d), float(d.std(ddof=1))
  ci = stats.seed_interval(d.tolist(), sd, n - 1, level=1 - ALPHA)  # units in place of seeds
  p = float(scipy.stats.ttest_rel(xa, xb).pvalue) if sd > 0 else (
      1.0 if d.mean() == 0 else 0.0)
  if effect is None:
    effect = abs(relative_effect * float(xb.mean())) or relative_effect
  observed = abs(float(d.mean()))
  return MechanismRow(label, metric, n, float(xa.mean()), float(xb.mean()), float(d.mean()),
                      ci, stats.paired_bootstrap(d), p, float(effect),
                      stats.seeds_for_power(sd, effect, power=POWER, alpha=ALPHA,
                                            most=MOST_UNITS),
                      stats.seeds_for_power(sd, observed, power=POWER, alpha=ALPHA,
                                            most=MOST_UNITS)
                      if observed > 0 else None, claimed, unit)


def mechanism_row(a: dict[str, Any], b: dict[str, Any], label: str, metric: str, *,
                  relative_effect: float = 0.2, claimed: int = 1) -> MechanismRow:
  """Arm `a` against reference `b` (two `measure_rollouts` results) on `metric`, paired
  over the (repeat, prompt) units both have (`paired_row`)."""
  return paired_row(label, metric, per_prompt(a, metric), per_prompt(b, metric),
                    relative_effect=relative_effect, claimed=claimed)


EFFECTIVE_RATIO = "effective_ratio"


def step_values(run: Any, metric: str) -> dict[int, float]:
  """{RL step: `metric`} of a training run's record (`lib.results.Run`). "effective_ratio"
  is TRACE's Eq. 21 (arXiv 2606.11119), the share of a step's trees whose leaf rewards are
  not all equal: `trace/effective_ratio` where the run logs it, else 1 -
  `adv/zero_std_frac` (GRPO's and TreeRPO's share of trees without reward spread)."""
  rl = {int(r["step"]) for r in run.history if r.get("phase") == "rl"}
  if metric == EFFECTIVE_RATIO:
    got = curve(run, "trace/effective_ratio")
    if not got:
      got = {s: 1.0 - v for s, v in curve(run, "adv/zero_std_frac").items()}
  else:
    got = curve(run, metric)
  return {s: v for s, v in got.items() if s in rl}


def step_row(runs: Sequence[Any], a: str, b: str | None, metric: str, *,
             reference: float | None = None, effect: float | None = None,
             relative_effect: float = 0.2, claimed: int = 1) -> MechanismRow:
  """Arm `a` against arm `b` on a per-step metric of committed training runs, paired over
  (seed, RL step): at one seed both arms start from one warm start and draw the same
  prompts at each step. With `b` None, against the constant `reference` at every unit."""
  def units(arm: str) -> dict[tuple[int, int], float]:
    return {(r.seed, s): v for r in runs if r.arm == arm for s, v in step_values(r, metric).items()}

  va = units(a)
  vb = units(b) if b is not None else dict.fromkeys(va, float(reference))
  label = f"{a} - {b if b is not None else reference}"
  return paired_row(label, metric, va, vb, effect=effect, relative_effect=relative_effect,
                    claimed=claimed, unit="seed-steps")


def call_totals(result: dict[str, Any]) -> list[dict[str, float]]:
  """Per repeat (one batched call over all prompts): its informative forks, forks, trees,
  policy and sampled tokens, and seconds."""
  rows = []
  for call in result["calls"]:
    trees = call["trees"]
    rows.append({"informative_forks": float(np.nansum([t["informative_forks"] for t in trees])),
                 "forks": float(sum(t["forks"] for t in trees)), "trees": float(len(trees)),
                 "policy_tokens": float(sum(t["policy_tokens"] for t in trees)),
                 "sampled_tokens": float(call["sampled_tokens"]),
                 "seconds": float(call["seconds"])})
  return rows


def rate_table(results: dict[str, dict[str, Any]]) -> str:
  """Each arm's informative forks per 1k sampled tokens and per minute of rollout, per
  repeat and in total, as a markdown table (the cost side of 'more signal per sample')."""
  lines = ["| arm | trees | forks | informative forks | policy tokens | sampled tokens | "
           "rollout s | informative / 1k sampled tokens | informative / min |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for name, result in results.items():
    rows = call_totals(result)
    tot = {k: sum(r[k] for r in rows) for k in rows[0]}
    per_tok = "; ".join(f"{1000 * r['informative_forks'] / r['sampled_tokens']:.2f}"
                        for r in rows)
    per_min = "; ".join(f"{60 * r['informative_forks'] / r['seconds']:.2f}" for r in rows)
    lines.append(
        f"| {name} | {tot['trees']:.0f} | {tot['forks']:.0f} | {tot['informative_forks']:.0f} | "
        f"{tot['policy_tokens']:.0f} | {tot['sampled_tokens']:.0f} | {tot['seconds']:.0f} | "
        f"{1000 * tot['informative_forks'] / tot['sampled_tokens']:.2f} ({per_tok}) | "
        f"{60 * tot['informative_forks'] / tot['seconds']:.2f} ({per_min}) |")
  return "\n".join(lines)


def mechanism_table(rows: Sequence[MechanismRow]) -> str:
  """`MechanismRow`s as a markdown table."""
  lines = ["| comparison | metric | units | arm | reference | diff | 95% CI (t) | "
           "95% CI (bootstrap) | p | effect for power | units for 80% power at the "
           "observed diff | verdict |",
           "|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
  for r in rows:
    observed = "–" if r.needs_observed is None else str(r.needs_observed)
    if r.needs_observed is not None and r.needs_observed >= MOST_UNITS:
      observed = f"≥ {r.needs_observed}"
    lines.append(f"| {r.label} | {r.metric} | {r.units} | {r.mean_a:.3f} | {r.mean_b:.3f} | "
                 f"{r.difference:+.3f} | [{r.ci[0]:+.3f}, {r.ci[1]:+.3f}] | "
                 f"[{r.ci_boot[0]:+.3f}, {r.ci_boot[1]:+.3f}] | {r.p_value:.2g} | "
                 f"{r.effect:.3f} | {observed} | {r.verdict} |")
  return "\n".join(lines)
