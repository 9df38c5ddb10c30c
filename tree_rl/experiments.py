"""The papers' comparisons as data: arms, scales, runs, and their tables and plots.

The notebooks in `notebooks/` (one per paper) are thin clients of this module: each lists
its arms (a config file under `configs/` plus overrides), runs them through
`tree_rl.train.train_and_evaluate` at one of three scales, and rebuilds its tables and
plots from what the runs left on disk. Because the tables read only the files, committed
results re-plot without re-running anything (docs/notebooks.md).

Layout: `<root>/<paper>/<arm>_s<seed>/` holds one run's small files, the ones worth
committing: metrics.jsonl (every step and eval row), eval_<stage>.json (base / sft / rl /
step<k>, and `sampled` / `sft_sampled` for the RL / SFT policy's pass@k), phases.txt,
config.json (the resolved config) and arm.json, written last, which marks the run
finished. Checkpoints, TensorBoard events, transcripts and the per-run curves PNG are
deleted once the run is done (`KEEP`); an interrupted run keeps its checkpoints, so
running its arm again resumes it.

Warm starts: arms that differ only in what the RL phase reads (`RL_ONLY_FIELDS`: the
estimator, the branching, the group size, the number of steps...) would each repeat the
same base eval, SFT and SFT eval. `run_arm` runs that prefix once per (preset, seed) in
`<root>/.warm_starts/<key>/` (`num_steps=0`) and starts each arm's RL from its checkpoint
(`config.resume`); the arm's folder gets the warm start's eval files and metrics rows, so it
reads as a whole run, and arm.json names the warm start. The cache holds checkpoints and is
never committed.

Scales (`SCALES`): smoke (the tests' tiny random model, `:runlocal`, 2 steps: proves the
cells run, in CI), cpu (each config's own preset on SmolLM2-135M: the committed numbers)
and gpu (a larger HF model, `GPU_MODEL_ENV`). The root defaults to `results/` for cpu,
`results/gpu/` for gpu and a temporary folder for smoke, so a smoke run never writes where
the committed numbers live; `RESULTS_ENV` overrides it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SCALES = ("smoke", "cpu", "gpu")
SCALE_ENV = "TREE_RL_NOTEBOOK_SCALE"
RESULTS_ENV = "TREE_RL_RESULTS_DIR"
REPLOT_ENV = "TREE_RL_REPLOT_ONLY"  # "1": the notebooks train nothing, only re-plot
# The gpu scale's model: a local Hugging Face folder (nothing is downloaded at run time).
GPU_MODEL_ENV = "TREE_RL_GPU_MODEL"

# What a finished run keeps (file names and glob patterns); everything else is deleted.
KEEP = ("arm.json", "config.json", "metrics.jsonl", "phases.txt", "eval_*.json")
FINISHED_MARKER = "arm.json"
WARM_DIR = ".warm_starts"
WARM_MARKER = "warm.json"
SAMPLED_EVAL = "eval_sampled.json"  # `sampled_eval`'s report: pass@1..k
# Config fields that only the RL phase reads: arms differing only here share a warm start.
# Anything else (model, task, SFT, eval settings, the optimizer's kind, the seed) is in the
# key, and so are the two RL choices that shape the checkpoint: a reference model
# (`_with_ref`) and a strategy's learned state (TRACE's predictor, `_method_state`).
RL_ONLY_FIELDS = ("algo", "judge", "profile", "resume", "num_steps", "prompts_per_step",
                  "eval_every_steps", "ckpt_every_steps", "keep_checkpoints", "optim.lr",
                  "rollout.strategy", "rollout.strategy_kwargs", "rollout.samples_per_task",
                  "rollout.dynamic_sampling", "rollout.temperature", "rollout.top_p",
                  "rollout.top_k")
# Strategies whose checkpoint carries learned state (`checkpoint.method_state`).
_STATEFUL_STRATEGIES = ("trace",)
# "train/<key>" of a run is the mean of its last TAIL_STEPS RL steps' values: one step's
# reward is a handful of groups, too noisy to compare arms on.
TAIL_STEPS = 5
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+=-]*(_[A-Za-z0-9.+=-]+)*$")
_RUN_DIR = re.compile(r"^(?P<arm>.+)_s(?P<seed>\d+)$")


# ============================== Arms and scales ==============================


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
    if not _NAME.match(self.name) or _RUN_DIR.match(self.name):
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


def get_scale(default: str = "cpu") -> str:
  """The notebook's scale: $TREE_RL_NOTEBOOK_SCALE, else `default`."""
  scale = os.environ.get(SCALE_ENV, "") or default
  if scale not in SCALES:
    raise ValueError(f"${SCALE_ENV}={scale!r}; valid scales: {list(SCALES)}")
  return scale


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
  for folder in (here, *here.parents, pathlib.Path(__file__).resolve().parents[1]):
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


