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
RESULTS_ENV = "TREE_RL_RESULTS_DIR"
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
    warm_start: an arm whose run does what comes before the first RL step (the base eval,
      SFT and the SFT eval: `num_steps` 0) and whose checkpoint this arm's runs resume
      from (`config.resume`), once per seed; the arms of a comparison that share one start
      from one policy. Its own `seeds` are not used: it runs at this arm's.
  """

  name: str
  config: str
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  seeds: tuple[int, ...] = (0, 1, 2)
  warm_start: Arm | None = None

  def __post_init__(self):
    if not _NAME.match(self.name) or RUN_DIR.match(self.name):
      raise ValueError(f"Arm name {self.name!r}: use letters, digits and .+=- in words joined "
                       f"by '_', not ending in _s<digits> (run folders are <name>_s<seed>)")
    if not self.seeds:
      raise ValueError(f"Arm {self.name!r} needs at least one seed")
    object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
    if self.warm_start is not None:
      if not isinstance(self.warm_start, Arm) or self.warm_start.warm_start is not None:
        raise ValueError(f"Arm {self.name!r}: warm_start must be an Arm without a warm start "
                         f"of its own, got {self.warm_start!r}")
      if "resume" in self.overrides:
        raise ValueError(f"Arm {self.name!r} sets resume and a warm_start: it resumes from "
                         f"its warm start's checkpoint; drop one")


def unique_arms(*groups: Sequence[Arm]) -> list[Arm]:
  """The arms of several lists once each, in order. An arm that two comparisons both use (the
  method's default is also each ablation's reference) runs once; two different arms under
  one name fail, since they would share run folders."""
  out: dict[str, Arm] = {}
  warm: dict[str, Arm] = {}
  for arm in (a for group in groups for a in group):
    for seen, one in ((out, arm), (warm, arm.warm_start)):
      if one is not None and one.name in seen and seen[one.name] != one:
        raise ValueError(f"two different arms are named {one.name!r}: {seen[one.name]} and "
                         f"{one}")
    out.setdefault(arm.name, arm)
    if arm.warm_start is not None:
      warm.setdefault(arm.warm_start.name, arm.warm_start)
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
  predictor), which is what tests/train_test.py runs; cpu is their `preset=cpu`
  (configs/common.py's `PRESETS`: SmolLM2-135M on the README main job's recipe, each
  config keeping its method)."""
  _check_scale(scale)
  return {"smoke": "runlocal", "cpu": "preset=cpu", "gpu": ""}[scale]


def scale_overrides(scale: str) -> dict[str, Any]:
  """Dotted config overrides of a scale, applied after the config (and its `scale_args`)
  and before the arm's own overrides: at the gpu scale a larger HF model in bfloat16
  (`gpu_model_folder`), more and larger steps, a larger held-out set and an eval every 10
  steps for the curves; none at the others."""
  _check_scale(scale)
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


def config_file(arm: Arm, scale: str) -> tuple[pathlib.Path, str]:
  """The arm's config file under `<repo>/configs/` and its `:arg` at `scale` (the scale's
  `scale_args`, then the arm's own): ("configs/apppo.py", "preset=cpu,init=4")."""
  path, _, arg = arm.config.partition(":")
  return (repo_root() / "configs" / f"{pathlib.Path(path).stem}.py",
          ",".join(filter(None, [scale_args(scale), arg])))


def overrides(arm: Arm, seed: int, scale: str) -> dict[str, Any]:
  """What the run sets on top of its config file: the scale's overrides, then the arm's,
  then `seed` (launch/train.py's `--overrides`)."""
  return {**scale_overrides(scale), **arm.overrides, "seed": int(seed)}


def _get(config: Any, dotted: str) -> Any:
  for part in dotted.split("."):
    config = config[part]
  return config.to_dict() if hasattr(config, "to_dict") else config


def _configs() -> Any:
  """The repository's `configs` package (not installed: imported from the checkout)."""
  root = str(repo_root())
  if root not in sys.path:
    sys.path.insert(0, root)
  return importlib.import_module("configs.common")


def build_config(arm: Arm, seed: int, scale: str) -> Any:
  """The arm's ConfigDict for `seed` at `scale`, as launch/train.py builds it from
  `config_file` and `overrides`. An `:arg` that changes a field the scale's overrides set
  (the gpu scale's `num_steps` and `:steps=9`) raises, unless the arm's overrides set it
  too: the scale would otherwise undo it unseen."""
  common = _configs()
  path, arg = config_file(arm, scale)
  get_config = importlib.import_module(f"configs.{path.stem}").get_config
  config = get_config(arg)
  scaled = scale_overrides(scale)
  if arm.config.partition(":")[2] and scaled:
    plain = get_config(scale_args(scale))
    lost = [key for key in scaled if key not in arm.overrides
            and _get(config, key) != _get(plain, key)]
    if lost:
      raise ValueError(f"arm {arm.name!r}: {arm.config!r} changes {lost}, which the {scale} "
                       "scale sets on every arm; put the change in the arm's overrides "
                       "instead")
  return common.override(config, overrides(arm, seed, scale))


def check_arms(arms: Iterable[Arm], scale: str) -> None:
  """Builds and validates every arm's config and its warm start's (no model, no compile):
  a typo in an override fails here, before hours of runs, instead of when its arm's turn
  comes. A warm start runs no RL step (`num_steps` 0), and an eval or SFT to share; it
  and the arms that resume from it train one model on one task family with one SFT (their
  `model`, `task` and `sft` sections and their seed are equal)."""
  from tree_rl.config_types import RunConfig  # noqa: PLC0415

  for arm in arms:
    configs = []
    for one in filter(None, (arm, arm.warm_start)):
      try:
        configs.append(build_config(one, arm.seeds[0], scale))
        RunConfig.from_config_dict(configs[-1])
      except Exception as e:
        raise ValueError(f"arm {one.name!r} ({one.config}, {dict(one.overrides)}): {e}") from e
    if arm.warm_start is not None:
      differ = [key for key in ("model", "task", "sft", "seed")
                if _get(configs[0], key) != _get(configs[1], key)]
      if differ:
        raise ValueError(f"arm {arm.name!r} and its warm start {arm.warm_start.name!r} differ "
                         f"in {differ}; a warm start trains the arm's model on its tasks")
    config = configs[-1]
    if arm.warm_start is not None and (config.num_steps or not (config.sft.steps
                                                                 or config.eval_base)):
      raise ValueError(f"arm {arm.warm_start.name!r}, the warm start of {arm.name!r}, has "
                       f"num_steps={config.num_steps}, sft.steps={config.sft.steps} and "
                       f"eval_base={config.eval_base}; a warm start runs no RL step "
                       "(num_steps 0) and the base eval or SFT")

