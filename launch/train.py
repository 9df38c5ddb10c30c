"""Main training job: `python launch/train.py --config=configs/apppo.py --workdir=/tmp/run`.

Ablations go after the config file (`--config=configs/apppo.py:task=math,runlocal`) or as
overrides (`--config.optim.lr=3e-6`; a new key or a whole section:
`--overrides='{"rollout.strategy_kwargs": {"budget": 6}, "algo.estimator_kwargs.gamma": 0.9}'`). All logic lives in `tree_rl.train.train_and_evaluate`,
which the tests and notebooks call too; this file only sets up the process (JAX platform,
JAX's share of GPU memory and the multi-process group before the backend starts, matmul
precision).

Several hosts: start this same command on every host with the process group in
`config.distributed` or JAX's variables (docs/sharding.md#several-hosts), e.g.

    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0|1> \
      python launch/train.py --config=configs/grpo.py --config.mesh.fsdp=-1 --workdir=/shared/run
"""

import os
import pathlib
import sys

# The configs import `configs.common`; they live beside this folder, not in the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, evals); "
                               "default: ./runs/<config name>.")
_OVERRIDES = flags.DEFINE_string(
    "overrides", "", "A JSON object {dotted config path: value} set after --config and its "
    "--config.* flags (configs/common.py override): an object replaces the whole section, a "
    "list is set as a tuple, and a path's last part may be a new key of its section.")
_PLATFORM = flags.DEFINE_string("jax_platform", "", "Force a JAX platform (cpu, gpu, tpu).")
_ALLOW_CHANGE = flags.DEFINE_bool("allow_config_change", False,
                                  "Resume the workdir's run even though the config differs "
                                  "from its saved config.json (beyond num_steps, eval and "
                                  "checkpoint cadence, profiling and process settings).")
flags.mark_flags_as_required(["config"])


def set_device_env(config) -> None:
  """Validates `config`, gives JAX its share of GPU memory and joins the run's processes
  (`tree_rl.distributed`): JAX reads $XLA_PYTHON_CLIENT_MEM_FRACTION once, when its backend
  starts, and the process group must be joined before that, so this runs before anything
  touches a device (importing jax starts no backend)."""
  from tree_rl import distributed
  from tree_rl.config_types import RunConfig
  from tree_rl.device_memory import apply_learner_memory_fraction

  cfg = RunConfig.from_config_dict(config)
  apply_learner_memory_fraction(cfg.rollout)
  distributed.initialize(cfg.distributed)


def apply_overrides(config, text: str) -> None:
  """`--overrides`' JSON object set on `config` (configs/common.py override)."""
  from configs import common

  try:
    values = common.json_overrides(text)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  common.override(config, values)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # Orbax logs every file it renames at INFO
    logging.set_verbosity(logging.WARNING)
  if _PLATFORM.value:
    os.environ["JAX_PLATFORMS"] = _PLATFORM.value
  if _OVERRIDES.value:
    apply_overrides(_CONFIG.value, _OVERRIDES.value)
  set_device_env(_CONFIG.value)
  import jax

  from tree_rl import train

  jax.config.update("jax_default_matmul_precision", "highest")
  workdir = _WORKDIR.value or os.path.join(
      "runs", pathlib.Path(flags.FLAGS["config"].config_filename).stem)
  logging.info("JAX process %d of %d, devices: %s; workdir %s", jax.process_index(),
               jax.process_count(), jax.devices(), workdir)
  train.train_and_evaluate(_CONFIG.value, workdir, allow_config_change=_ALLOW_CHANGE.value)


if __name__ == "__main__":
  app.run(main)
