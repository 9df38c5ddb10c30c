"""Reading runs back: records, tables over seeds, and plots."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lib.arms import RUN_DIR, Arm
from tree_rl import stats

FINISHED_MARKER = "arm.json"
# "train/<key>" of a run is the mean of its last TAIL_STEPS RL steps' values: one step's
# reward is a handful of groups, too noisy to compare arms on.
TAIL_STEPS = 5


def is_finished(path: str | pathlib.Path) -> bool:
  """A run `run_arm` completed: its arm.json is written after the final eval and the
  clean-up, so an interrupted run never has one."""
  return (pathlib.Path(path) / FINISHED_MARKER).is_file()


@dataclasses.dataclass
class Run:
  """What one run left on disk.

  Attributes:
    final: "<stage>/<metric>" of each evaluation (stages base, sft, rl, step<k>, sampled
      and sft_sampled; from eval_<stage>.json, else from metrics.jsonl's eval rows),
      "rl_minus_sft/<metric>" (what RL changed, per seed, on the same held-out tasks, for
      each metric both evals report), "train/<key>" (the mean of the last TAIL_STEPS RL
      steps' finite values of each logged key) and "wall_s" (phases.txt's wall time).
    scores: stage -> task id -> the fraction of the task's episodes that were correct
      (0 or 1 in a greedy eval), from eval_<stage>.json: what paired tests compare.
    history: metrics.jsonl's rows in order (RL steps, SFT steps and evals, see `phase`).
    finished: `is_finished`; an unfinished run's numbers are as far as it got.
  """

  paper: str
  arm: str
  seed: int
  path: pathlib.Path
  finished: bool
  final: dict[str, float]
  history: list[dict[str, Any]]
  config: dict[str, Any]
  scores: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """The rows of a JSONL file; a line a kill cut short (not valid JSON) is skipped."""
  if not path.is_file():
    return []
  rows = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(row, dict):
      rows.append(row)
  return rows


def _number(value: Any) -> float | None:
  """A metric value as a float (MetricWriter writes non-finite ones as text), or None."""
  if isinstance(value, bool) or value is None:
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


def read_json(path: pathlib.Path) -> dict[str, Any] | None:
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return None
  return value if isinstance(value, dict) else None


def load_run(path: str | pathlib.Path) -> Run | None:
  """The record of one run folder, or None when its name is not `<arm>_s<seed>` or it holds
  nothing to show (no metrics, no eval)."""
  path = pathlib.Path(path)
  meta = read_json(path / FINISHED_MARKER) or {}
  match = RUN_DIR.match(path.name)
  if not match:
    return None
  arm, seed = str(meta.get("arm", match["arm"])), int(meta.get("seed", match["seed"]))
  history = read_jsonl(path / "metrics.jsonl")
  final: dict[str, float] = {}
  for row in history:  # evals logged by the trainer: the fallback for a missing eval JSON
    phase = str(row.get("phase", ""))
    if phase.startswith("eval:"):
      for key, value in row.items():
        if key.startswith("eval/") and _number(value) is not None:
          final[f"{phase[5:]}/{key[5:]}"] = _number(value)
  scores: dict[str, dict[str, float]] = {}
  for eval_path in sorted(path.glob("eval_*.json")):
    report = read_json(eval_path)
    metrics = report.get("metrics") if report else None
    stage = eval_path.stem[len("eval_"):]
    if isinstance(metrics, dict):
      final.update({f"{stage}/{k}": _number(v) for k, v in metrics.items()
                    if _number(v) is not None})
    if report and (by_task := _task_scores(report.get("episodes"))):
      scores[stage] = by_task
  for key in [k[len("rl/"):] for k in final if k.startswith("rl/")]:
    if f"sft/{key}" in final:  # paired: the same held-out tasks
      final[f"rl_minus_sft/{key}"] = final[f"rl/{key}"] - final[f"sft/{key}"]
  rl_rows = [r for r in history if r.get("phase", "rl") == "rl"]
  tail = rl_rows[-TAIL_STEPS:]
  for key in sorted({k for r in tail for k in r} - {"step", "phase"}):
    values = [v for v in (_number(r.get(key)) for r in tail) if v is not None and math.isfinite(v)]
    if values:
      final[f"train/{key}"] = sum(values) / len(values)
  phases = path / "phases.txt"
  if phases.is_file():
    for line in phases.read_text(encoding="utf-8").splitlines():
      parts = line.split()
      if len(parts) >= 2 and parts[0] == "wall" and _number(parts[-2]) is not None:
        final["wall_s"] = _number(parts[-2])
  if not history and not final:
    return None
  return Run(paper=str(meta.get("paper") or path.parent.name), arm=arm, seed=seed, path=path,
             finished=is_finished(path), final=final, history=history,
             config=read_json(path / "config.json") or {}, scores=scores)


def _task_scores(episodes: Any) -> dict[str, float]:
  """task id -> mean correctness of an eval report's episodes; {} if they are unreadable."""
  if not isinstance(episodes, list):
    return {}
  hits: dict[str, list[float]] = {}
  for episode in episodes:
    if not isinstance(episode, dict) or not isinstance(episode.get("correct"), bool):
      return {}
    hits.setdefault(str(episode.get("task_id")), []).append(float(episode["correct"]))
  return {task: sum(v) / len(v) for task, v in hits.items()}


def load_runs(root: str | pathlib.Path, paper: str) -> list[Run]:
  """Every run under `<root>/<paper>/`, by arm then seed; folders that are not runs, runs
  that left nothing readable and unreadable files are skipped, not fatal."""
  folder = pathlib.Path(root) / paper
  if not folder.is_dir():
    return []
  runs = [run for child in sorted(folder.iterdir()) if child.is_dir()
          for run in [load_run(child)] if run is not None]
  return sorted(runs, key=lambda r: (r.arm, r.seed))


# ============================== Tables ==============================


@dataclasses.dataclass(frozen=True)
class Stat:
  """A column's value over an arm's seeds: the mean, the sample standard deviation (ddof 1;
  NaN with fewer than two seeds) and how many seeds had the value."""

  mean: float
  std: float
  n: int


@dataclasses.dataclass(frozen=True)
class Row:
  arm: str
  runs: int  # finished runs (seeds) of the arm
  cells: dict[str, Stat]


def _arm_names(arms: Sequence[Arm | str] | None, runs: Sequence[Run]) -> list[str]:
  if arms is None:
    return list(dict.fromkeys(r.arm for r in runs))
  return [a.name if isinstance(a, Arm) else a for a in arms]


def _stat(values: Sequence[float]) -> Stat:
  n = len(values)
  if not n:
    return Stat(float("nan"), float("nan"), 0)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
  return Stat(mean, std, n)


def summarize(runs: Sequence[Run], columns: Sequence[str],
              arms: Sequence[Arm | str] | None = None, include_unfinished: bool = False
              ) -> list[Row]:
  """Per arm (in `arms`' order; default: as they come in `runs`), each column's `Stat` over
  its runs' `final` values. Unfinished runs are left out unless `include_unfinished`; an arm
  without runs still gets a row (0 runs), so a table shows what is missing."""
  rows = []
  for name in _arm_names(arms, runs):
    mine = [r for r in runs if r.arm == name and (r.finished or include_unfinished)]
    cells = {}
    for col in columns:
      values = [r.final[col] for r in mine if col in r.final and math.isfinite(r.final[col])]
      cells[col] = _stat(values)
    rows.append(Row(arm=name, runs=len(mine), cells=cells))
  return rows


def _cell(stat: Stat, runs: int, digits: int) -> str:
  if not stat.n:
    return "–"
  text = f"{stat.mean:.{digits}f}"
  if stat.n > 1:
    text += f" ± {stat.std:.{digits}f}"
  if stat.n != runs:
    text += f" (n={stat.n})"
  return text


def summary_table(runs: Sequence[Run], columns: Sequence[str],
                  arms: Sequence[Arm | str] | None = None, digits: int = 3,
                  include_unfinished: bool = False) -> str:
  """`summarize` as a markdown table: one row per arm, "mean ± std" per column over the
  arm's seeds (std over seeds, ddof 1; a lone seed shows its value), the seed count in
  column n, and "(n=k)" where only k of them have that column."""
  rows = summarize(runs, columns, arms, include_unfinished)
  lines = ["| arm | n | " + " | ".join(columns) + " |",
           "|---|---:|" + "---:|" * len(columns)]
  for row in rows:
    lines.append(f"| {row.arm} | {row.runs} | "
                 + " | ".join(_cell(row.cells[c], row.runs, digits) for c in columns) + " |")
  return "\n".join(lines)


# ============================== Paired tests ==============================
#
# Arms of a comparison start from the same warm start at each seed and are scored on the
# same held-out tasks, so they are compared task by task (tree_rl.stats): per seed, the exact
# McNemar p; over seeds, a sign-flip test and a bootstrap interval over tasks (these runs'
# policies), and a t-interval over seeds (what another seed would do). The spread of
# per-seed differences is pooled over all of a notebook's comparisons of one kind (two seeds
# alone say little about a spread); the power figures say how many seeds a gap of
# POWER_GAP_TASKS tasks needs at that spread.

POWER_GAP_TASKS = 3
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class PairedRow:
  """One comparison over seeds (see `paired_row`): `higher` names what the difference
  measures, b's arm or, for one arm's two evals, its later stage."""

  label: str
  higher: str
  per_seed: tuple[tuple[int, float, int, int, float], ...]  # seed, diff, gained, lost, p
  pooled: stats.PooledComparison | None


@dataclasses.dataclass(frozen=True)
class Spread:
  """The per-seed differences' standard deviation pooled over comparisons, its degrees of
  freedom and the median task count (NaN, 0, 0 when no comparison has two seeds)."""

  sd: float
  dof: int
  tasks: float

  @classmethod
  def of(cls, rows: Sequence[PairedRow]) -> Spread:
    sd, dof = stats.pooled_sd([r.pooled.seed_differences for r in rows if r.pooled])
    tasks = [r.pooled.tasks for r in rows if r.pooled]
    return cls(sd, dof, statistics.median(tasks) if tasks else 0)

  def seeds_for(self, tasks: float) -> int:
    """Seeds for 80% power at a gap of `tasks` tasks (paired t-test, two-sided ALPHA)."""
    return stats.seeds_for_power(self.sd, tasks / self.tasks, alpha=ALPHA)

  def describe(self) -> str:
    if not self.dof:
      return "no comparison has two seeds, so the spread over seeds is unknown."
    return (f"the per-seed differences' standard deviation, pooled over these comparisons, is "
            f"{self.sd:.3f} ({self.dof} degrees of freedom). At that spread a paired t-test "
            f"over seeds (two-sided, α = {ALPHA}) has 80% power for a {POWER_GAP_TASKS}-task "
            f"gap ({POWER_GAP_TASKS / self.tasks:.3f}) at {self.seeds_for(POWER_GAP_TASKS)} "
            f"seeds, for a 1-task gap at {self.seeds_for(1)}.")


def _pair(run_a: Run, stage_a: str, run_b: Run, stage_b: str
          ) -> tuple[dict[str, float], dict[str, float]] | None:
  a, b = run_a.scores.get(stage_a), run_b.scores.get(stage_b)
  return (a, b) if a and b and set(a) == set(b) else None


def paired_row(runs: Sequence[Run], a: Arm | str, b: Arm | str, stage_a: str = "rl",
               stage_b: str = "rl") -> PairedRow:
  """b's `stage_b` eval against a's `stage_a` eval, paired on tasks at each seed both arms
  finished with those evals on the same tasks (a = b with stages "sft", "rl": what RL
  changed)."""
  a, b = _arm_names([a], runs)[0], _arm_names([b], runs)[0]
  by_seed = {(r.arm, r.seed): r for r in runs if r.finished}
  pairs, per_seed = [], []
  for seed in sorted({r.seed for r in runs}):
    pair = (_pair(by_seed[a, seed], stage_a, by_seed[b, seed], stage_b)
            if (a, seed) in by_seed and (b, seed) in by_seed else None)
    if pair:
      one = stats.compare_over_seeds([pair])
      gained = sum(pair[1][t] > pair[0][t] for t in pair[0])
      lost = sum(pair[1][t] < pair[0][t] for t in pair[0])
      pairs.append(pair)
      per_seed.append((seed, one.difference, gained, lost, one.p_value))
  same = a == b
  return PairedRow(label=f"{b}: {stage_b} - {stage_a}" if same else f"{b} - {a}",
                   higher=stage_b if same else b, per_seed=tuple(per_seed),
                   pooled=stats.compare_over_seeds(pairs) if pairs else None)


def verdict(row: PairedRow, spread: Spread) -> str:
  """Which side is higher, or that the comparison cannot separate them at α = ALPHA:
  "across seeds" when the t-interval over seeds (at the pooled `spread`) excludes 0; "on
  these runs" when only the test over tasks rejects (these seeds' policies differ; another
  seed's may not); else the seeds a POWER_GAP_TASKS-task gap needs at `spread`."""
  pooled = row.pooled
  sign = "higher" if pooled.difference > 0 else "lower"
  low, high = stats.seed_interval(pooled.seed_differences, spread.sd, spread.dof,
                                  level=1 - ALPHA)
  if low > 0 or high < 0:
    return f"{row.higher} {sign} across seeds"
  needs = f"≈ {spread.seeds_for(POWER_GAP_TASKS)} seeds" if spread.dof else "spread unknown"
  if pooled.p_value < ALPHA:
    return f"{row.higher} {sign} on these runs; across seeds not separable ({needs})"
  return f"not separable ({needs})"


def paired_table(rows: Sequence[PairedRow], spread: Spread | None = None) -> str:
  """`paired_row`s as a markdown table. Per seed: the difference, the tasks gained and lost,
  the exact McNemar p (the sign-flip p of fractional scores). Over seeds: the mean
  difference; its 95% bootstrap interval over tasks and the sign-flip p over tasks (these
  runs held fixed); its 95% t-interval over seeds at `spread` (default: the rows' own
  pooled spread); and the `verdict`."""
  spread = spread or Spread.of(rows)
  lines = ["| comparison | n | per seed: diff (gained/lost, exact p) | mean diff | "
           "95% CI, tasks | p, tasks | 95% CI, seeds | at α = 0.05 |",
           "|---|---:|---|---:|---|---:|---|---|"]
  for row in rows:
    if row.pooled is None:
      lines.append(f"| {row.label} | 0 | – | – | – | – | – | – |")
      continue
    pooled = row.pooled
    seeds = "; ".join(f"s{s}: {d:+.3f} ({g}/{l}, {p:.2g})" for s, d, g, l, p in row.per_seed)
    low, high = stats.seed_interval(pooled.seed_differences, spread.sd, spread.dof,
                                    level=1 - ALPHA)
    over_seeds = f"[{low:+.3f}, {high:+.3f}]" if math.isfinite(low) else "–"
    lines.append(f"| {row.label} | {pooled.seeds} | {seeds} | {pooled.difference:+.3f} | "
                 f"[{pooled.ci_low:+.3f}, {pooled.ci_high:+.3f}] | {pooled.p_value:.2g} | "
                 f"{over_seeds} | {verdict(row, spread)} |")
  return "\n".join(lines)


def paired_tables(runs: Sequence[Run], comparisons: Mapping[str, tuple]) -> str:
  """The paired tests of a notebook: per comparison ({title: (reference, arms)} or
  {title: (reference, arms, stage)}; stage "rl", the final greedy eval, by default), the
  reference against each other arm on that eval; then, once per arm, what RL changed (its
  final eval against its SFT warm start's, on the same tasks). The spread over seeds is
  pooled over all rows of one stage, and over the RL-against-SFT rows."""
  versus: dict[str, tuple[str, list[PairedRow]]] = {}
  for title, (reference, arms, *stage) in comparisons.items():
    ref, stage = _arm_names([reference], runs)[0], (stage or ["rl"])[0]
    versus[title] = (stage, [paired_row(runs, other, ref, stage, stage)
                             for other in _arm_names(arms, runs) if other != ref])
  parts = []
  for stage in dict.fromkeys(stage for stage, _ in versus.values()):
    # An arm in two comparisons counts once in the spread.
    unique = {r.label: r for st, rows in versus.values() if st == stage for r in rows}
    spread = Spread.of(list(unique.values()))
    parts += [f"### Paired tests: {title}\n\n{paired_table(rows, spread)}"
              for title, (st, rows) in versus.items() if st == stage]
    parts.append(f"Power, arm against arm on the {stage} eval: {spread.describe()}")
  names = list(dict.fromkeys(n for reference, arms, *_ in comparisons.values()
                             for n in _arm_names([reference, *arms], runs)))
  rl = [paired_row(runs, n, n, "sft", "rl") for n in names]
  rl_spread = Spread.of(rl)
  parts.append(f"### Paired tests: RL against the SFT warm start it began from\n\n"
               f"{paired_table(rl, rl_spread)}\n\nPower, RL against SFT: {rl_spread.describe()}")
  return "\n\n".join(parts)


# ============================== Plots ==============================


def _pyplot():
  """pyplot on the Agg backend, except in a notebook kernel, whose backend is kept."""
  import matplotlib  # noqa: PLC0415

  if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def _save(plt, fig, path: str | pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def curve(run: Run, metric: str) -> dict[int, float]:
  """step -> the run's finite value of `metric` in its RL and eval rows (SFT rows left out;
  of two rows at one step the later wins: the SFT eval over the base eval at step 0)."""
  out = {}
  for row in run.history:
    step, value = _number(row.get("step")), _number(row.get(metric))
    if row.get("phase") != "sft" and step is not None and value is not None and math.isfinite(
        value):
      out[int(step)] = value
  return out


def plot_curves(runs: Sequence[Run], metric: str, path: str | pathlib.Path,
                arms: Sequence[Arm | str] | None = None, title: str = "") -> pathlib.Path:
  """One line per arm: `metric` over steps, the mean over its seeds, with a ±1 std band
  where two or more seeds have the step. Saved as a PNG at `path`, which is returned."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.0, 3.6))
  for name in _arm_names(arms, runs):
    curves = [curve(r, metric) for r in runs if r.arm == name]
    steps = sorted({s for c in curves for s in c})
    if not steps:
      continue
    stats = [_stat([c[s] for c in curves if s in c]) for s in steps]
    mean = [s.mean for s in stats]
    ax.plot(steps, mean, marker="o", ms=3, label=name)
    banded = [(x, s) for x, s in zip(steps, stats) if s.n > 1]
    if banded:
      ax.fill_between([x for x, _ in banded], [s.mean - s.std for _, s in banded],
                      [s.mean + s.std for _, s in banded], alpha=0.2)
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.set_xlabel("step")
  ax.set_ylabel(metric)
  ax.set_title(title or metric)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  return _save(plt, fig, path)


def plot_bars(runs: Sequence[Run], column: str, path: str | pathlib.Path,
              arms: Sequence[Arm | str] | None = None, title: str = "") -> pathlib.Path:
  """One bar per arm: the mean of a `final` column over its finished seeds, ±1 std error
  bars; an arm without a value has no bar and "(no runs)" under its name. Saved as a PNG at
  `path`, which is returned."""
  plt = _pyplot()
  rows = summarize(runs, [column], arms)
  fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 1.5), 3.6))
  xs = list(range(len(rows)))
  stats = [r.cells[column] for r in rows]
  ax.bar(xs, [s.mean if s.n else 0.0 for s in stats],
         yerr=[s.std if s.n > 1 else 0.0 for s in stats], capsize=3,
         color=["C0" if s.n else "none" for s in stats])
  ax.set_xticks(xs, [r.arm if s.n else f"{r.arm}\n(no runs)" for r, s in zip(rows, stats)],
                rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(column)
  ax.set_title(title or column)
  return _save(plt, fig, path)


def plot_columns(runs: Sequence[Run], columns: Sequence[str], path: str | pathlib.Path,
                 arms: Sequence[Arm | str] | None = None, title: str = "",
                 xlabel: str = "") -> pathlib.Path:
  """One line per arm across several `final` columns (e.g. pass@1..k): the mean over its
  finished seeds, ±1 std error bars. Saved as a PNG at `path`, which is returned."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.0, 3.6))
  for row in summarize(runs, columns, arms):
    pts = [(i, row.cells[c]) for i, c in enumerate(columns) if row.cells[c].n]
    if pts:
      ax.errorbar([i for i, _ in pts], [s.mean for _, s in pts],
                  yerr=[s.std if s.n > 1 else 0.0 for _, s in pts], marker="o", ms=3,
                  capsize=3, label=row.arm)
  ax.set_xticks(list(range(len(columns))), list(columns), fontsize=8)
  ax.set_xlabel(xlabel)
  ax.set_title(title)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  return _save(plt, fig, path)


def write_tables(runs: Sequence[Run], folder: str | pathlib.Path, heading: str,
                 sections: Mapping[str, tuple[Sequence[Arm], Sequence[str]]],
                 paired: Mapping[str, tuple] | None = None,
                 extra: Mapping[str, str] | None = None) -> str:
  """One `summary_table` per section ({title: (arms, columns)}), then the `paired_tables` of
  the comparisons in `paired` ({title: (reference arm, arms[, stage])}), then any `extra`
  sections ({title: markdown}), under `heading`, written to `<folder>/tables.md`; returns
  the sections' markdown."""
  tables = "\n\n".join(
      [f"### {title}\n\n{summary_table(runs, columns, arms)}"
       for title, (arms, columns) in sections.items()]
      + ([paired_tables(runs, paired)] if paired else [])
      + [f"### {title}\n\n{text}" for title, text in (extra or {}).items()])
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "tables.md").write_text(f"## {heading}\n\n{tables}\n", encoding="utf-8")
  return tables


def show(item: str | pathlib.Path) -> None:
  """A table (markdown text) or a saved plot (a .png path): displayed in a notebook,
  printed elsewhere."""
  is_png = isinstance(item, pathlib.Path) or str(item).endswith(".png")
  if "ipykernel" in sys.modules:
    from IPython.display import Image, Markdown, display  # noqa: PLC0415

    display(Image(filename=str(item)) if is_png else Markdown(str(item)))
  else:
    print(f"plot: {item}" if is_png else item, flush=True)
