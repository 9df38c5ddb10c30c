"""Arms and scales: what each run of a comparison is, and the config it builds."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SCALES = ("smoke", "cpu", "gpu")
SCALE_ENV = "TREE_RL_NOTEBOOK_SCALE"
RESULTS_ENV = "TREE_RL_RESULTS_DIR"
REPLOT_ENV = "TREE_RL_REPLOT_ONLY"  # "1": the notebooks train nothing, only re-plot
# The gpu scale's model: a local Hugging Face folder (nothing is downloaded at run time).
GPU_MODEL_ENV = "TREE_RL_GPU_MODEL"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+=-]*(_[A-Za-z0-9.+=-]+)*$")
RUN_DIR = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One arm of a comparison: a config file and what it changes, run once per seed.

  Attributes:
    name: the arm's run folders are `<name>_s<seed>`; letters, digits and `.+=-`, words
      joined by `_` (e.g. "gamma_0.9").
    config: a config under `configs/` with an optional `:arg=value,...` suffix, as
      launch/train.py's --config takes it: "grpo", "arpo.py:group=2",
      "configs/apppo.py:init=4,branch=3".
    overrides: dotted config paths set after the config and the scale, e.g.
      {"algo.estimator_kwargs.gamma": 0.9}; a dict value replaces the whole section.
    seeds: `config.seed` of each run (the smoke scale runs the first only).
  """

  name: str
  config: str
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seeds: tuple[int, ...] = (0, 1, 2)

  def __post_init__(self):
    if not _NAME.match(self.name) or RUN_DIR.match(self.name):
      raise ValueError(f"Arm name {self.name!r}: use letters, digits and .+=- in words joined "
                       f"by '_', not ending in _s<digits> (run folders are <name>_s<seed>)")
    if not self.seeds:
      raise ValueError(f"Arm {self.name!r} needs at least one seed")
    object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))


def unique_arms(*groups: Sequence[Arm]) -> list[Arm]:
  """The arms of several lists once each, in order. An arm that two comparisons both use (the
  method's default is also each ablation's reference) runs once; two different arms under
  one name fail, since they would share run folders."""
  out: dict[str, Arm] = {}
  for arm in (a for group in groups for a in group):
    if arm.name in out and out[arm.name] != arm:
      raise ValueError(f"two different arms are named {arm.name!r}: {out[arm.name]} and {arm}")
    out.setdefault(arm.name, arm)
  return list(out.values())


def checked_arms(scale: str, *groups: Sequence[Arm]) -> list[Arm]:
  """`unique_arms` of the groups, each validated at `scale` (`check_arms`) before anything
  runs, and listed."""
  arms = unique_arms(*groups)
  check_arms(arms, scale)
  print(f"{len(arms)} arms: {', '.join(a.name for a in arms)}")
  return arms


def scale_args(scale: str) -> str:
  """The `:arg` a scale adds to every config: smoke is the configs' `runlocal` preset (each
  config shrinks its own method there: PORTool's t_max, APPO's N and M, TRACE's
  predictor), which is what tests/train_test.py runs."""
  _check_scale(scale)
  return "runlocal" if scale == "smoke" else ""


# The cpu scale's tool-world preset: these fields of configs/apppo.py (the README's main job),
# everything but its method, are set on every tool-world arm at the cpu scale. So every
# paper's tool-world runs share one model setup, task mix, SFT warm start, eval and budget,
# and with them one warm start per seed (docs/notebooks.md#the-cpu-scale). The PPO
# mini-batches are part of the budget: a step's 2 prompts are updated one at a time, as
# the main job does. In one mini-batch, without rematerialisation, a GRPO or PORTool update
# of 2 prompts took over 20 GB and was killed on a 24 GB machine.
CPU_TOOLWORLD_PRESET = "apppo"
# ... at the main job's earlier budget and reward, where every committed cpu-scale run ran:
# 5 RL steps of 2 prompts, PORTool's reward, branched per mini-batch. The main job itself
# now trains 5 steps of 4 prompts on the format-gated reward and branches once a step
# (docs/notebooks.md#the-cpu-scale).
CPU_TOOLWORLD_ARG = "prompts=2,steps=5,reward=portool,timing=per_minibatch"
# The part of that preset that other task families (BFCL, search QA) take at the cpu scale:
# the training recipe (LoRA targets, SFT warm start, learning rate, sampling temperature,
# budget), not the task's shape (their own prompts, token limits and eval sets) nor its
# memory setting (they keep rematerialisation: their prompts are longer). With their
# configs' own recipe (SFT lr 1e-4, RL lr 1e-5, temperature 1), 10 SFT steps left
# SmolLM2-135M's BFCL eval where the base model had it, and every response sampled in 2 RL
# steps scored 0, so no group had an advantage (docs/notebooks.md#the-cpu-scale).
CPU_RECIPE_FIELDS = ("model.lora_targets", "rollout.temperature", "num_steps",
                     "prompts_per_step", "algo.num_minibatches", "optim.lr", "sft")
