"""Metrics: a JSONL log of every metric, TensorBoard event files, a console progress line,
phase timers, and the end-of-run summary table and curves PNG."""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import sys
import time
from collections.abc import Iterator, Mapping

from absl import logging


class MetricWriter:
  """Writes `{step, phase, **metrics}` lines to `<workdir>/metrics.jsonl` and TensorBoard
  scalars. `phase` says what wrote the row: "rl" (a training step), "sft" (a warm-start
  step) or "eval:<stage>" (an evaluation), so each (phase, step) has one row.

  `primary=False` (every process but 0 of a multi-process run, which computes the same
  metrics): nothing is written or printed; `history` is kept all the same.
  """

  def __init__(self, workdir: str | pathlib.Path, primary: bool = True):
    self.workdir, self.primary = pathlib.Path(workdir), primary
    self.jsonl = self.tb = None
    if primary:
      self.workdir.mkdir(parents=True, exist_ok=True)
      self.jsonl = open(self.workdir / "metrics.jsonl", "a", encoding="utf-8")
      from tensorboardX import SummaryWriter  # imported late: slow, only the trainer needs it
      self.tb = SummaryWriter(str(self.workdir / "tensorboard"))
    self.history: list[dict] = []

  def keep_only(self, keep) -> int:
    """Rewrites metrics.jsonl with the rows for which `keep(row)` holds (atomically: a
    temporary file, then a rename) and returns how many were dropped. A resumed run calls
    it with what its checkpoint holds, so steps it redoes are not logged twice."""
    if not self.primary:
      return 0
    path = self.workdir / "metrics.jsonl"
    self.jsonl.close()
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):  # a kill in the middle of a write: the row is lost
      lines.pop()                          # with its step, which the resumed run redoes
    rows = []
    for number, line in enumerate(lines, 1):
      if not line:
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:  # a damaged row: the step it logged is not lost
        logging.warning("%s line %d is not JSON (%s); skipped", path, number, e)
        continue
      if not isinstance(rows[-1], dict):
        logging.warning("%s line %d is not a row object; skipped", path, number)
        rows.pop()
    kept = [r for r in rows if keep(r)]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(path)
    self.jsonl = open(path, "a", encoding="utf-8")
    return len(rows) - len(kept)

  def write(self, step: int, metrics: Mapping[str, float], phase: str = "rl") -> None:
    row: dict = {"step": int(step), "phase": phase}
    for k, v in metrics.items():
      v = float(v)
      row[k] = v if math.isfinite(v) else str(v)
      if math.isfinite(v) and self.primary:
        self.tb.add_scalar(k, v, step)
    self.history.append(row)
    if self.primary:
      self.jsonl.write(json.dumps(row) + "\n")
      self.jsonl.flush()
      self.tb.flush()

  def close(self) -> None:
    if self.primary:
      self.jsonl.close()
      self.tb.close()


class Progress:
  """Console progress of one phase: `done` of `total` units, with a rate and ETA measured
  from this phase's own start (so the RL ETA does not count SFT and the evals).

  `update` prints at most once every `every_s` seconds, and always for the first and the
  last unit. Only the primary process prints.

  Args:
    phase: the name printed in brackets, e.g. "eval sft", "SFT", "RL".
    total: units in the phase.
    unit: what a unit is, e.g. "steps", "turns".
    start: units already done when the phase (re)starts here (a resumed run).
    primary: whether this process prints.
    every_s: the least time between two lines.
  """

  def __init__(self, phase: str, total: int, unit: str, start: int = 0, primary: bool = True,
               every_s: float = 0.0):
    self.phase, self.total, self.unit, self.start = phase, total, unit, start
    self.primary, self.every_s = primary, every_s
    self.t0 = time.time()
    self.last = -math.inf

  def update(self, done: int, text: str = "") -> None:
    now = time.time()
    if not self.primary or (now - self.last < self.every_s and done not in
                            (self.start + 1, self.total)):
      return
    self.last = now
    elapsed = now - self.t0
    rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
    eta = f"ETA {(self.total - done) / rate:.0f}s" if rate > 0 else "ETA ?"
    if done >= self.total:
      eta = f"done in {elapsed:.0f}s"
    text = f" {text}" if text else ""
    print(f"[{self.phase} {done}/{self.total} {self.unit}]{text} | {eta}", file=sys.stderr,
          flush=True)

  def note(self, unit: int, text: str, every_s: float = 30.0) -> None:
    """A line from inside unit `unit` (1-based) when `every_s` passed since the last line:
    a phase whose units take minutes (an RL step on a CPU) still reports at least once a
    minute, e.g. `[RL step 3/5] mini-batch 2/4 branched and updated`."""
    now = time.time()
    if not self.primary or now - self.last < every_s:
      return
    self.last = now
    print(f"[{self.phase} {self.unit.rstrip('s')} {unit}/{self.total}] {text}",
          file=sys.stderr, flush=True)


class PhaseTimer:
  """Accumulates wall time per phase: `with timer("rollout"): ...` -> time/rollout.

  `pop()` hands over the totals since the last pop (a step's row); `run` keeps
  [seconds, calls] per phase for the whole process, which `table()` prints at the end of a
  run: where the time went, phase by phase.
  """

  def __init__(self):
    self.totals: dict[str, float] = {}
    self.run: dict[str, list] = {}
    self.started = time.perf_counter()

  @contextlib.contextmanager
  def __call__(self, name: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
      yield
    finally:
      self.add(name, time.perf_counter() - t)

  def add(self, name: str, seconds: float) -> None:
    self.totals[name] = self.totals.get(name, 0.0) + seconds
    tot = self.run.setdefault(name, [0.0, 0])
    tot[0] += seconds
    tot[1] += 1

  def pop(self) -> dict[str, float]:
    out = {f"time/{k}": v for k, v in self.totals.items()}
    self.totals = {}
    return out

  def table(self) -> str:
    """Seconds, calls and share of this process's wall time per phase, largest first; the
    rest (start-up outside `setup`, logging, summaries) is `other`."""
    wall = time.perf_counter() - self.started
    rows = sorted(self.run.items(), key=lambda kv: -kv[1][0])
    rows.append(("other", [wall - sum(v[0] for _, v in rows), 0]))
    lines = [f"{'phase':<14} {'calls':>6} {'seconds':>9} {'share':>7}"]
    lines += [f"{name:<14} {calls or '':>6} {sec:>9.1f} {sec / max(wall, 1e-9):>7.1%}"
              for name, (sec, calls) in rows]
    lines.append(f"{'wall':<14} {'':>6} {wall:>9.1f} {1:>7.1%}")
    return "\n".join(lines)


def summary_table(rows: Mapping[str, Mapping[str, float]], keys: list[str]) -> str:
  """A fixed-width table: one row per stage (e.g. base / sft / rl), one column per key."""
  width = max([len(k) for k in keys] + [8])
  head = f"{'stage':<8} " + " ".join(f"{k:>{width}}" for k in keys)
  lines = [head, "-" * len(head)]
  for stage, m in rows.items():
    lines.append(f"{stage:<8} " + " ".join(f"{m.get(k, float('nan')):>{width}.4f}" for k in keys))
  return "\n".join(lines)


def plot_curves(history: list[dict], path: str | pathlib.Path, keys: list[str]) -> None:
  """A PNG with one panel per metric key over steps (rows lacking a key are skipped)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
  for ax, key in zip(axes[0], keys):
    pts = [(r["step"], r[key]) for r in history if isinstance(r.get(key), float)]
    if pts:
      ax.plot(*zip(*pts), marker="o", ms=3)
    ax.set_title(key)
    ax.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
