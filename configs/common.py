"""Shared pieces of the experiment configs.

`parse_arg(arg, **defaults)` reads the `:key=value,flag` suffix of `--config`
(e.g. `--config=configs/apppo.py:model=tiny,steps=4,runlocal`): values are cast
to the type of their default, a bare key sets a boolean to True, and an unknown
key fails listing the valid ones. `base_config()` holds every section with its
defaults (written once, in `tree_rl.config_types`); each experiment file overrides
what its paper sets.
"""

from __future__ import annotations

import ml_collections

from tree_rl.config_types import RunConfig
from tree_rl.rollout.strategies import STRATEGIES


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
  """Every section with tree_rl's defaults, as a ConfigDict.

  The defaults are written once, in the typed config (`RunConfig.defaults()`: see
  tree_rl/config_types.py for what each field means); an experiment file overrides
  what its paper sets.
  """
  return ml_collections.ConfigDict(RunConfig.defaults())


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
  reads = STRATEGIES[c.rollout.strategy].generic_fields  # set only what the strategy reads
  if "samples_per_task" in reads:
    c.rollout.samples_per_task = 2
  if "max_turns" in reads:
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
