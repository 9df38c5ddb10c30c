"""Shared pieces of the experiment configs.

`parse_arg(arg, **defaults)` reads the `:key=value,flag` suffix of `--config`
(e.g. `--config=configs/apppo.py:model=tiny,steps=4,runlocal`): values are cast
to the type of their default, a bare key sets a boolean to True, and an unknown
key fails listing the valid ones. `base_config()` holds every section with its
defaults; each experiment file overrides what its paper sets.
"""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is not known; valid: {sorted(defaults)}")
    default = defaults[key]
    if not eq:
      if not isinstance(default, bool):
        raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
      out[key] = True
    elif isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={value!r}: expected true or false")
      out[key] = value.lower() in ("true", "1")
    else:
      out[key] = type(default)(value)
  return out


def base_config() -> ml_collections.ConfigDict:
  """Every section with tree_rl's defaults (see tree_rl/config_types.py for the meaning)."""
  c = ml_collections.ConfigDict()
  c.model = dict(name="smollm2", hf_folder="", lora_rank=8, lora_alpha=16.0,
                 lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), dtype="float32",
                 remat=True, attention="blockwise", attention_block=64, tiny_overrides={})
  c.task = dict(family="toolworld", kwargs={}, num_train_tasks=256, num_eval_tasks=32, seed=0,
                eval_seed=-1)
  c.rollout = dict(engine="jax", strategy="flat", strategy_kwargs={}, samples_per_task=4,
                   max_turns=0, max_new_tokens=160, temperature=1.0, top_p=1.0, top_k=0,
                   max_context_tokens=4096, cache_rows=16, vllm_python="",
                   dynamic_sampling=False, dynamic_sampling_extra_rounds=8,
                   generator_memory_fraction=0.5, learner_memory_fraction=0.0,
                   backend="local", num_workers=1, worker_num_cpus=1.0, worker_num_gpus=0.0,
                   worker_timeout_s=600.0, max_staleness=0, max_bad_tree_fraction=0.25)
  c.algo = dict(estimator="grpo", estimator_kwargs={}, loss={}, num_epochs=1, num_minibatches=1,
                max_skipped_steps=3)
  c.optim = dict(lr=1e-5, weight_decay=0.0, grad_clip=1.0, warmup_steps=0)
  c.sft = dict(steps=0, lr=1e-4, tasks_per_step=8, ckpt_every_steps=5)
  c.profile = dict(mode="", start_step=1, num_steps=1)
  # The reasoning judge (AWPO's R_reason): kind "" (none), "rubric" (offline) or "llm".
  c.judge = dict(kind="", base_url="", model="", api_key_env="OPENAI_API_KEY", timeout_s=30.0,
                 max_retries=3, total_timeout_s=0.0, votes=1, temperature=0.0, max_tokens=512,
                 max_reply_bytes=4 * 2**20, cache_path="")
  # The device mesh (data, fsdp, tensor; -1: the remaining devices). One device by default.
  c.mesh = dict(data=1, fsdp=1, tensor=1, max_replicated_fraction=0.1)
  # Several hosts (tree_rl.distributed): unset fields come from $JAX_COORDINATOR_ADDRESS,
  # $JAX_NUM_PROCESSES, $JAX_PROCESS_ID; one process when neither sets num_processes.
  c.distributed = dict(coordinator_address="", num_processes=0, process_id=-1)
  c.num_steps = 10
  c.prompts_per_step = 4
  c.eval_every_steps = 0
  c.eval_base = True
  c.ckpt_every_steps = 5
  c.keep_checkpoints = 2
  c.seed = 0
  c.resume = ""
  return c


def apply_common_args(c: ml_collections.ConfigDict, arg: ml_collections.ConfigDict
                      ) -> ml_collections.ConfigDict:
  """The arguments every config accepts: model, task, steps, runlocal."""
  c.model.name = arg.model
  c.task.family = arg.task
  if arg.steps:
    c.num_steps = arg.steps
  if arg.runlocal:
    runlocal(c)
    if arg.steps:
      c.num_steps = arg.steps
  return c


COMMON_ARGS = dict(model="smollm2", task="toolworld", steps=0, runlocal=False)


def runlocal(c: ml_collections.ConfigDict) -> None:
  """Shrinks everything so a run finishes on a 2-core CPU in a few minutes (tests, smoke runs)."""
  c.model.name = "tiny"
  c.model.tiny_overrides = dict(num_hidden_layers=1)
  c.model.remat, c.model.attention = False, "dense"
  c.task.num_train_tasks, c.task.num_eval_tasks = 8, 2
  c.rollout.samples_per_task = 2
  c.rollout.max_turns = 2
  c.rollout.max_new_tokens = 8
  c.rollout.max_context_tokens = 4096
  c.rollout.cache_rows = 4
  c.rollout.dynamic_sampling_extra_rounds = min(c.rollout.dynamic_sampling_extra_rounds, 1)
  c.prompts_per_step = 2
  c.num_steps = 2
  c.ckpt_every_steps = 1
  c.sft.steps = min(c.sft.steps, 1)
  c.sft.tasks_per_step = 2
  c.sft.ckpt_every_steps = 1
