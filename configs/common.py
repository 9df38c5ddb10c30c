"""Shared pieces of the experiment configs.

`parse_arg(arg, **defaults)` reads the `:key=value,flag` suffix of `--config`
(e.g. `--config=configs/apppo.py:model=tiny,steps=4,runlocal`): values are cast
to the type of their default, a bare key sets a boolean to True, and an unknown
key fails listing the valid ones. `base_config()` holds every section with its
defaults (written once, in `tree_rl.config_types`); each experiment file overrides
what its paper sets. `apply_common_args` applies the arguments every config takes,
among them `:preset=cpu` (`PRESETS`). `override(config, {dotted: value})` sets fields
after the config is built (launch/train.py's `--overrides`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import ml_collections

from tree_rl.config_types import RunConfig
from tree_rl.rollout.strategies import STRATEGIES


def parse_arg(arg: str | None, *,
              preset_defaults: Mapping[str, Mapping[str, Any]] | None = None,
              **defaults) -> ml_collections.ConfigDict:
  """The config's arguments: `defaults` updated from `arg` ("key=value,flag,...").

  Args:
    arg: the text after `:` in `--config=<file>:<arg>`, or None.
    preset_defaults: {preset: {argument: default}}, the defaults a config's own
      arguments take under `:preset=<preset>` (an argument given in `arg` still wins).
    **defaults: every argument the config takes, with its default (its type is the
      argument's type).

  Returns:
    A ConfigDict of every argument: its default, the preset's, then `arg`'s value.

  Raises:
    ValueError: an unknown argument, a value that does not cast, or an unknown preset,
      each named.
  """
  items = [item.partition("=") for item in filter(None, (arg or "").split(","))]
  preset = next((value for key, eq, value in items if key.strip() == "preset" and eq),
                defaults.get("preset", ""))
  if "preset" in defaults and preset not in ("", *PRESETS):
    raise ValueError(f"config argument preset={preset!r} is not a preset; valid: "
                     f"{sorted(PRESETS)}")
  for name, values in (preset_defaults or {}).items():
    unknown = sorted(set(values) - set(defaults))
    if name not in PRESETS or unknown:
      raise ValueError(f"preset_defaults[{name!r}]: presets are {sorted(PRESETS)} and the "
                       f"arguments {sorted(defaults)}; got {sorted(values)}")
  defaults = {**defaults, **(preset_defaults or {}).get(preset, {})}
  out = ml_collections.ConfigDict(defaults)
  for key, eq, value in items:
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


def apply_common_args(c: ml_collections.ConfigDict, arg: ml_collections.ConfigDict,
                      own: Collection[str] = ()) -> ml_collections.ConfigDict:
  """The arguments every config accepts: model, task, preset, steps, runlocal.

  Args:
    c: the config, with its method set.
    arg: `parse_arg`'s result, with `COMMON_ARGS` among its keys.
    own: dotted fields of `PRESETS` that this config sets from its own arguments: the
      preset leaves them as the config set them.

  Returns:
    `c`, changed in place: model and task, then the preset's fields, then `steps`, then
    `runlocal`'s shrink (after which a given `steps` still holds).
  """
  c.model.name = arg.model
  c.task.family = arg.task
  if arg.preset:
    fields = PRESETS[arg.preset]["toolworld" if arg.task == "toolworld" else "other"]
    override(c, {k: v for k, v in fields.items() if k not in own})
  if arg.steps:
    c.num_steps = arg.steps
  if arg.runlocal:
    runlocal(c)
    if arg.steps:
      c.num_steps = arg.steps
  return c


COMMON_ARGS = dict(model="smollm2", task="toolworld", steps=0, runlocal=False, preset="")

# `:preset=cpu`: the setup on which the papers' comparisons ran (notebooks, cpu scale;
# docs/notebooks.md#the-cpu-scale): SmolLM2-135M trained on a 2-core CPU with the README
# main job's recipe (configs/apppo.py) at 2 prompts a step. Every config keeps its method
# (estimator, strategy, group size, loss) and takes the recipe: LoRA on attention and MLP,
# 10 SFT steps of 4 tasks at lr 2e-3, RL at lr 1e-4 sampled at 0.6, 5 steps of 2 prompts in
# 2 PPO mini-batches (one prompt each, which bounds an update's memory). Tool-world configs
# also take the main job's task and memory setup: 3 tools per difficulty-1 task, 32
# held-out tasks of the training seed's split, the base eval, 96 tokens a step in a
# 2048-token context, no rematerialisation. Other families keep their own tasks, token
# limits and rematerialisation. Why each value: docs/methods/appo.md#the-cpu-preset.
_CPU_RECIPE = {
    "model.lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"),
    "rollout.temperature": 0.6, "num_steps": 5, "prompts_per_step": 2,
    "algo.num_minibatches": 2, "optim.lr": 1e-4, "sft.steps": 10, "sft.tasks_per_step": 4,
    "sft.lr": 2e-3}
PRESETS = {"cpu": {
    "other": _CPU_RECIPE,
    "toolworld": {**_CPU_RECIPE, "model.remat": False,
                  "task.kwargs": dict(tools_per_task=3, difficulties=(1,), max_turns=3),
                  "task.num_eval_tasks": 32, "task.eval_seed": -1, "eval_base": True,
                  "rollout.max_new_tokens": 96, "rollout.max_context_tokens": 2048}}}


def override(c: ml_collections.ConfigDict, overrides: Mapping[str, Any]
             ) -> ml_collections.ConfigDict:
  """Sets `c.<dotted> = value` for each item of `overrides`, in order.

  A value that is a dict replaces the whole section (`{"rollout.strategy_kwargs": {}}`);
  a list is set as a tuple, as the configs hold sequences (JSON has no tuples). The last
  part of a path may be a new key of an existing section (`algo.estimator_kwargs.gamma`):
  the typed config (`RunConfig.from_config_dict`) then validates the whole config.

  Raises:
    ValueError: a path that is empty, or whose parent is not a section of `c`, named.
  """
  for dotted, value in overrides.items():
    *parents, last = dotted.split(".")
    if not all(parents + [last]):
      raise ValueError(f"config override {dotted!r}: not a dotted path (a.b.c)")
    node = c
    for i, part in enumerate(parents):
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
      if not isinstance(node, ml_collections.ConfigDict):
        raise ValueError(f"config override {dotted!r}: {'.'.join(parents[:i + 1])!r} is "
                         f"not a section of the config")
    with c.unlocked():
      node[last] = _tuples(value)
  return c


def json_overrides(text: str) -> dict[str, Any]:
  """The {dotted path: value} object of a launcher's `--overrides` JSON, for `override`.

  Raises:
    ValueError: `text` is not JSON, or not a JSON object (each named with the text).
  """
  try:
    values = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--overrides is not JSON ({e}): {text!r}") from e
  if not isinstance(values, dict):
    raise ValueError(f"--overrides must be a JSON object {{path: value}}, got {text!r}")
  return values


def _tuples(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_tuples(v) for v in value)
  if isinstance(value, Mapping):
    return {k: _tuples(v) for k, v in value.items()}
  return value


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