# ============================== Running ==============================


def run_dir(root: str | pathlib.Path, paper: str, arm: str, seed: int) -> pathlib.Path:
  return pathlib.Path(root) / paper / f"{arm}_s{int(seed)}"


def provenance(repo: str | pathlib.Path | None = None) -> dict[str, str]:
  """Where a run ran: the git commit of `repo` (default: tree_rl's checkout), with "+dirty"
  for uncommitted changes to tracked files outside results/ ("unknown" outside a git
  clone), and the machine (JAX backend, device kind and count, CPU cores)."""
  import jax  # noqa: PLC0415

  repo = pathlib.Path(repo) if repo else pathlib.Path(__file__).resolve().parent.parent
  try:
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip()
    commit = git("rev-parse", "--short=12", "HEAD")
    # results/ holds runs, not code (and a rerun empties its own committed folder first).
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"):
      commit += "+dirty"
  except (OSError, subprocess.SubprocessError):
    commit = "unknown"
  dev = jax.devices()[0]
  return {"commit": commit,
          "hardware": f"{jax.default_backend()} {dev.device_kind} x{jax.device_count()}, "
                      f"{os.cpu_count()} CPU cores, jax {jax.__version__}"}


def is_finished(path: str | pathlib.Path) -> bool:
  """A run `run_arm` completed: its arm.json is written after the final eval and the
  clean-up, so an interrupted run never has one."""
  return (pathlib.Path(path) / FINISHED_MARKER).is_file()


def _jsonable(values: Any) -> Any:
  return json.loads(json.dumps(values, default=str, sort_keys=True))


def config_changes(path: str | pathlib.Path, config: Any) -> list[str]:
  """The keys whose value in the run's saved config.json differs from `config` (what
  checkpoint.write_run_config would call a different experiment: resumable fields such as
  eval cadence do not count, nor keys the saved file lacks)."""
  from tree_rl.checkpoint import RESUMABLE_FIELDS, flatten_dotted  # noqa: PLC0415

  saved_path = pathlib.Path(path) / "config.json"
  if not saved_path.is_file():
    return []
  saved = flatten_dotted(json.loads(saved_path.read_text(encoding="utf-8")))
  new = flatten_dotted(_jsonable(config.to_dict()))
  return sorted(k for k in saved if k in new and saved[k] != new[k] and not any(
      k == f or k.startswith(f + ".") for f in (*RESUMABLE_FIELDS, "resume")))


def prune(path: str | pathlib.Path) -> None:
  """Deletes everything in a run folder but the small files of `KEEP`."""
  path = pathlib.Path(path)
  for child in path.iterdir():
    if any(child.match(pattern) for pattern in KEEP) and child.is_file():
      continue
    if child.is_dir():
      shutil.rmtree(child)
    else:
      child.unlink()


_PROCESS_READY = False


def _setup_process() -> None:
  """What launch/train.py sets before training, so notebook runs match CLI runs: float32
  matmuls at full precision, and absl at WARNING (Orbax logs every file it renames)."""
  global _PROCESS_READY
  if _PROCESS_READY:
    return
  import jax  # noqa: PLC0415
  from absl import logging  # noqa: PLC0415

  jax.config.update("jax_default_matmul_precision", "highest")
  logging.set_verbosity(logging.WARNING)
  _PROCESS_READY = True


def _train(config: Any, workdir: str | pathlib.Path, pass_k: int = 0) -> dict[str, Any]:
  """`train_and_evaluate(config, workdir)`, then (`pass_k` > 0, and only if training
  finished) `sampled_eval`; returns {"steps": the last step, "eval": the stages evaluated}.
  The train state is dropped here, so nothing of the run outlives the call."""
  _setup_process()
  from tree_rl.train import train_and_evaluate  # noqa: PLC0415  (slow import)

  out = train_and_evaluate(config, str(workdir))
  result = {"steps": int(out["steps"]), "eval": sorted(out["eval"])}
  del out
  if pass_k and result["steps"] == config.num_steps:
    sampled_eval(workdir, pass_k)
  return result


