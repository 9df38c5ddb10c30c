"""Running arms: each (arm, seed) is a `launch/train.py` process with its own folder.

A run's command is `python launch/train.py --config=configs/<file>.py:<arg>
--workdir=<root>/<paper>/<arm>_s<seed> --overrides=<JSON>` (`lib.arms.config_file` and
`lib.arms.overrides`), so a notebook's run is the CLI's, and the notebook's own process
holds no model. An arm with a `warm_start` first runs that arm (once per seed, in
`<root>/.warm_starts/<paper>/`) and resumes from its checkpoint; its folder then gets the
warm start's evals and metrics rows, so it reads as one whole run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from lib.arms import Arm, build_config, config_file, overrides, repo_root
from lib.results import FINISHED_MARKER, Run, is_finished, load_run, read_json, read_jsonl

# What a finished run keeps (file names and glob patterns); everything else is deleted.
KEEP = ("arm.json", "config.json", "metrics.jsonl", "phases.txt", "eval_*.json")
WARM_DIR = ".warm_starts"
SAMPLED_EVAL = "eval_sampled.json"  # launch/evaluate.py --samples=k: pass@1..k
# launch/evaluate.py --split=train --samples=k: the RL policy, and the warm start's, on the
# training tasks the arm's RL drew from (rollout.task_ids)
POOL_EVAL, SFT_POOL_EVAL = "eval_pool.json", "eval_sft_pool.json"


def run_dir(root: str | pathlib.Path, paper: str, arm: str, seed: int) -> pathlib.Path:
  return pathlib.Path(root) / paper / f"{arm}_s{int(seed)}"


def provenance(repo: str | pathlib.Path | None = None) -> dict[str, str]:
  """Where a run ran: the git commit of `repo` (default: the checkout that holds this
  harness), with "+dirty" for uncommitted changes to tracked files outside results/
  ("unknown" outside a git clone), and the machine (JAX backend, device kind and count,
  CPU cores)."""
  import jax  # noqa: PLC0415

  repo = pathlib.Path(repo) if repo else repo_root()
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


# ============================== Processes ==============================


def launch(args: Sequence[str]) -> None:
  """Runs `python <args>` (a launch/ script) in the repository root and prints its stdout
  here as it comes, so a notebook shows the run's progress; its stderr (absl's log) goes
  where this process's goes.

  A KeyboardInterrupt here (a notebook's interrupt reaches the kernel only) is passed on to
  the child as SIGINT, so it stops after its current step and checkpoints, as a signalled
  launch/train.py does; the KeyboardInterrupt is raised once the child has exited.

  Raises:
    RuntimeError: the child exited with a nonzero code (named, with the command; a negative
      code is the signal that killed it, e.g. -9 when it ran out of memory).
  """
  cmd = [sys.executable, *args]
  child = subprocess.Popen(cmd, cwd=repo_root(), stdout=subprocess.PIPE, text=True, bufsize=1)
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
    raise KeyboardInterrupt(f"{args[0]} was interrupted; its process stopped")
  if code:
    raise RuntimeError(f"{args[0]} exited with code {code}: {' '.join(cmd)}")


def train_command(arm: Arm, seed: int, scale: str, workdir: pathlib.Path,
                  extra: dict[str, Any] | None = None) -> list[str]:
  """launch/train.py's arguments for the run of (arm, seed) in `workdir`; `extra` are set
  after the arm's overrides (the warm start's `resume`)."""
  path, arg = config_file(arm, scale)
  return ["launch/train.py", f"--config={path}" + (f":{arg}" if arg else ""),
          f"--workdir={workdir}",
          "--overrides=" + json.dumps({**overrides(arm, seed, scale), **(extra or {})})]


def sampled_eval(path: pathlib.Path, num_samples: int, out: pathlib.Path | None = None,
                 task_ids: Sequence[int] | None = None) -> None:
  """launch/evaluate.py --samples: the run's latest checkpoint, `num_samples` episodes per
  task sampled at its rollout settings, written to `out` (default `SAMPLED_EVAL`;
  pass@1..k). The tasks are the held-out ones, or with `task_ids` those training tasks
  (--split=train)."""
  args = ["launch/evaluate.py", f"--model={path}", f"--samples={int(num_samples)}",
          f"--out={out or path / SAMPLED_EVAL}"]
  if task_ids is not None:
    args += ["--split=train", "--task_ids=" + ",".join(str(int(i)) for i in task_ids)]
  launch(args)


def _final_stage(config: Any) -> str:
  """The stage whose eval file a completed run has: its last evaluation."""
  return "rl" if config.num_steps else "sft" if config.sft.steps else "base"


# ============================== Arms ==============================


def _warm_start(paper: str, arm: Arm, seed: int, scale: str, root: pathlib.Path,
                pass_k: int) -> pathlib.Path:
  """The folder of `arm.warm_start`'s run at `seed`, run now unless finished (its
  checkpoints are kept: the arms resume from them). pass_k > 0: its policy's sampled eval
  too, once per k, the baseline of the RL policies' pass@k."""
  path = run_dir(root / WARM_DIR, paper, arm.warm_start.name, seed)
  run_arm(paper, arm.warm_start, seed, scale, root / WARM_DIR, keep_checkpoints=True)
  sampled = ((read_json(path / SAMPLED_EVAL) or {}).get("metrics") or {})
  if pass_k and f"pass@{pass_k}" not in sampled:
    print(f"=== {path.name}: sampled eval, pass@1..{pass_k}", flush=True)
    sampled_eval(path, pass_k)
  return path