CPU_TOOLWORLD_FIELDS = CPU_RECIPE_FIELDS + (
    "model.remat", "task.kwargs", "task.num_eval_tasks", "rollout.max_new_tokens",
    "rollout.max_context_tokens")
# What the main job changed after the committed cpu-scale runs, kept at the values those runs
# used, for every tool-world arm (so all of them still share one warm start): the base eval
# (the notebooks' tables show it) and the eval tasks of `task.seed` (the split their presets
# were tuned on; issue 39 moves the notebooks to a test split).
CPU_TOOLWORLD_PINNED = {"eval_base": True, "task.eval_seed": -1}


def _get(config: Any, dotted: str) -> Any:
  for part in dotted.split("."):
    config = config[part]
  return config.to_dict() if hasattr(config, "to_dict") else config


def scale_overrides(scale: str, family: str | None = None) -> dict[str, Any]:
  """Dotted config overrides of a scale for a config of task family `family`, applied after
  the config (and its `scale_args`) and before the arm's own overrides.

  smoke: none (runlocal is the tiny model, 2 steps, 2 prompts of 2 leaves, 2 eval tasks).
  cpu: for the tool world, `CPU_TOOLWORLD_FIELDS` of configs/apppo.py (SmolLM2-135M with an
    SFT warm start on difficulty-1 tasks, sampled at 0.6; docs/methods/appo.md#the-cpu-preset)
    and `CPU_TOOLWORLD_PINNED`;
    other families: its `CPU_RECIPE_FIELDS` (the same SFT, lr, temperature and budget on
    their own tasks).
  gpu: a larger HF model in bfloat16 (`gpu_model_folder`), more and larger steps, a larger
    held-out set and an eval every 10 steps for the curves.
  """
  _check_scale(scale)
  if scale == "cpu" and family is not None:
    preset = importlib.import_module(f"configs.{CPU_TOOLWORLD_PRESET}").get_config(
        CPU_TOOLWORLD_ARG)
    if family != "toolworld":
      return {field: _get(preset, field) for field in CPU_RECIPE_FIELDS}
    return {**{field: _get(preset, field) for field in CPU_TOOLWORLD_FIELDS},
            **CPU_TOOLWORLD_PINNED}
  if scale != "gpu":
    return {}
  return {"model.name": "hf", "model.hf_folder": gpu_model_folder(), "model.dtype": "bfloat16",
          "num_steps": 50, "prompts_per_step": 8, "task.num_eval_tasks": 64,
          "eval_every_steps": 10, "ckpt_every_steps": 10}


def gpu_model_folder() -> str:
  """The gpu scale's model: the local Hugging Face folder $TREE_RL_GPU_MODEL names (a
  Qwen2/Llama-shaped checkpoint such as Qwen2.5-1.5B-Instruct). tree_rl downloads no
  weights at run time, so the folder must already be on the machine."""
  name = os.environ.get(GPU_MODEL_ENV, "")
  if not name or not pathlib.Path(name).is_dir():
    raise ValueError(f"the gpu scale needs ${GPU_MODEL_ENV} set to a local Hugging Face model "
                     f"folder (config.json, *.safetensors, tokenizer files); got {name!r}")
  return name


def _check_scale(scale: str) -> None:
  if scale not in SCALES:
    raise ValueError(f"scale {scale!r}; valid: {list(SCALES)}")