def _sampled_eval(path: str | pathlib.Path, num_samples: int) -> dict[str, float]:
  """`sampled_eval` with the process set up as for training (`_setup_process`)."""
  _setup_process()
  return sampled_eval(path, num_samples)


# The child's first statement: it takes the parent's sys.path (so it imports the same
# tree_rl, and the caller's modules), then runs the pickled call. A script of its own, not
# multiprocessing's spawn, which re-runs the parent's __main__ (a notebook run as a script).
_CHILD_BOOT = ("import pickle, sys; path, payload, out = pickle.load(sys.stdin.buffer); "
               "sys.path[:] = path; from tree_rl.experiments import _child_main; "
               "_child_main(payload, out)")


def _child_main(payload: bytes, out: str) -> None:
  """A child's body for `call_in_child`: writes ("ok", fn(*args)) or ("error", text) to
  the file `out`."""
  import pickle  # noqa: PLC0415

  fn, args = pickle.loads(payload)
  try:
    result = ("ok", fn(*args))
  except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises)
    result = ("error", f"{type(e).__name__}: {e}")
  pathlib.Path(out).write_bytes(pickle.dumps(result))


def call_in_child(fn: Any, *args: Any) -> Any:
  """fn(*args) in a fresh Python process; returns its (picklable) result. `fn` must be
  importable by name (a module-level function). The child's stdout is printed here, so a
  notebook shows its progress; its stderr (absl's log) goes where this process's goes.

  Each cpu-scale run holds several GB (the model, the sampler's weights and KV cache,
  compiled programs), and not all of it is returned when the run ends: one process that ran
  six SmolLM2 arms in a row grew to 22 GB and was killed on a 24 GB machine. A child per
  run gives each one a fresh process. Raises RuntimeError naming the child's exception, or
  its exit code if it died without one (e.g. killed for memory). A KeyboardInterrupt here
  (a notebook's interrupt reaches the kernel only) is passed on to the child as SIGINT, so
  it stops after its current step and checkpoints as a signalled run does, then re-raised.
  """
  import pickle  # noqa: PLC0415
  import signal  # noqa: PLC0415

  name = getattr(fn, "__name__", repr(fn))
  with tempfile.TemporaryDirectory(prefix="tree_rl_child_") as scratch:
    out = pathlib.Path(scratch) / "result.pkl"
    child = subprocess.Popen([sys.executable, "-c", _CHILD_BOOT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)
    child.stdin.buffer.write(pickle.dumps((list(sys.path), pickle.dumps((fn, args)), str(out))))
    child.stdin.close()
    interrupted = False
    while True:
      try:
        for line in child.stdout:
          sys.stdout.write(line)
        break
      except KeyboardInterrupt:
        if child.poll() is None:
          child.send_signal(signal.SIGINT)
        interrupted = True
    code = child.wait()
    if interrupted:
      raise KeyboardInterrupt(f"{name} was interrupted; its child process stopped")
    if not out.is_file():
      raise RuntimeError(f"{name}'s child process exited with code {code} before it "
                         f"returned (a negative code is the signal that killed it, e.g. -9 "
                         f"when it ran out of memory)")
    status, value = pickle.loads(out.read_bytes())
  if status == "error":
    raise RuntimeError(f"{name} failed in its child process: {value}")
  return value


def _call(isolate: bool, fn: Any, *args: Any) -> Any:
  """fn(*args), in a child process (`call_in_child`) when `isolate`."""
  return call_in_child(fn, *args) if isolate else fn(*args)


def _run(config: Any, workdir: str | pathlib.Path, isolate: bool, pass_k: int = 0
         ) -> dict[str, Any]:
  """`_train`, in a child process when `isolate`."""
  return _call(isolate, _train, config, str(workdir), pass_k)


def warm_start_key(config: Any) -> str:
  """12 hex digits naming what a run does before its first RL step: a hash of its config
  without `RL_ONLY_FIELDS`, plus whether it keeps a reference model and which stateful
  strategy (with its settings) it uses."""
  import hashlib  # noqa: PLC0415

  from tree_rl.checkpoint import flatten_dotted  # noqa: PLC0415
  from tree_rl.config_types import RunConfig  # noqa: PLC0415

  flat = flatten_dotted(_jsonable(config.to_dict()))
  kept = {k: v for k, v in flat.items()
          if not any(k == f or k.startswith(f + ".") for f in RL_ONLY_FIELDS)}
  kept["_with_ref"] = RunConfig.from_config_dict(config).algo.loss_config().kl_coef > 0
  if config.rollout.strategy in _STATEFUL_STRATEGIES:
    kept["_method_state"] = [config.rollout.strategy,
                             _jsonable(dict(config.rollout.strategy_kwargs))]
  text = json.dumps(kept, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def warm_start(config: Any, root: str | pathlib.Path, isolate: bool = True, pass_k: int = 0
               ) -> pathlib.Path:
  """The folder of `config`'s warm start under `<root>/.warm_starts/`: its base eval, SFT
  and SFT eval, run now (`num_steps=0`; in a child process when `isolate`) unless a
  finished one is there (`warm.json`, written last; an interrupted one resumes). Its
  `checkpoints/` holds the policy after SFT with a fresh RL optimizer state, which
  `config.resume` restores. pass_k > 0: the SFT policy's `sampled_eval` too (once per
  warm start and k), the baseline of the RL policies' pass@k."""
  path = pathlib.Path(root) / WARM_DIR / f"{warm_start_key(config)}_s{int(config.seed)}"
  if not (path / WARM_MARKER).is_file():
    _run_warm_start(config, path, isolate)
  sampled = (_read_json(path / SAMPLED_EVAL) or {}).get("metrics") or {}
  if pass_k and f"pass@{pass_k}" not in sampled:
    print(f"=== warm start {path.name}: sampled eval, pass@1..{pass_k}", flush=True)
    _call(isolate, _sampled_eval, str(path), pass_k)
  return path


def _run_warm_start(config: Any, path: pathlib.Path, isolate: bool) -> None:
  """Runs the warm start in `path` (`warm_start`) and marks it finished."""
  warm = config.copy_and_resolve_references()
  warm.num_steps = 0
  where, started = provenance(), time.perf_counter()
  print(f"=== warm start {path.name}: base eval, {config.sft.steps} SFT steps, SFT eval",
        flush=True)
  if "sft" not in _run(warm, path, isolate)["eval"]:  # a signal stopped it; its SFT
    raise KeyboardInterrupt(f"the warm start {path} stopped before its SFT eval; run the "
                            f"cell again to resume it")  # progress checkpoint is kept
  record = {"key": path.name, "wall_s": round(time.perf_counter() - started, 1), **where}
  tmp = path / (WARM_MARKER + ".tmp")
  tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
  tmp.replace(path / WARM_MARKER)


def _graft_warm_start(path: pathlib.Path, warm: pathlib.Path) -> None:
  """Gives a run that resumed from `warm` the warm start's eval files and metrics rows (its
  SFT steps, base and SFT evals) ahead of its own, so the folder reads as one whole run.
  A folder that has them already (a graft before an interruption) is left as it is."""
  own = path / "metrics.jsonl"
  if any(r.get("phase") == "eval:base" for r in _read_jsonl(own)):
    return
  rows = own.read_text(encoding="utf-8") if own.is_file() else ""
  for stage in ("base", "sft"):
    if (warm / f"eval_{stage}.json").is_file():
      shutil.copyfile(warm / f"eval_{stage}.json", path / f"eval_{stage}.json")
  head = (warm / "metrics.jsonl").read_text(encoding="utf-8")
  tmp = path / "metrics.jsonl.tmp"
  tmp.write_text(head + rows, encoding="utf-8")
  tmp.replace(path / "metrics.jsonl")


def run_arm(paper: str, arm: Arm, seed: int, scale: str, root: str | pathlib.Path,
            rerun: bool = False, pass_k: int = 0, keep_checkpoints: bool = False,
            replot_only: bool = False, share_warm_start: bool = True, isolate: bool = True
            ) -> Run | None:
  """Trains and evaluates one (arm, seed) in `<root>/<paper>/<arm>_s<seed>` and returns its
  record. A finished run there is not run again unless `rerun` (then its folder is emptied
  first); its record is returned as it is, with a warning when its saved config differs
  from the one this arm builds now. An unfinished one resumes from its checkpoint.

  pass_k > 0: after training, the final policy is also evaluated with pass_k samples per
  held-out task at the rollout temperature (`sampled_eval`: eval_sampled.json, pass@1..k),
  and so is the warm start's SFT policy (eval_sft_sampled.json).
  keep_checkpoints: keep the checkpoints and TensorBoard events (not worth committing).
  replot_only: train nothing (regenerating tables from committed results must never start
  hours of training); returns the finished run's record, else None.
  share_warm_start: with SFT (and no `resume` of the arm's own), run the base eval, SFT and
  SFT eval once per preset and seed (`warm_start`) and start the RL from there; False: the
  run does them itself.
  isolate: train (and the warm start, and the sampled eval) in a child process
  (`call_in_child`), so a notebook that runs many arms holds no memory of the finished
  ones; False: in this process.
  """
  path = run_dir(root, paper, arm.name, seed)
  config = build_config(arm, seed, scale)
  if replot_only or (is_finished(path) and not rerun):
    if not is_finished(path):
      print(f"no finished run at {path}: left out (replot only)", flush=True)
      return None
    changed = config_changes(path, config)
    if changed:
      print(f"WARNING: {path} was run with another config ({', '.join(changed)}); its "
            f"results are shown as they are. RERUN = True runs it again.", file=sys.stderr)
    return load_run(path)
  if rerun and path.exists():
    shutil.rmtree(path)
  warm = None
  if share_warm_start and config.sft.steps and not config.resume:
    warm = warm_start(config, root, isolate, pass_k)
    config.resume = str((warm / "checkpoints").resolve())
  where = provenance()  # at the start: the code that trains, not a later edit
  started = time.perf_counter()  # the warm start's own wall is in its record
  print(f"=== {paper}/{path.name} ({scale})", flush=True)
  steps = _run(config, path, isolate, pass_k)["steps"]
  if steps != config.num_steps:  # a signal stopped it; its checkpoint is kept
    raise KeyboardInterrupt(f"{path} stopped after step {steps} of {config.num_steps}; "
                            f"run the cell again to resume it")
  if warm is not None:
    _graft_warm_start(path, warm)
    if pass_k:  # the SFT policy's pass@k, beside the RL policy's
      shutil.copyfile(warm / SAMPLED_EVAL, path / "eval_sft_sampled.json")
  if not keep_checkpoints:
    prune(path)
  record = {"paper": paper, "arm": arm.name, "seed": int(seed), "scale": scale,
            "config": arm.config, "overrides": _jsonable(dict(arm.overrides)),
            "steps": steps, "wall_s": round(time.perf_counter() - started, 1), **where}
  if warm is not None:
    record["warm_start"] = _read_json(warm / WARM_MARKER)
  tmp = path / (FINISHED_MARKER + ".tmp")
  tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
  tmp.replace(path / FINISHED_MARKER)
  return load_run(path)


def run_arms(paper: str, arms: Iterable[Arm], scale: str, root: str | pathlib.Path,
             rerun: bool = False, pass_k: int = 0, replot_only: bool = False,
             isolate: bool = True) -> list[Run]:
  """`run_arm` for every seed of every arm (the first seed only at the smoke scale); the
  records of the runs there are (with `replot_only`, of the finished ones)."""
  runs = [run_arm(paper, arm, seed, scale, root, rerun=rerun, pass_k=pass_k,
                  replot_only=replot_only, isolate=isolate)
          for arm in arms for seed in (arm.seeds[:1] if scale == "smoke" else arm.seeds)]
  return [r for r in runs if r is not None]


def sampled_eval(path: str | pathlib.Path, num_samples: int) -> dict[str, float]:
  """The run's latest checkpoint on its held-out tasks, `num_samples` episodes per task
  sampled as in training (the rollout's temperature, top-p, top-k), so pass@1..num_samples
  are defined (the trainer's own evals are greedy: pass@1 only). Writes
  eval_sampled.json and returns its metrics."""
  from tree_rl.checkpoint import restore_policy  # noqa: PLC0415
  from tree_rl.envs import make_family  # noqa: PLC0415
  from tree_rl.evaluate import evaluate  # noqa: PLC0415
  from tree_rl.rollout.chat import ChatFormat  # noqa: PLC0415
  from tree_rl.rollout.engine import SamplingParams  # noqa: PLC0415
  from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: PLC0415
  from tree_rl.rollout.policy import engine_policy  # noqa: PLC0415

  path = pathlib.Path(path)
  policy, tokenizer, cfg = restore_policy(path)
  family = make_family(cfg.task.family, **cfg.task.kwargs)
  tasks = family.generate("eval", cfg.task.num_eval_tasks, cfg.task.eval_task_seed)
  chat = ChatFormat.from_tokenizer(tokenizer)
  r = cfg.rollout
  engine = JaxSampler(policy, rows=r.cache_rows, slots=r.max_context_tokens,
                      tokenizer=tokenizer, eos_ids=chat.eos_ids, seed=cfg.seed)
  params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)
  report = evaluate(family, tasks, engine_policy(engine, chat, params),
                    num_samples=num_samples, pass_k=tuple(range(1, num_samples + 1)),
                    max_turns=r.max_turns or None, encode=chat.encode)
  report.to_json(str(path / SAMPLED_EVAL))
  return dict(report.metrics)


# ============================== Loading ==============================


@dataclasses.dataclass
class Run:
  """What one run left on disk.

  Attributes:
    final: "<stage>/<metric>" of each evaluation (stages base, sft, rl, step<k>, sampled
      and sft_sampled; from eval_<stage>.json, else from metrics.jsonl's eval rows),
      "rl_minus_sft/<metric>" (what RL changed, per seed, on the same held-out tasks, for
      each metric both evals report), "train/<key>" (the mean of the last TAIL_STEPS RL
      steps' finite values of each logged key) and "wall_s" (phases.txt's wall time).
    history: metrics.jsonl's rows in order (RL steps, SFT steps and evals, see `phase`).
    finished: `is_finished`; an unfinished run's numbers are as far as it got.
  """

  paper: str
  arm: str
  seed: int
  path: pathlib.Path
  finished: bool
  final: dict[str, float]
  history: list[dict[str, Any]]
  config: dict[str, Any]


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  """The rows of a JSONL file; a line a kill cut short (not valid JSON) is skipped."""
  if not path.is_file():
    return []
  rows = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(row, dict):
      rows.append(row)
  return rows


def _number(value: Any) -> float | None:
  """A metric value as a float (MetricWriter writes non-finite ones as text), or None."""
  if isinstance(value, bool) or value is None:
    return None
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError):
    return None
  return value if isinstance(value, dict) else None


