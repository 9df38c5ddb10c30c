"""What the trainer does around its RL loop: the stop signal every phase honours, and the
SFT warm start with its progress checkpointed.

A run goes through base eval -> SFT warm start -> SFT eval -> RL steps (with periodic
evals) -> final eval. A kill at any moment loses at most the phase's current unit of work:

- an evaluation is redone from its start (it changes no state; its result is saved with
  the next checkpoint, and a resumed run runs any evaluation that is due and missing);
- SFT resumes from its last progress checkpoint (`<workdir>/checkpoints_sft`, every
  `config.sft.ckpt_every_steps` steps), which also records the base eval; once SFT and its
  eval are done, the RL checkpoint at step 0 supersedes it and the folder is removed;
- RL resumes from its last checkpoint (`<workdir>/checkpoints`).

SIGINT and SIGTERM set `StopFlag.set`: the SFT loop stops after its current step and saves
its progress, the RL loop after its current step and saves a checkpoint, and an evaluation
stops at the engine's next call (`StopFlag.interrupting`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import logging

from tree_rl.algos.sft import order_by_system_prompt
from tree_rl.checkpoint import RunCheckpointer
from tree_rl.config_types import SFTSpec
from tree_rl.metrics import MetricWriter, Progress
from tree_rl.resume import RunState
from tree_rl.rollout.agent_loop import AgentLoop
from tree_rl.rollout.pipeline import RolloutInterrupted
from tree_rl.tree.batch import Packed, check_bad_trees
from tree_rl.tree.rollout_tree import RolloutTree


class Stopped(Exception):
  """A signal ended the run at a phase boundary; its progress is saved."""


class StopFlag:
  """SIGINT/SIGTERM set `set` (the process keeps running until a phase checks it).

  Installed in the main thread only (elsewhere, e.g. a notebook worker, no handler is
  installed and the default behaviour stays); `restore` puts the previous handlers back.
  """

  def __init__(self):
    self.set = False
    self._old: dict[int, Any] = {}
    self._on_signal: list[Callable[[], None]] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass

  def _handle(self, signum, frame):
    del frame
    logging.warning("signal %d: stopping at the end of this step (an evaluation stops now) "
                    "and saving progress", signum)
    self.set = True
    for fn in list(self._on_signal):
      fn()

  @contextlib.contextmanager
  def interrupting(self, fn: Callable[[], None]) -> Iterator[None]:
    """Calls `fn` (e.g. `VersionedEngine.interrupt`) on a signal while the block runs, or at
    once if a signal came before it; the block's RolloutInterrupted becomes Stopped."""
    if self.set:
      fn()
    self._on_signal.append(fn)
    try:
      yield
    except RolloutInterrupted as e:
      if not self.set:
        raise
      raise Stopped("stopped by a signal during an evaluation; it is redone on resume") from e
    finally:
      self._on_signal.remove(fn)

  def restore(self) -> None:
    """Puts back the signal handlers that were installed before this flag's."""
    for sig, old in self._old.items():
      signal.signal(sig, old)


def sft_warm_start(spec: SFTSpec, sft_state: Any, sft_step: Callable, teacher: AgentLoop,
                   train_tasks: Sequence[Any], pack: Callable[[Sequence[RolloutTree]], Packed],
                   progress: RunCheckpointer, run: RunState, writer: MetricWriter,
                   stop: StopFlag) -> Any:
  """Trains `spec.steps` SFT steps on the oracle's trajectories, from `run.sft_step`.

  Args:
    spec: config.sft.
    sft_state: the policy's TrainState with SFT's fresh optimizer state (config.sft.lr),
      placed on the mesh.
    sft_step: `(state, packed) -> (state, host metrics)` on a `tree.batch.Packed`, jitted
      and fitted to each batch's attention bound (`rl_step.ShapeFitter.wrap`).
    teacher: the agent loop on the oracle engine.
    train_tasks: the run's training tasks.
    pack: `tree.batch.pack_sound` with the buckets of one tree.
    progress: SFT's progress checkpointer. Step k holds the state after k SFT steps and
      `run` (base eval included); step 0 is written first, so the base eval is kept.
    run: the run's state; `run.sft_step` counts the SFT steps done (`sft_skipped` those
      skipped).
    writer: metrics (phase "sft", one row per SFT step).
    stop: the run's stop flag, checked after each step.

  Returns:
    The state after the last SFT step, still with SFT's optimizer state.

  Raises:
    Stopped: a signal came before the last SFT step ended; the SFT steps done are saved.
    RuntimeError: an oracle trajectory failed its tree checks (`check_bad_trees`).
  """
  done = run.sft_step
  if progress.latest_step() is None:
    run.sft_step = 0
    progress.save(0, sft_state, run.to_json())  # records the base eval
  else:
    sft_state, _ = progress.restore(sft_state)
  n = spec.tasks_per_step
  order = order_by_system_prompt(list(train_tasks), n)
  shown = Progress("SFT", spec.steps, "steps", start=done, primary=writer.primary)
  for i in range(done, spec.steps):
    if stop.set:  # a signal before this step (e.g. during the base eval)
      if progress.latest_step() != i:
        progress.save(i, sft_state, run.to_json())
      raise Stopped(f"stopped by a signal before SFT step {i + 1}; its progress is saved")
    tasks = [order[(i * n + j) % len(order)] for j in range(n)]
    # One tree per step: the step's trajectories store their shared prompt once.
    trees = [t for t in teacher.rollout(tasks) if t.leaves]
    packed = pack([RolloutTree.merge_prompts(trees)])
    check_bad_trees(i, packed.bad, 1, 0.0)  # the oracle's own trajectories: none may fail
    sft_state, m = sft_step(sft_state, packed)
    row = {k: float(v) for k, v in m.items()}
    if row.get("sft/skipped"):  # non-finite loss, gradient or new weights: the state is kept
      run.sft_skipped += 1
      logging.warning("SFT step %d skipped: its loss (%g), gradient norm (%g) or new parameters' "
                      "norm (%g) is not finite, so the state before it is kept (sft/skipped=1; "
                      "%d SFT step(s) skipped so far). Persistent skips mean a too large "
                      "config.sft.lr or bad SFT data.", i + 1, row.get("sft/loss", float("nan")),
                      row.get("sft/l2_grads", float("nan")),
                      row.get("sft/l2_params", float("nan")), run.sft_skipped)
    writer.write(i, row, phase="sft")
    shown.update(i + 1, f"loss {row.get('sft/loss', float('nan')):.4f}")
    run.sft_step = i + 1
    if (i + 1) % spec.ckpt_every_steps == 0 or i + 1 == spec.steps or stop.set:
      progress.save(i + 1, sft_state, run.to_json())
    if stop.set and i + 1 < spec.steps:
      raise Stopped(f"stopped by a signal after SFT step {i + 1}; its progress is saved")
  return sft_state
