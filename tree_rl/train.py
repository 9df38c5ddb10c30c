"""`train_and_evaluate(config, workdir)`: the one training entry (CLI, tests, notebooks).

A run: setup -> restore (`tree_rl.resume`) -> base eval -> SFT warm start on the family's
oracle trajectories, masked exactly like RL (`tree_rl.phases`) -> SFT eval -> RL steps ->
final eval, with checkpoints and periodic evals between steps. Each RL step grows one tree
per prompt (`rl_step.StepProducer`: the agent loop, the family's verifier on each leaf, the
configured reasoning judge, the formatting rubric), packs the trees and updates the policy
(`rl_step.rl_step`: advantages by the configured estimator, PPO epochs x mini-batches), and
syncs the new weights to the rollout engine (`rollout.session.Rollout.sync`). Held-out
accuracy is printed per stage at the end, with RL paired against its start.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import json
import pathlib
import shutil
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from tree_rl import distributed
from tree_rl import metrics as metrics_lib
from tree_rl import stats
from tree_rl.algos import ppo
from tree_rl.checkpoint import method_state, restore_method_state, save_run
from tree_rl.config_types import RunConfig
from tree_rl.device_memory import apply_learner_memory_fraction
from tree_rl.envs import make_family
from tree_rl.evaluate import EvalReport
from tree_rl.phases import StopFlag, Stopped, sft_warm_start
from tree_rl.placement import Placement
from tree_rl.policy import build_run_policy, make_optimizer
from tree_rl.resume import RunState, restore
from tree_rl.rewards.reasoning import REASONING_CHANNEL, make_reasoning_scorer
from tree_rl.rl_step import (LOGPROB_CHUNK, TOKEN_BUCKETS, Learner, ShapeFitter, StepProducer,
                             StepResult, buckets, rl_step)
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import SamplingParams
from tree_rl.rollout.pipeline import RolloutPipeline, staleness
from tree_rl.rollout.policy import oracle_engine
from tree_rl.rollout.session import Evaluator, Rollout, check_vllm
from tree_rl.rollout.strategies import model_scorer
from tree_rl.tree.batch import Buckets, check_bad_trees, pack_sound

EVAL_KEYS = ["accuracy", "mean_reward", "avg_tool_steps", "unanswerable_rate",
             "avg_formatting_raw"]

# The evaluations' sampling stream: fold_in(key(seed), EVAL_STREAM), apart from every step's
# fold_in(key(seed), step) and update key fold_in(key(seed), 10**6 + step).
EVAL_STREAM = 2**31 - 1


def _paired_comparisons(workdir: pathlib.Path) -> list[str]:
  """RL against its start (the SFT policy, else the base model) on the same eval tasks: the
  exact McNemar p and a paired bootstrap interval (`tree_rl.stats`), as lines, also written
  to eval_comparison.json. Empty when the run has not both evaluations; a line saying why
  when they scored different tasks (a resume that changed the eval tasks)."""
  stages = [s for s in ("base", "sft", "rl") if (workdir / f"eval_{s}.json").exists()]
  if "rl" not in stages or len(stages) < 2:
    return []
  start = "sft" if "sft" in stages else "base"
  correct = {s: {e.task_id: e.correct for e in
                 EvalReport.from_json(str(workdir / f"eval_{s}.json")).episodes}
             for s in (start, "rl")}
  try:
    result = stats.compare(correct[start], correct["rl"])
  except ValueError as e:  # the run's work is saved: say why there is no test, do not fail
    return [f"rl - {start}: no paired test ({e})"]
  (workdir / "eval_comparison.json").write_text(json.dumps(
      {"a": start, "b": "rl", **dataclasses.asdict(result), "difference": result.difference},
      indent=1) + "\n", encoding="utf-8")
  return [result.describe(start, "rl")]


def _plan(cfg: RunConfig, run: RunState, num_eval: int, turns: int) -> str:
  """What the run will do, phase by phase with its size (what a resume skips marked done)."""
  size = f"{num_eval} tasks, {turns} turns"
  phases = [("eval base", size, "base" in run.eval)] if cfg.eval_base else []
  if cfg.sft.steps:
    sft_done = run.sft_done or run.sft_step >= cfg.sft.steps
    phases += [("SFT", f"{cfg.sft.steps} steps x {cfg.sft.tasks_per_step} oracle tasks",
                sft_done), ("eval sft", size, "sft" in run.eval)]
  if cfg.num_steps:
    every = (f", an eval every {cfg.eval_every_steps} steps" if cfg.eval_every_steps else "")
    phases += [("RL", f"{cfg.num_steps} steps x {cfg.prompts_per_step} prompts, "
                      f"{cfg.algo.estimator} advantages, {cfg.rollout.strategy} rollouts{every}",
                run.step >= cfg.num_steps),
               ("eval rl", size, "rl" in run.eval)]
  lines = [f"  {'done ' if done else '     '}{name}: {size}" for name, size, done in phases]
  return "tree_rl plan (progress lines follow each phase):\n" + "\n".join(lines)


def _isolation(family: Any) -> str | None:
  """How a family that runs model code isolates it (`task.kwargs.sandbox`), else None. The
  audit hook alone is no boundary, so such a run says so here and in every metric row."""
  isolation = getattr(family, "sandbox", None)
  if isolation == "audit":
    logging.warning("SANDBOX: task.kwargs.sandbox=audit: the python tool runs model code "
                    "under an in-process audit hook only, which is NOT a security boundary "
                    "(no kernel namespaces); install bubblewrap and drop the setting")
  return isolation


def _eval_due(cfg: RunConfig, run: RunState, step: int) -> bool:
  """Whether config.eval_every_steps's eval is due after `step`. It comes after the step's
  checkpoint (whose run state lacks it), so a resumed run redoes a lost one first."""
  return bool(cfg.eval_every_steps and step % cfg.eval_every_steps == 0
              and 0 < step < cfg.num_steps and f"step{step}" not in run.eval)


def _learner(cfg: RunConfig, ppo_config: ppo.PPOConfig, placement: Placement, optimizer: Any,
             fit: ShapeFitter, unscored: tuple[str, ...], vocab: int) -> Learner:
  """How the run's steps update (`rl_step.Learner`): APPO's per-mini-batch branching
  (`RunConfig.branches_per_minibatch`) and an estimator with per-mini-batch advantages at
  one epoch update one mini-batch per call, each packed on its own; every other run
  updates once over the step's batch."""
  a = cfg.algo
  branch = cfg.branches_per_minibatch()
  split = branch or (a.num_minibatches > 1 and a.num_epochs == 1
                     and ppo.advantages_per_minibatch(ppo_config))
  if split:
    config = dataclasses.replace(ppo_config, num_minibatches=1)
    trees = placement.trees_bucket(-(-cfg.prompts_per_step // a.num_minibatches))
  else:
    config, trees = ppo_config, placement.trees_bucket(cfg.prompts_per_step, a.num_minibatches)
  packing = buckets(trees)
  logging.info("%s", placement.geometry(cfg.prompts_per_step, trees))
  return Learner(update=fit.wrap(placement.update_step(config, optimizer)),
                 pack=lambda ts: pack_sound(ts, packing, unscored, vocab, fit.block),
                 num_parts=a.num_minibatches if split else 1, branch_between=branch,
                 trace_ratio=cfg.rollout.strategy == "trace")


def _record_eval(run: RunState, writer: metrics_lib.MetricWriter, workdir: pathlib.Path,
                 stage: str, step: int, report: EvalReport) -> dict[str, float]:
  """Keeps eval `stage`'s metrics in the run state and metrics.jsonl, and (process 0) its
  report and transcripts in `workdir`."""
  m = {k: float(report.metrics[k]) for k in EVAL_KEYS}
  run.eval[stage] = m
  writer.write(step, {f"eval/{k}": v for k, v in m.items()}, phase=f"eval:{stage}")
  if writer.primary:
    report.to_json(str(workdir / f"eval_{stage}.json"))
    report.write_transcripts(str(workdir / f"eval_{stage}_transcripts.jsonl"))
  return m


def _step_row(result: StepResult, rollout: Rollout, reasoning: Any,
              timer: metrics_lib.PhaseTimer) -> dict[str, float]:
  """A step's metrics row: the update's metrics, staleness, bad trees, rewards and rollout
  counts over every tree rolled out (dropped groups included; a bad tree's non-finite
  rewards left out), phase times, and the fleet's and judge's counters."""
  row: dict[str, float] = dict(staleness(result.trained))
  row["rollout/bad_trees"] = float(len(result.bad))
  if result.metrics is not None:
    row.update({k: float(np.asarray(v)) for k, v in result.metrics.items()})
  got = result.rollout
  leaves = [leaf for t in got.trees for leaf in t.leaves]
  outcomes = [lf.rewards["outcome"] for lf in leaves if np.isfinite(lf.rewards["outcome"])]
  row.update({
      "reward/outcome_mean": float(np.mean(outcomes)) if outcomes else float("nan"),
      "rollout/empty_trees": float(sum(not t.leaves for t in got.trees)), **timer.pop(),
      **got.metrics(), **rollout.metrics()})
  if reasoning is not None:
    row.update(reasoning.step_metrics([lf.rewards for lf in leaves]))
  return row


def release_memory() -> None:
  """Gives back what a finished run leaves behind once its objects are gone: the cycles
  only `gc` frees (device buffers among them) and the heap that glibc keeps for reuse
  (`malloc_trim`; a no-op off glibc). JAX's caches of compiled programs are kept, so a later
  run of the same shapes reuses them; a sweep over different models in one process can call
  `jax.clear_caches()` between runs (docs/performance.md#runs-one-after-another-in-one-process).
  """
  gc.collect()
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except (OSError, AttributeError):  # not glibc (macOS, musl): its heap is its own
    pass


def _releasing_memory(fn):
  """`fn`, then `release_memory` once its frame (the run's objects) is gone, if it left
  device arrays behind. A run refused at start-up (a bad config) has placed none, and
  skips the full collection (0.6-0.8 s in a test worker of 900,000 objects)."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    arrays = len(jax.live_arrays())
    try:
      return fn(*args, **kwargs)
    finally:
      if len(jax.live_arrays()) != arrays:
        release_memory()

  return wrapper


def _summarize(run: RunState, writer: metrics_lib.MetricWriter, timer: metrics_lib.PhaseTimer,
               workdir: pathlib.Path) -> None:
  """Prints the eval table, RL against SFT (McNemar, paired bootstrap) and where the time
  went; writes phases.txt and curves.png."""
  print(metrics_lib.summary_table(run.eval, EVAL_KEYS), flush=True)
  for line in _paired_comparisons(workdir):
    print(line, flush=True)
  phases = timer.table()
  print(phases, flush=True)
  (workdir / "phases.txt").write_text(phases + "\n", encoding="utf-8")
  metrics_lib.plot_curves(writer.history, workdir / "curves.png",
                          ["reward/outcome_mean", "eval/accuracy"])


@_releasing_memory
def train_and_evaluate(config: Any, workdir: str, allow_config_change: bool = False
                       ) -> dict[str, Any]:
  """Runs the configured experiment in `workdir`, resuming the run already there.

  A SIGINT or SIGTERM ends the run early with its progress saved (an evaluation at the
  engine's next call, an SFT or RL step once it is done), and the call returns normally
  (docs/faults.md#kills-signals-and-resume).

  Args:
    config: the experiment's ConfigDict (or a plain dict), as a `configs/*.py` returns it;
      validated once into a `RunConfig`.
    workdir: the run's folder (created if missing): checkpoints, config.json,
      metrics.jsonl, eval reports and transcripts, phases.txt, curves.png.
    allow_config_change: let a resume use a config that differs from the saved
      config.json outside `checkpoint.RESUMABLE_FIELDS`.

  Returns:
    {"eval": {stage: eval metrics} (stages "base", "sft", "step<k>", "rl"), "steps": the
    last RL step done, "history": the metrics rows, "state": the final TrainState}. Nothing
    else of the run outlives the call (`release_memory`).

  Raises:
    ValueError: an invalid config, or one the machine or the process group cannot run
      (each names the field); a resume whose config changed (`write_run_config`).
    RuntimeError: more than config.rollout.max_bad_tree_fraction of a step's trees failed
      their checks (`tree.batch.check_bad_trees`); no step of the checkpoint to resume
      from verifies (`checkpoint.CheckpointRejectedError`); JAX started before the process
      group was joined (`distributed.initialize`).
    FloatingPointError: config.algo.max_skipped_steps updates in a row were skipped for a
      non-finite loss or gradient norm.
  """
  # ============================== Setup ==============================
  cfg = RunConfig.from_config_dict(config)  # validation happens here, before any compile
  apply_learner_memory_fraction(cfg.rollout)  # JAX's GPU share, or a clear error if too late
  distributed.initialize(cfg.distributed)  # several processes: joined before any device use
  distributed.check_supported(cfg.rollout.engine, cfg.rollout.strategy, cfg.rollout.backend,
                              cfg.rollout.max_staleness)
  cfg.model.check_backend(jax.default_backend())  # e.g. the Pallas kernel on a CPU
  primary = distributed.is_primary()  # process 0 writes the files; all compute the same
  r = cfg.rollout
  workdir_path = pathlib.Path(workdir)
  workdir_path.mkdir(parents=True, exist_ok=True)
  family = make_family(cfg.task.family, **cfg.task.kwargs)
  isolation = _isolation(family)
  vllm_python = check_vllm(cfg)  # before any compile
  train_tasks = family.generate("train", cfg.task.num_train_tasks, cfg.task.seed)
  eval_tasks = family.generate("eval", cfg.task.num_eval_tasks, cfg.task.eval_task_seed)
  # The reasoning judge scores every leaf into channel "reasoning" (AWPO's R_reason); a
  # leaf it could not score is NaN for AWPO, whose group then uses the outcome alone.
  reasoning = make_reasoning_scorer(cfg.judge.kind, family, train_tasks, cfg.judge.judge_config())
  unscored = (REASONING_CHANNEL,) if cfg.algo.estimator == "awpo" else ()
  writer = metrics_lib.MetricWriter(workdir_path, primary=primary)
  timer = metrics_lib.PhaseTimer()
  # Held-out evaluation runs the family's own turn limit, whatever the strategy's rollouts
  # use (rollout.max_turns, PORTool's t_max): every arm of a comparison is scored alike.
  turns = family.max_turns

  # ============================== Mesh, policy & optimizer ==============================
  placement = Placement.from_spec(cfg.mesh)  # fails here on a mesh the devices cannot form
  model, tokenizer = build_run_policy(cfg)
  chat = ChatFormat.from_tokenizer(tokenizer)
  optimizer = make_optimizer(cfg.optim.lr, cfg)
  loss_config = cfg.algo.loss_config()
  placement.check_replication(model, cfg.mesh.max_replicated_fraction)  # before any compile
  state = placement.place_state(ppo.init_state(model, optimizer,
                                               with_ref=loss_config.kl_coef > 0))
  ppo_config = ppo.PPOConfig(
      loss=loss_config, estimator=cfg.algo.estimator,
      estimator_config=cfg.estimator_config(),  # DAPO's overlong lengths fit to the run
      num_epochs=cfg.algo.num_epochs, num_minibatches=cfg.algo.num_minibatches,
      logprob_chunk=LOGPROB_CHUNK)

  # ============================== Restore ==============================
  restored = restore(workdir_path,
                     config.to_dict() if hasattr(config, "to_dict") else dict(config), cfg,
                     state, writer, allow_config_change=allow_config_change, primary=primary)
  state, run, ckpt = restored.state, restored.run, restored.ckpt
  if primary:
    print(_plan(cfg, run, len(eval_tasks), turns), file=sys.stderr, flush=True)

  # ============================== Rollout, update & eval ==============================
  rollout = Rollout(
      cfg, state, tokenizer, chat, family, estimator_config=ppo_config.estimator_config,
      scorer=functools.partial(model_scorer, buckets=Buckets(
          tokens=TOKEN_BUCKETS, trees=placement.tree_buckets()),
                               place_batch=placement.place_batch),
      leaf_rewards=reasoning, rollout_model=placement.rollout_model, workdir=workdir_path,
      timer=timer, vllm_python=vllm_python)
  if restored.source is not None and restored.source is not restored.sft_progress:
    restore_method_state(rollout.strategy, restored.source, run.to_json())
  fit = ShapeFitter(model)  # each batch's tightest blockwise bound
  learner = _learner(cfg, ppo_config, placement, optimizer, fit, unscored, model.config.vocab_size)
  # DAPO's dynamic sampling judges a group by the estimator's outcome reward.
  mixed = ppo_config.estimator_config.reward_channels if r.dynamic_sampling else None
  evaluator = Evaluator(family, eval_tasks, rollout.engine, chat, max_new_tokens=r.max_new_tokens,
                        max_turns=turns, key=jax.random.fold_in(jax.random.key(cfg.seed),
                                                                EVAL_STREAM),
                        own_stream=not r.max_staleness, primary=primary)
  timer.add("setup", time.perf_counter() - timer.started)  # config to policy and engines
  stop, pipeline = StopFlag(), None
  try:
    if cfg.eval_base and "base" not in run.eval:
      with timer("eval"):
        _record_eval(run, writer, workdir_path, "base", 0, evaluator("base", stop))
      if not cfg.sft.steps:  # with SFT, its progress checkpoint at step 0 keeps the base eval
        with timer("checkpoint"):
          save_run(ckpt, 0, state, run.to_json(), method_state(rollout.strategy))

    # ============================== SFT warm start ==============================
    if cfg.sft.steps and not run.sft_done:
      teacher = AgentLoop(oracle_engine(train_tasks, chat), chat, family, AgentConfig(
          samples_per_task=1, max_turns=r.max_turns or None,
          max_context_tokens=1 << 20, sampling=SamplingParams(max_new_tokens=1 << 14)))
      sft_opt = make_optimizer(cfg.sft.lr, cfg)
      with timer("sft"):
        sft_state = sft_warm_start(
            cfg.sft, placement.place_state(state.replace(opt_state=sft_opt.init(state.params))),
            fit.wrap(placement.sft_step(sft_opt, LOGPROB_CHUNK)), teacher, train_tasks,
            functools.partial(pack_sound, buckets=buckets(placement.trees_bucket(1)),
                              attention_block=fit.block),
            restored.sft_progress, run, writer, stop)
      state = placement.place_state(sft_state.replace(opt_state=optimizer.init(sft_state.params)))
      rollout.sync(state)
      run.sft_done = True
      with timer("eval"):
        _record_eval(run, writer, workdir_path, "sft", 0, evaluator("sft", stop))
      with timer("checkpoint"):  # supersedes SFT's progress
        save_run(ckpt, 0, state, run.to_json(), method_state(rollout.strategy))
      restored.sft_progress.close()
      if primary:
        shutil.rmtree(workdir_path / "checkpoints_sft")

    # ============================== Train loop ==============================
    start, skipped = run.step, []
    shown = metrics_lib.Progress("RL", cfg.num_steps, "steps", start=start, primary=primary)
    base_key = jax.random.key(cfg.seed)
    if _eval_due(cfg, run, start):
      with timer("eval"):
        _record_eval(run, writer, workdir_path, f"step{start}", start,
                     evaluator(f"step{start}", stop))
    # S = 0: each step's trees are grown when asked for; S > 0: a producer thread runs ahead.
    pipeline = RolloutPipeline(
        StepProducer(rollout, r.rl_tasks(train_tasks), cfg.prompts_per_step, base_key,
                     grown_in_step=learner.branch_between, mixed_channels=mixed,
                     extra_rounds=r.dynamic_sampling_extra_rounds),
        start + 1, cfg.num_steps, run.data_position, r.max_staleness)
    prof = cfg.profile
    for step in range(start + 1, cfg.num_steps + 1):
      if stop.set:  # a signal during an earlier phase: step `start` is saved
        break
      if prof.mode and step == prof.start_step:
        jax.profiler.start_trace(str(workdir_path / "profile"))
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        with timer("rollout_wait" if r.max_staleness else "rollout"):
          produced = pipeline.get(step)
        state, result = rl_step(learner, rollout, state, produced,
                                jax.random.fold_in(base_key, 10**6 + step), timer,
                                functools.partial(shown.note, step))
        if result.metrics is None and mixed is not None:
          logging.warning("step %d: no mixed group after dynamic sampling; no update", step)
        run.data_position = produced.data_position  # every prompt consumed: exact resume
        check_bad_trees(step, result.bad, len(result.rollout.trees), r.max_bad_tree_fraction)
        if result.metrics is not None:
          skipped = skipped + [step] if float(result.metrics["skipped"]) else []  # state kept
          if len(skipped) >= cfg.algo.max_skipped_steps:
            raise FloatingPointError(
                f"steps {skipped}: the loss or gradient norm was not finite in "
                f"{len(skipped)} updates in a row (config.algo.max_skipped_steps); each was "
                f"skipped and the run stops at step {step}, its last checkpoint is step "
                f"{ckpt.latest_step()}")
        rollout.sync(state)
      if prof.mode and step == prof.start_step + prof.num_steps - 1:
        jax.profiler.stop_trace()
      row = _step_row(result, rollout, reasoning, timer)
      if isolation is not None:
        row["sandbox/kernel_enforced"] = float(isolation == "bwrap")
      if r.max_staleness:  # grown in the producer, overlapping earlier updates
        row["time/rollout"] = produced.seconds
      run.step = step
      writer.write(step, row)
      shown.update(step, f"reward {row['reward/outcome_mean']:+.3f}, "
                   f"{row.get('rollout/policy_tokens', 0):.0f} policy tokens")
      saved = step % cfg.ckpt_every_steps == 0 or step == cfg.num_steps or stop.set
      if saved:
        with timer("checkpoint"):
          save_run(ckpt, step, state, run.to_json(), result.method_state)
      if stop.set:
        break
      try:
        if _eval_due(cfg, run, step):
          with timer("eval"):
            _record_eval(run, writer, workdir_path, f"step{step}", step,
                         evaluator(f"step{step}", stop))
      except Stopped:
        if not saved:
          with timer("checkpoint"):
            save_run(ckpt, step, state, run.to_json(), result.method_state)
        raise

    if cfg.num_steps and run.step == cfg.num_steps and "rl" not in run.eval:
      with timer("eval"):  # not in a checkpoint: a relaunch of a done run redoes it
        _record_eval(run, writer, workdir_path, "rl", cfg.num_steps, evaluator("rl", stop))
  except Stopped as e:
    logging.warning("%s", e)
  finally:
    if pipeline is not None:  # before the engines close under a producer mid-step
      pipeline.close(interrupt=[rollout.engine.interrupt])
    stop.restore()
    ckpt.close()
    writer.close()
    rollout.close()

  if primary:
    _summarize(run, writer, timer, workdir_path)
  return {"eval": run.eval, "steps": run.step, "history": writer.history, "state": state}