def load_run(path: str | pathlib.Path) -> Run | None:
  """The record of one run folder, or None when its name is not `<arm>_s<seed>` or it holds
  nothing to show (no metrics, no eval)."""
  path = pathlib.Path(path)
  meta = _read_json(path / FINISHED_MARKER) or {}
  match = _RUN_DIR.match(path.name)
  if not match:
    return None
  arm, seed = str(meta.get("arm", match["arm"])), int(meta.get("seed", match["seed"]))
  history = _read_jsonl(path / "metrics.jsonl")
  final: dict[str, float] = {}
  for row in history:  # evals logged by the trainer: the fallback for a missing eval JSON
    phase = str(row.get("phase", ""))
    if phase.startswith("eval:"):
      for key, value in row.items():
        if key.startswith("eval/") and _number(value) is not None:
          final[f"{phase[5:]}/{key[5:]}"] = _number(value)
  for eval_path in sorted(path.glob("eval_*.json")):
    report = _read_json(eval_path)
    metrics = report.get("metrics") if report else None
    if isinstance(metrics, dict):
      stage = eval_path.stem[len("eval_"):]
      final.update({f"{stage}/{k}": _number(v) for k, v in metrics.items()
                    if _number(v) is not None})
  for key in [k[len("rl/"):] for k in final if k.startswith("rl/")]:
    if f"sft/{key}" in final:  # paired: the same held-out tasks
      final[f"rl_minus_sft/{key}"] = final[f"rl/{key}"] - final[f"sft/{key}"]
  rl_rows = [r for r in history if r.get("phase", "rl") == "rl"]
  tail = rl_rows[-TAIL_STEPS:]
  for key in sorted({k for r in tail for k in r} - {"step", "phase"}):
    values = [v for v in (_number(r.get(key)) for r in tail) if v is not None and math.isfinite(v)]
    if values:
      final[f"train/{key}"] = sum(values) / len(values)
  phases = path / "phases.txt"
  if phases.is_file():
    for line in phases.read_text(encoding="utf-8").splitlines():
      parts = line.split()
      if len(parts) >= 2 and parts[0] == "wall" and _number(parts[-2]) is not None:
        final["wall_s"] = _number(parts[-2])
  if not history and not final:
    return None
  return Run(paper=str(meta.get("paper") or path.parent.name), arm=arm, seed=seed, path=path,
             finished=is_finished(path), final=final, history=history,
             config=_read_json(path / "config.json") or {})