def screen(paper: str, warm_start: Arm, seed: int, scale: str, root: str | pathlib.Path,
           num_tasks: int, num_samples: int, replot_only: bool = False) -> dict[int, float]:
  """Each of the first `num_tasks` training tasks' pass rate under the `warm_start` arm's
  policy at `seed` (run first unless finished): `num_samples` episodes per task sampled at
  its rollout settings (launch/evaluate.py --split=train), kept in
  `<root>/<paper>/screen_s<seed>.json`. An existing file is read, not redone; with
  `replot_only` a missing one gives {}.

  Returns:
    {train-task index: the fraction of its episodes that were correct}.
  """
  root = pathlib.Path(root)
  out = root / paper / f"screen_s{seed}.json"
  if not out.is_file():
    if replot_only:
      print(f"no screen at {out}: nothing to pick a pool from (replot only)", flush=True)
      return {}
    path = run_dir(root / WARM_DIR, paper, warm_start.name, seed)
    run_arm(paper, warm_start, seed, scale, root / WARM_DIR, keep_checkpoints=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"=== {path.name}: screening {num_tasks} training tasks, {num_samples} samples each",
          flush=True)
    sampled_eval(path, num_samples, out, range(num_tasks))
  hits: dict[str, list[bool]] = {}
  for episode in (read_json(out) or {}).get("episodes", []):
    hits.setdefault(episode["task_id"], []).append(bool(episode["correct"]))
  if len(hits) != num_tasks:
    raise ValueError(f"{out} scores {len(hits)} tasks, not the {num_tasks} asked for: delete "
                     f"it to screen again")
  return {i: sum(v) / len(v) for i, v in enumerate(hits.values())}  # in the order screened


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
            replot_only: bool = False, pool_samples: int = 0) -> Run | None:
  """Trains and evaluates one (arm, seed) in `<root>/<paper>/<arm>_s<seed>` (a
  launch/train.py process) and returns its record.

  A finished run there (arm.json, written last) is not run again unless `rerun` (then its
  folder is emptied first); its record is returned as it is, with a warning when its saved
  config differs from the one this arm builds now. An unfinished one resumes from its
  checkpoint. With `arm.warm_start`, that arm runs first unless it has finished
  (`_warm_start`; `rerun` leaves a finished one as it is, shared by other arms) and this run
  resumes from its checkpoint.

  Args:
    pass_k: > 0: the final policy is also evaluated with pass_k samples per held-out task
      at the rollout temperature (launch/evaluate.py --samples: eval_sampled.json,
      pass@1..k), and so is the warm start's policy (eval_sft_sampled.json).
    keep_checkpoints: keep the checkpoints and TensorBoard events (not worth committing).
    pool_samples: > 0: the final policy and the warm start's are also evaluated with that
      many samples per task on the training tasks RL drew from (the arm's
      rollout.task_ids, which it must set): `POOL_EVAL` and `SFT_POOL_EVAL`, paired task by
      task (the positive control, notebooks/control.py).
    replot_only: train nothing (regenerating tables from committed results must never
      start hours of training); returns the finished run's record, else None.

  Raises:
    ValueError: pool_samples without rollout.task_ids or without a warm start.
    KeyboardInterrupt: the run stopped before its final eval (a signal); running the arm
      again resumes it.
  """
  root = pathlib.Path(root)
  path = run_dir(root, paper, arm.name, seed)
  config = build_config(arm, seed, scale)
  pool = tuple(config.rollout.task_ids)
  if pool_samples and not (pool and arm.warm_start is not None):
    raise ValueError(f"arm {arm.name!r}: pool_samples evaluates the training tasks RL drew "
                     f"from against the warm start's policy; it needs rollout.task_ids and a "
                     f"warm start")
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
  warm = extra = None
  if arm.warm_start is not None:
    warm = _warm_start(paper, arm, seed, scale, root, pass_k)
    extra = {"resume": str((warm / "checkpoints").resolve())}
  where = provenance()  # at the start: the code that trains, not a later edit
  started = time.perf_counter()  # the warm start's own wall is in its record
  print(f"=== {paper}/{path.name} ({scale})", flush=True)
  launch(train_command(arm, seed, scale, path, extra))
  stage = _final_stage(config)
  if not (path / f"eval_{stage}.json").is_file():  # a signal stopped it; its checkpoint is kept
    raise KeyboardInterrupt(f"{path} stopped before its {stage} eval; run the cell again to "
                            f"resume it")
  if pass_k:
    sampled_eval(path, pass_k)
  if pool_samples:
    sampled_eval(path, pool_samples, path / POOL_EVAL, pool)
    sampled_eval(warm, pool_samples, path / SFT_POOL_EVAL, pool)
  if warm is not None:
    _graft_warm_start(path, warm)
    if pass_k:  # the SFT policy's pass@k, beside the RL policy's
      shutil.copyfile(warm / SAMPLED_EVAL, path / "eval_sft_sampled.json")
  if not keep_checkpoints:
    prune(path)
  record = {"paper": paper, "arm": arm.name, "seed": int(seed), "scale": scale,
            "config": arm.config, "overrides": _jsonable(dict(arm.overrides)),
            "steps": int(config.num_steps), "wall_s": round(time.perf_counter() - started, 1),
            **where}
  if warm is not None:
    record["warm_start"] = read_json(warm / FINISHED_MARKER)
  tmp = path / (FINISHED_MARKER + ".tmp")
  tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
  tmp.replace(path / FINISHED_MARKER)
  return load_run(path)


def run_arms(paper: str, arms: Iterable[Arm], scale: str, root: str | pathlib.Path,
             rerun: bool = False, pass_k: int = 0, replot_only: bool = False,
             pool_samples: int = 0) -> list[Run]:
  """`run_arm` for every seed of every arm (the first seed only at the smoke scale); the
  records of the runs there are (with `replot_only`, of the finished ones)."""
  runs = [run_arm(paper, arm, seed, scale, root, rerun=rerun, pass_k=pass_k,
                  replot_only=replot_only, pool_samples=pool_samples)
          for arm in arms for seed in (arm.seeds[:1] if scale == "smoke" else arm.seeds)]
  return [r for r in runs if r is not None]
