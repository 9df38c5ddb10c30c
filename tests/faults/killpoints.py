"""`launch/train.py` with kill points, for the kill-storm test (kill_storm_test.py).

    python tests/faults/killpoints.py --config=... --workdir=...

The same job as the launcher, with hooks that print `KILLPOINT <name>` on stdout and then
hold the process for $KILLPOINT_PAUSE seconds (default 0), so that a SIGKILL sent during the
pause lands inside that moment of the run:

- `eval-start` / `rollout-start` (no pause): an evaluation or an RL rollout begins;
- `generate`: after one call of the sampler, inside an evaluation or a rollout;
- `update`: inside the RL update step, its result computed but not yet returned;
- `row-sft` / `row-rl`: a metrics row was written, before the step's checkpoint;
- `ckpt`: inside a checkpoint write, part of it on disk and the step not yet committed.

Nothing else changes: the hooks call the real functions with the same arguments.
"""

import os
import pathlib
import runpy
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAUSE = float(os.environ.get("KILLPOINT_PAUSE", "0"))


def mark(name: str, pause: bool = True) -> None:
  print(f"KILLPOINT {name}", flush=True)
  if pause and PAUSE:
    time.sleep(PAUSE)


def install() -> None:
  import jax
  import orbax.checkpoint as ocp

  from tree_rl import metrics, placement
  from tree_rl.rollout import dynamic_sampling, session
  from tree_rl.rollout.jax_sampler import JaxSampler

  evaluate = session.evaluate  # what the run's Evaluator calls

  def evaluate_hook(*args, **kwargs):
    mark("eval-start", pause=False)
    return evaluate(*args, **kwargs)

  session.evaluate = evaluate_hook

  rollout_step = dynamic_sampling.rollout_step

  def rollout_hook(*args, **kwargs):
    mark("rollout-start", pause=False)
    return rollout_step(*args, **kwargs)

  dynamic_sampling.rollout_step = rollout_hook

  generate = JaxSampler.generate

  def generate_hook(self, requests):
    out = generate(self, requests)
    mark("generate")
    return out

  JaxSampler.generate = generate_hook

  update_step = placement.Placement.update_step

  def update_step_hook(self, *args, **kwargs):
    fn = update_step(self, *args, **kwargs)

    def hooked(*a, **k):
      out = jax.block_until_ready(fn(*a, **k))
      mark("update")
      return out

    return hooked

  placement.Placement.update_step = update_step_hook

  write = metrics.MetricWriter.write

  def write_hook(self, step, values, phase="rl"):
    write(self, step, values, phase=phase)
    if phase in ("rl", "sft"):
      mark(f"row-{phase}")

  metrics.MetricWriter.write = write_hook

  async_save = ocp.JsonCheckpointHandler.async_save

  async def async_save_hook(self, *args, **kwargs):  # the metadata item of a checkpoint
    out = await async_save(self, *args, **kwargs)
    mark("ckpt")
    return out

  ocp.JsonCheckpointHandler.async_save = async_save_hook


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  install()
  sys.argv[0] = str(ROOT / "launch/train.py")
  runpy.run_path(str(ROOT / "launch/train.py"), run_name="__main__")