def load_runs(root: str | pathlib.Path, paper: str) -> list[Run]:
  """Every run under `<root>/<paper>/`, by arm then seed; folders that are not runs, runs
  that left nothing readable and unreadable files are skipped, not fatal."""
  folder = pathlib.Path(root) / paper
  if not folder.is_dir():
    return []
  runs = [run for child in sorted(folder.iterdir()) if child.is_dir()
          for run in [load_run(child)] if run is not None]
  return sorted(runs, key=lambda r: (r.arm, r.seed))


# ============================== Tables ==============================


@dataclasses.dataclass(frozen=True)
class Stat:
  """A column's value over an arm's seeds: the mean, the sample standard deviation (ddof 1;
  NaN with fewer than two seeds) and how many seeds had the value."""

  mean: float
  std: float
  n: int


@dataclasses.dataclass(frozen=True)
class Row:
  arm: str
  runs: int  # finished runs (seeds) of the arm
  cells: dict[str, Stat]


def _arm_names(arms: Sequence[Arm | str] | None, runs: Sequence[Run]) -> list[str]:
  if arms is None:
    return list(dict.fromkeys(r.arm for r in runs))
  return [a.name if isinstance(a, Arm) else a for a in arms]


def _stat(values: Sequence[float]) -> Stat:
  n = len(values)
  if not n:
    return Stat(float("nan"), float("nan"), 0)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
  return Stat(mean, std, n)


