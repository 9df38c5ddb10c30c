"""The kill storm: 20 SIGKILLs at random moments of a `runlocal` run (base eval, SFT, an RL
rollout, an update, between a step's log row and its checkpoint, and inside checkpoint
writes), and 4 SIGTERMs (base eval, SFT, a rollout, a periodic eval), each followed by a
resume. Each SIGTERM ends the process with exit 0 at the phase's next safe point. The final
parameters and optimizer state equal the uninterrupted run's bit for bit, and metrics.jsonl
holds one row per (phase, step) with the uninterrupted run's values (timers excluded).

The runs go through tests/faults/killpoints.py, the launcher with hooks that print where the
run is and pause there; a kill sent during a pause lands inside that moment. The plan below
follows the run's course (base eval, SFT, RL steps with evaluations every 2 steps, the final
eval) so that every kind of moment is hit while the run still makes progress; when in its
pause each kill lands is drawn from a seeded generator.
"""

import collections
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tree_rl.checkpoint import RunCheckpointer

pytestmark = pytest.mark.e2e  # launches and kills training processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAUSE_S = 0.5
STEPS = 6
ARGS = [f"--config={ROOT / 'configs/grpo.py'}:runlocal,steps={STEPS}", "--config.sft.steps=3",
        "--config.eval_every_steps=2"]

# Where each signal lands, at which occurrence of that kind of moment since the launch, and
# which signal: "eval" and "rollout" are a sampler call inside an evaluation or an RL
# rollout, "update" inside the update step, "sft" and "log" after an SFT or RL step's log
# row (before its checkpoint), "ckpt" inside a checkpoint write (SFT progress or RL). Each
# comment says what the run has saved when the signal lands. SIGKILL ends the process there;
# SIGTERM must end it cleanly (exit 0) at the phase's next safe point with its progress saved.
# The plan walks the whole run and hits every kind of moment.
KILL, TERM = signal.SIGKILL, signal.SIGTERM
PLAN = [
    ("eval", 1, KILL),     # base eval; nothing saved
    ("ckpt", 1, KILL),     # SFT progress 0 (the base eval's record) being written
    ("eval", 1, KILL),     # base eval again
    ("eval", 1, TERM),     # base eval: stops once it is saved
    ("sft", 1, KILL),      # SFT step 1 logged, its progress not saved
    ("ckpt", 1, KILL),     # SFT progress 1 being written
    ("sft", 1, TERM),      # SFT step 1 logged: stops with progress 1 saved
    ("sft", 1, KILL),      # SFT step 2 logged, its progress not saved
    ("ckpt", 2, KILL),     # SFT progress 3 being written (progress 2 saved)
    ("eval", 1, KILL),     # the SFT eval (SFT complete)
    ("ckpt", 1, KILL),     # the RL checkpoint at step 0 being written
    ("rollout", 1, TERM),  # step 1's rollout: stops after step 1, saved
    ("rollout", 1, KILL),  # step 2's rollout (step 1 saved)
    ("update", 1, KILL),   # step 2's update
    ("log", 1, KILL),      # step 2 logged, not saved
    ("ckpt", 1, KILL),     # step 2's checkpoint being written
    ("eval", 1, KILL),     # the eval after step 2 (step 2 saved without it)
    ("eval", 1, TERM),     # that eval redone: stops after it
    ("update", 2, KILL),   # step 4's update (step 3 saved)
    ("log", 2, KILL),      # step 5 logged (step 4 saved)
    ("ckpt", 2, KILL),     # step 6's checkpoint being written (step 5 saved)
    ("rollout", 1, KILL),  # step 6's rollout
    ("eval", 1, KILL),     # the final eval (step 6 saved)
    ("eval", 1, KILL),     # the final eval again
]
WHERE = {"generate": None, "update": "update", "row-sft": "sft", "row-rl": "log", "ckpt": "ckpt"}


