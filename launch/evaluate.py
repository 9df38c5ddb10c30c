"""Evaluate a policy on a task family's held-out split.

  python launch/evaluate.py --model=/tmp/apppo            # a training run (its checkpoint)
  python launch/evaluate.py --model=/tmp/apppo_hf --task=toolworld --num_tasks=32

  python launch/evaluate.py --model=/tmp/apppo --samples=5  # pass@1..5, sampled
  python launch/evaluate.py --model=/tmp/apppo --split=train --task_ids=3,17 --samples=8

`--model` is a run directory (config.json + checkpoints) or an HF folder. Decoding is
greedy with the embedded JAX sampler; with `--samples=K` (a run directory) each held-out
task gets K episodes sampled as the run's rollouts are (its temperature, top-p, top-k and
seed), so pass@1..K are defined. `--split=train` scores the run's own training tasks
instead (`--task_ids` picks some; default: the run's rollout.task_ids, else all). Prints the
metric table and writes JSON to --out.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

_MODEL = flags.DEFINE_string("model", None, "Run directory or HF folder.")
_TASK = flags.DEFINE_string("task", None, "Task family (default: the run's).")
_NUM = flags.DEFINE_integer("num_tasks", None, "Held-out tasks (default: the run's).")
_SEED = flags.DEFINE_integer("seed", None, "Task seed (default: the run's, else 0).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens per step (default: the run's).")
_TURNS = flags.DEFINE_integer("max_turns", None, "Steps per episode (default: the task "
                              "family's own limit, as the trainer evaluates).")
_SAMPLES = flags.DEFINE_integer("samples", 0, "Episodes per task sampled at the run's rollout "
                                "settings, for pass@1..N (a run directory; its own tasks).")
_SPLIT = flags.DEFINE_enum("split", "eval", ["eval", "train"], "Held-out tasks, or the run's "
                           "own training tasks (a run directory).")
_IDS = flags.DEFINE_list("task_ids", None, "With --split=train: training-task indices "
                         "(default: the run's rollout.task_ids, else all).")
_OUT = flags.DEFINE_string("out", "", "Write the report JSON here.")
flags.mark_flags_as_required(["model"])


def _task_ids() -> list[int] | None:
  if _IDS.value is None:
    return None
  try:
    return [int(i) for i in _IDS.value]
  except ValueError:
    raise app.UsageError(f"--task_ids={','.join(_IDS.value)} must be integers") from None


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  import jax

  from tree_rl.evaluate import evaluate_policy_folder

  jax.config.update("jax_default_matmul_precision", "highest")  # as in training
  if _SAMPLES.value < 0:
    raise app.UsageError(f"--samples={_SAMPLES.value} must be >= 0")
  given = [f"--{f.name}" for f in (_TASK, _NUM, _SEED, _MAX_NEW, _TURNS) if f.value is not None]
  if _SAMPLES.value and given:
    raise app.UsageError(f"--samples evaluates the run on its own tasks and settings; "
                         f"drop {', '.join(given)}")
  report = evaluate_policy_folder(_MODEL.value, task=_TASK.value, num_tasks=_NUM.value,
                                  seed=_SEED.value, max_new_tokens=_MAX_NEW.value,
                                  max_turns=_TURNS.value, num_samples=_SAMPLES.value,
                                  split=_SPLIT.value, task_ids=_task_ids())
  print(report.table())
  if _OUT.value:
    report.to_json(_OUT.value)


if __name__ == "__main__":
  app.run(main)
