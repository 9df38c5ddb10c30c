"""What a run remembers besides its weights (`RunState`), and where a run resumes from
(`restore`).

A run resumes from the first of these that exists:
1. this workdir's RL checkpoint (`<workdir>/checkpoints`, the newest step that verifies);
2. this workdir's SFT progress (`<workdir>/checkpoints_sft`), before the first RL checkpoint:
   the SFT phase restores its own state from it, and the run state (base eval, SFT steps)
   comes from it here;
3. `config.resume`: another run's checkpoint, read only (its weights and run state);
4. nothing: the configured model, from step 0.

The RL checkpoint at step 0 (written after SFT and its eval) supersedes the SFT progress,
whose folder is then removed (`tree_rl.phases`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from typing import Any

from absl import logging

from tree_rl.checkpoint import RunCheckpointer, write_run_config
from tree_rl.metrics import MetricWriter


@dataclasses.dataclass
class RunState:
  """A run's progress, saved as each checkpoint's JSON metadata.

  Attributes:
    step: RL steps done.
    data_position: prompts of the data order consumed (a resume takes the next ones).
    eval: each finished evaluation's metrics by stage ("base", "sft", "step<k>", "rl").
    sft_done: the SFT warm start and its eval are done.
    sft_step: SFT steps done.
    sft_skipped: SFT steps skipped for a non-finite update.
    method_state: the JSON part of the strategy's learned state (TRACE's predictor), as of
      the checkpoint's step; None for a strategy that learns nothing.
  """

  step: int = 0
  data_position: int = 0
  eval: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  sft_done: bool = False
  sft_step: int = 0
  sft_skipped: int = 0
  method_state: Any = None

  def to_json(self) -> dict[str, Any]:
    """The checkpoint metadata: every field, `method_state` left out when None."""
    out = dataclasses.asdict(self)
    if out["method_state"] is None:
      del out["method_state"]
    return out

  @classmethod
  def from_json(cls, meta: dict[str, Any]) -> RunState:
    """The state a checkpoint's metadata holds (a field it lacks keeps its default).

    Raises:
      ValueError: `meta` has a key that is not a RunState field.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(meta) - names)
    if unknown:
      raise ValueError(f"checkpoint metadata has unknown field(s) {unknown}; a RunState has "
                       f"{sorted(names)}")
    return cls(**meta)


@dataclasses.dataclass
class Restored:
  """Where the run goes on from.

  Attributes:
    state: the TrainState (restored, or the one passed in).
    run: the run's progress.
    ckpt: this workdir's RL checkpointer (the run saves here).
    sft_progress: the SFT progress checkpointer while SFT is not superseded, else None.
    source: the checkpointer restored from (ckpt, sft_progress or config.resume's), or None.
  """

  state: Any
  run: RunState
  ckpt: RunCheckpointer
  sft_progress: RunCheckpointer | None
  source: RunCheckpointer | None


def restore(workdir: pathlib.Path, config_dict: dict[str, Any], cfg: Any, state: Any,
            writer: MetricWriter, *, allow_config_change: bool = False,
            primary: bool = True) -> Restored:
  """Restores the run in `workdir` in the order of this module's docstring.

  Writes (or, resuming, checks) `<workdir>/config.json` against `config_dict`
  (`checkpoint.write_run_config`), and keeps in `writer`'s metrics.jsonl only the rows of
  what the restored checkpoint holds (redone steps are logged once), plus a row naming the
  steps that did not verify when an older one was restored. A superseded SFT progress
  folder is removed.

  Args:
    workdir: the run's folder.
    config_dict: the run's config as plain values (what config.json holds).
    cfg: the validated RunConfig (keep_checkpoints, sft.steps, resume).
    state: the freshly built, placed TrainState, the target a checkpoint restores into.
    writer: the run's metric writer.
    allow_config_change: resume even if the config differs from the saved one.
    primary: this process writes files (process 0); the others only check.

  Returns:
    The Restored state, run state and checkpointers. Resuming SFT progress restores only
    the run state; the SFT phase restores its own TrainState.

  Raises:
    ValueError: the config differs from the saved one (without `allow_config_change`), or
      the checkpoint was written by another configuration.
    FileNotFoundError: `config.resume` holds no checkpoint.
    checkpoint.CheckpointRejectedError: no step of the checkpoint restored from verifies.
  """
  ckpt = RunCheckpointer(workdir / "checkpoints", keep_last=cfg.keep_checkpoints)
  sft_dir = workdir / "checkpoints_sft"
  sft_progress = None
  if ckpt.latest_step() is None and cfg.sft.steps:
    sft_progress = RunCheckpointer(sft_dir, keep_last=1)
  elif sft_dir.exists() and primary:  # superseded by the RL checkpoint
    shutil.rmtree(sft_dir)
  own = ckpt if ckpt.latest_step() is not None else (
      sft_progress if sft_progress is not None and sft_progress.latest_step() is not None
      else None)
  write_run_config(workdir, config_dict, resuming=own is not None,
                   allow_change=allow_config_change, write=primary)
  source = own if own is not None else (RunCheckpointer(cfg.resume, read_only=True)
                                        if cfg.resume else None)
  run = RunState()
  if source is sft_progress and source is not None:  # the SFT phase restores its own state
    run = RunState.from_json(sft_progress.restore_meta())
    logging.info("resuming SFT after step %d", run.sft_step)
  elif source is not None:
    state, meta = source.restore(state)
    run = RunState.from_json(meta)
    logging.info("resumed from %s at step %d", source.directory, run.step)
  writer.keep_only(lambda row: own is not None and kept_row(row, run))
  if source is not None and source.rejected:  # steps that did not verify: an older one resumed
    writer.write(run.step, source.fallback_metrics(), phase="checkpoint")
  return Restored(state, run, ckpt, sft_progress, source)


def kept_row(row: dict[str, Any], run: RunState) -> bool:
  """Whether a metrics.jsonl row belongs to what a checkpoint with `run` holds."""
  phase = row.get("phase", "rl")
  if phase == "sft":
    return run.sft_done or row["step"] < run.sft_step
  if phase.startswith("eval:"):
    return phase[len("eval:"):] in run.eval
  return row["step"] <= run.step