def summarize(runs: Sequence[Run], columns: Sequence[str],
              arms: Sequence[Arm | str] | None = None, include_unfinished: bool = False
              ) -> list[Row]:
  """Per arm (in `arms`' order; default: as they come in `runs`), each column's `Stat` over
  its runs' `final` values. Unfinished runs are left out unless `include_unfinished`; an arm
  without runs still gets a row (0 runs), so a table shows what is missing."""
  rows = []
  for name in _arm_names(arms, runs):
    mine = [r for r in runs if r.arm == name and (r.finished or include_unfinished)]
    cells = {}
    for col in columns:
      values = [r.final[col] for r in mine if col in r.final and math.isfinite(r.final[col])]
      cells[col] = _stat(values)
    rows.append(Row(arm=name, runs=len(mine), cells=cells))
  return rows


def _cell(stat: Stat, runs: int, digits: int) -> str:
  if not stat.n:
    return "–"
  text = f"{stat.mean:.{digits}f}"
  if stat.n > 1:
    text += f" ± {stat.std:.{digits}f}"
  if stat.n != runs:
    text += f" (n={stat.n})"
  return text


def summary_table(runs: Sequence[Run], columns: Sequence[str],
                  arms: Sequence[Arm | str] | None = None, digits: int = 3,
                  include_unfinished: bool = False) -> str:
  """`summarize` as a markdown table: one row per arm, "mean ± std" per column over the
  arm's seeds (std over seeds, ddof 1; a lone seed shows its value), the seed count in
  column n, and "(n=k)" where only k of them have that column."""
  rows = summarize(runs, columns, arms, include_unfinished)
  lines = ["| arm | n | " + " | ".join(columns) + " |",
           "|---|---:|" + "---:|" * len(columns)]
  for row in rows:
    lines.append(f"| {row.arm} | {row.runs} | "
                 + " | ".join(_cell(row.cells[c], row.runs, digits) for c in columns) + " |")
  return "\n".join(lines)