def repo_root() -> pathlib.Path:
  """The checkout holding `configs/`: the current folder or one above it (a notebook runs
  in notebooks/, a script in the root), else the folder above this package (an editable
  install)."""
  here = pathlib.Path.cwd().resolve()
  for folder in (here, *here.parents, pathlib.Path(__file__).resolve().parents[2]):
    if (folder / "configs" / "common.py").is_file():
      return folder
  raise FileNotFoundError("no tree_rl checkout (a folder with configs/common.py) at or above "
                          f"{here}; run from the repository")


def results_root(scale: str) -> pathlib.Path:
  """Where a scale's runs go: $TREE_RL_RESULTS_DIR, else results/ (cpu, the committed
  numbers), results/gpu/ (gpu) or a temporary folder (smoke, never results/)."""
  _check_scale(scale)
  env = os.environ.get(RESULTS_ENV, "")
  if env:
    return pathlib.Path(env)
  if scale == "smoke":
    return pathlib.Path(tempfile.gettempdir()) / "tree_rl_smoke_results"
  return repo_root() / "results" / ("gpu" if scale == "gpu" else "")


def _split_config(spec: str) -> tuple[str, str]:
  """"configs/apppo.py:init=4" -> ("apppo", "init=4")."""
  path, _, arg = spec.partition(":")
  return pathlib.Path(path).stem, arg


def _set(config: Any, dotted: str, value: Any) -> None:
  """config.<dotted> = value, creating missing sections (estimator_kwargs and the like are
  open dicts)."""
  import ml_collections  # noqa: PLC0415

  *parents, last = dotted.split(".")
  node = config
  for part in parents:
    if part not in node:
      node[part] = ml_collections.ConfigDict()
    node = node[part]
  node[last] = value


def build_config(arm: Arm, seed: int, scale: str) -> Any:
  """The arm's ConfigDict for `seed` at `scale`: config file (with the scale's and the arm's
  `:arg`), then `scale_overrides`, then `arm.overrides`, then `seed`. An `:arg` that changes
  a field the scale sets (configs/apppo.py's `:reward=gated` sets `task.kwargs`) raises,
  unless the arm's overrides restore it: the scale would otherwise undo it unseen."""
  root = str(repo_root())
  if root not in sys.path:  # the configs import `configs.common`; they are not installed
    sys.path.insert(0, root)
  module, arg = _split_config(arm.config)
  get_config = importlib.import_module(f"configs.{module}").get_config
  # The preset's own file starts from the preset's `:arg` (the fields the scale sets), so
  # `apppo:reward=gated` is a change from it although gated is apppo's default.
  preset_arg = CPU_TOOLWORLD_ARG if module == CPU_TOOLWORLD_PRESET and scale == "cpu" else ""
  base = [scale_args(scale), preset_arg]
  config = get_config(",".join(filter(None, [*base, arg])))
  scaled = scale_overrides(scale, config.task.family)
  asked = config.copy_and_resolve_references() if arg and scaled else None
  for key, value in {**scaled, **arm.overrides}.items():
    _set(config, key, value)
  if asked is not None:  # an `:arg` whose change the scale undid, silently: refused
    plain = get_config(",".join(filter(None, base)))
    lost = [key for key in scaled if _get(asked, key) != _get(plain, key)
            and _get(config, key) != _get(asked, key)]
    if lost:
      raise ValueError(f"arm {arm.name!r}: {arm.config!r} changes {lost}, which the {scale} "
                       "scale sets on every arm of its task family; put the change in the "
                       "arm's overrides instead")
  config.seed = int(seed)
  return config


def check_arms(arms: Iterable[Arm], scale: str) -> None:
  """Builds and validates every arm's config (no model, no compile): a typo in an override
  fails here, before hours of runs, instead of when its arm's turn comes."""
  from tree_rl.config_types import RunConfig  # noqa: PLC0415

  for arm in arms:
    try:
      RunConfig.from_config_dict(build_config(arm, arm.seeds[0], scale))
    except Exception as e:
      raise ValueError(f"arm {arm.name!r} ({arm.config}, {dict(arm.overrides)}): {e}") from e

