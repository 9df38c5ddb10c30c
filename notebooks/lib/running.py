"""Running arms: each (arm, seed) trains in its own folder, sharing warm starts."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import os
from collections.abc import Iterable
from typing import Any

from lib.arms import Arm, build_config
from lib.results import FINISHED_MARKER, Run, is_finished, load_run, read_json, read_jsonl

# What a finished run keeps (file names and glob patterns); everything else is deleted.
KEEP = ("arm.json", "config.json", "metrics.jsonl", "phases.txt", "eval_*.json")
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


def run_dir(root: str | pathlib.Path, paper: str, arm: str, seed: int) -> pathlib.Path:
  return pathlib.Path(root) / paper / f"{arm}_s{int(seed)}"


def provenance(repo: str | pathlib.Path | None = None) -> dict[str, str]:
  """Where a run ran: the git commit of `repo` (default: tree_rl's checkout), with "+dirty"
  for uncommitted changes to tracked files outside results/ ("unknown" outside a git
  clone), and the machine (JAX backend, device kind and count, CPU cores)."""
  import jax  # noqa: PLC0415

  repo = pathlib.Path(repo) if repo else pathlib.Path(__file__).resolve().parents[2]
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
               "sys.path[:] = path; from lib.running import _child_main; "
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
  sampled = (read_json(path / SAMPLED_EVAL) or {}).get("metrics") or {}
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
  if any(r.get("phase") == "eval:base" for r in read_jsonl(own)):
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
    record["warm_start"] = read_json(warm / WARM_MARKER)
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