# ============================== Plots ==============================


def _pyplot():
  """pyplot on the Agg backend, except in a notebook kernel, whose backend is kept."""
  import matplotlib  # noqa: PLC0415

  if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def _save(plt, fig, path: str | pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def curve(run: Run, metric: str) -> dict[int, float]:
  """step -> the run's finite value of `metric` in its RL and eval rows (SFT rows left out;
  of two rows at one step the later wins: the SFT eval over the base eval at step 0)."""
  out = {}
  for row in run.history:
    step, value = _number(row.get("step")), _number(row.get(metric))
    if row.get("phase") != "sft" and step is not None and value is not None and math.isfinite(
        value):
      out[int(step)] = value
  return out


def plot_curves(runs: Sequence[Run], metric: str, path: str | pathlib.Path,
                arms: Sequence[Arm | str] | None = None, title: str = "") -> pathlib.Path:
  """One line per arm: `metric` over steps, the mean over its seeds, with a ±1 std band
  where two or more seeds have the step. Saved as a PNG at `path`, which is returned."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.0, 3.6))
  for name in _arm_names(arms, runs):
    curves = [curve(r, metric) for r in runs if r.arm == name]
    steps = sorted({s for c in curves for s in c})
    if not steps:
      continue
    stats = [_stat([c[s] for c in curves if s in c]) for s in steps]
    mean = [s.mean for s in stats]
    ax.plot(steps, mean, marker="o", ms=3, label=name)
    banded = [(x, s) for x, s in zip(steps, stats) if s.n > 1]
    if banded:
      ax.fill_between([x for x, _ in banded], [s.mean - s.std for _, s in banded],
                      [s.mean + s.std for _, s in banded], alpha=0.2)
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.set_xlabel("step")
  ax.set_ylabel(metric)
  ax.set_title(title or metric)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  return _save(plt, fig, path)


def plot_bars(runs: Sequence[Run], column: str, path: str | pathlib.Path,
              arms: Sequence[Arm | str] | None = None, title: str = "") -> pathlib.Path:
  """One bar per arm: the mean of a `final` column over its finished seeds, ±1 std error
  bars; an arm without a value has no bar and "(no runs)" under its name. Saved as a PNG at
  `path`, which is returned."""
  plt = _pyplot()
  rows = summarize(runs, [column], arms)
  fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 1.5), 3.6))
  xs = list(range(len(rows)))
  stats = [r.cells[column] for r in rows]
  ax.bar(xs, [s.mean if s.n else 0.0 for s in stats],
         yerr=[s.std if s.n > 1 else 0.0 for s in stats], capsize=3,
         color=["C0" if s.n else "none" for s in stats])
  ax.set_xticks(xs, [r.arm if s.n else f"{r.arm}\n(no runs)" for r, s in zip(rows, stats)],
                rotation=30, ha="right", fontsize=8)
  ax.set_ylabel(column)
  ax.set_title(title or column)
  return _save(plt, fig, path)


def plot_columns(runs: Sequence[Run], columns: Sequence[str], path: str | pathlib.Path,
                 arms: Sequence[Arm | str] | None = None, title: str = "",
                 xlabel: str = "") -> pathlib.Path:
  """One line per arm across several `final` columns (e.g. pass@1..k): the mean over its
  finished seeds, ±1 std error bars. Saved as a PNG at `path`, which is returned."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6.0, 3.6))
  for row in summarize(runs, columns, arms):
    pts = [(i, row.cells[c]) for i, c in enumerate(columns) if row.cells[c].n]
    if pts:
      ax.errorbar([i for i, _ in pts], [s.mean for _, s in pts],
                  yerr=[s.std if s.n > 1 else 0.0 for _, s in pts], marker="o", ms=3,
                  capsize=3, label=row.arm)
  ax.set_xticks(list(range(len(columns))), list(columns), fontsize=8)
  ax.set_xlabel(xlabel)
  ax.set_title(title)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  return _save(plt, fig, path)


def write_tables(runs: Sequence[Run], folder: str | pathlib.Path, heading: str,
                 sections: Mapping[str, tuple[Sequence[Arm], Sequence[str]]]) -> str:
  """One `summary_table` per section ({title: (arms, columns)}) under `heading`, written to
  `<folder>/tables.md`; returns the sections' markdown."""
  tables = "\n\n".join(f"### {title}\n\n{summary_table(runs, columns, arms)}"
                       for title, (arms, columns) in sections.items())
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "tables.md").write_text(f"## {heading}\n\n{tables}\n", encoding="utf-8")
  return tables


def show(item: str | pathlib.Path) -> None:
  """A table (markdown text) or a saved plot (a .png path): displayed in a notebook,
  printed elsewhere."""
  is_png = isinstance(item, pathlib.Path) or str(item).endswith(".png")
  if "ipykernel" in sys.modules:
    from IPython.display import Image, Markdown, display  # noqa: PLC0415

    display(Image(filename=str(item)) if is_png else Markdown(str(item)))
  else:
    print(f"plot: {item}" if is_png else item, flush=True)