def _launch(workdir: pathlib.Path, cache: pathlib.Path, pause: float, log: pathlib.Path):
  env = dict(os.environ, KILLPOINT_PAUSE=str(pause), JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.Popen([sys.executable, str(ROOT / "tests/faults/killpoints.py"), *ARGS,
                           f"--workdir={workdir}"], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=open(log, "w"))


def _signal_at(proc, target: str, occurrence: int, sig: int, rng: random.Random) -> int | None:
  """Reads the run's kill points; at the `occurrence`-th one of kind `target`, waits a random
  part of its pause and sends `sig`. Returns the exit code, or None if the run ended first."""
  seen, phase = 0, None
  for line in proc.stdout:
    if not line.startswith("KILLPOINT "):
      continue
    name = line.split()[1]
    if name in ("eval-start", "rollout-start"):
      phase = name.split("-")[0]
      continue
    if (WHERE[name] or phase) != target:
      continue
    seen += 1
    if seen == occurrence:
      time.sleep(rng.uniform(0.0, 0.6 * PAUSE_S))
      proc.send_signal(sig)
      proc.communicate(timeout=300)  # SIGTERM: the run finishes its step and saves
      return proc.returncode
  proc.wait()
  return None


def _result(workdir: pathlib.Path):
  ck = RunCheckpointer(workdir / "checkpoints")
  step = ck.latest_step()
  leaves = ck.manager.restore(step)["state"]  # raw leaves: params, optimizer state, ...
  ck.close()
  rows = collections.defaultdict(list)
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    rows[(r["phase"], r["step"])].append({k: v for k, v in r.items() if not k.startswith("time/")})
  return step, leaves, dict(rows)


def test_twenty_sigkills_and_sigterms_lose_and_duplicate_nothing(tmp_path):
  cache, logs = tmp_path / "jax_cache", tmp_path / "logs"
  logs.mkdir()
  straight = _launch(tmp_path / "straight", cache, 0.0, logs / "straight.txt")
  straight.stdout.read()
  assert straight.wait(timeout=900) == 0, (logs / "straight.txt").read_text()[-3000:]

  rng, kills, storm = random.Random(17), [], tmp_path / "storm"
  for i, (target, occurrence, sig) in enumerate(PLAN):
    log = logs / f"storm{i}.txt"
    code = _signal_at(_launch(storm, cache, PAUSE_S, log), target, occurrence, sig, rng)
    what = f"signal {i + 1} ({sig.name} at {target} #{occurrence}; so far {kills})"
    assert code is not None, f"{what}: the run ended first\n" + log.read_text()[-3000:]
    if sig == TERM:
      assert code == 0, f"{what}: exit {code}\n" + log.read_text()[-3000:]
      assert "signal 15" in log.read_text(), what
    else:
      assert code == -signal.SIGKILL, f"{what}: exit {code}"
      kills.append(target)
    if target == "ckpt" and sig == KILL:  # it landed inside the write: an unfinished step
      assert list(storm.glob("checkpoints*/*.orbax-checkpoint-tmp*")), what
  assert len(kills) == 20
  final = _launch(tmp_path / "storm", cache, 0.0, logs / "final.txt")
  final.stdout.read()
  assert final.wait(timeout=900) == 0, (logs / "final.txt").read_text()[-3000:]

  step_a, leaves_a, rows_a = _result(tmp_path / "straight")
  step_b, leaves_b, rows_b = _result(tmp_path / "storm")
  assert step_a == step_b == STEPS
  assert sorted(leaves_a) == sorted(leaves_b)
  differ = [k for k in leaves_a
            if not np.array_equal(np.asarray(leaves_a[k]), np.asarray(leaves_b[k]))]
  assert not differ, f"arrays that differ from the uninterrupted run: {differ}"
  duplicated = {k: len(v) for k, v in rows_b.items() if len(v) > 1}
  assert not duplicated, duplicated
  assert rows_a == rows_b
  phases = collections.Counter(p.split(":")[0] for p, _ in rows_b)
  assert phases == {"rl": STEPS, "sft": 3, "eval": 5}, phases  # base, sft, step2, step4, rl
  terms = collections.Counter(t for t, _, sig in PLAN if sig == TERM)
  kills = collections.Counter(kills)
  print("\nfaults | phase | SIGKILL | SIGTERM | rows lost | rows duplicated | arrays differing")
  for phase in dict.fromkeys(t for t, _, _ in PLAN):
    print(f"  {phase:8s} | {kills[phase]:2d} | {terms[phase]:2d} | 0 | 0 | 0")
  print(f"  total    | {sum(kills.values()):2d} | {sum(terms.values()):2d} | 0 | 0 | 0 "
        f"({len(leaves_a)} arrays and {len(rows_a)} metrics rows compared)")
