r"""Grows a config's rollout trees with a trained policy, without training, and counts them.

  python launch/measure_rollouts.py --model=runs/apppo --config=configs/portool.py:preset=cpu \
      --overrides='{"rollout.task_ids": [0, 1, 2, 3]}' --repeats=2 --out=/tmp/portool.json

The policy is the run directory's latest checkpoint; the strategy, its options, sampling
and prompts (`rollout.task_ids`, else the whole train split) are the config's. Each tree's
leaves, forks, informative forks (children whose mean outcomes differ), sibling spread and
policy tokens, and each repeat's seconds and sampled tokens, go to --out as JSON
(`tree_rl.rollout.measure`; docs/notebooks.md#mechanisms).
"""

import json
import os
import pathlib
import sys

# The configs import `configs.common`; they live beside this folder, not in the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config whose rollouts to grow.",
                                          lock_config=True)
_MODEL = flags.DEFINE_string("model", None, "Run directory whose latest checkpoint samples.")
_OVERRIDES = flags.DEFINE_string(
    "overrides", "", "A JSON object {dotted config path: value} set after --config, as "
    "launch/train.py's --overrides.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Trees per prompt, each on its own sampling "
                                "stream.")
_SEED = flags.DEFINE_integer("seed", 0, "The sampling streams' seed (repeat r: fold_in(seed, r)).")
_OUT = flags.DEFINE_string("out", None, "The JSON file to write.")
_PLATFORM = flags.DEFINE_string("jax_platform", "", "Force a JAX platform (cpu, gpu, tpu).")
flags.mark_flags_as_required(["config", "model", "out"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # Orbax logs every file it renames at INFO
    logging.set_verbosity(logging.WARNING)
  if _PLATFORM.value:
    os.environ["JAX_PLATFORMS"] = _PLATFORM.value
  from configs import common

  if _OVERRIDES.value:
    try:
      common.override(_CONFIG.value, common.json_overrides(_OVERRIDES.value))
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  import jax

  from tree_rl.rollout.measure import measure_rollouts

  jax.config.update("jax_default_matmul_precision", "highest")  # as training samples
  result = measure_rollouts(_MODEL.value, _CONFIG.value, repeats=_REPEATS.value,
                            seed=_SEED.value)
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_name(out.name + ".tmp")
  tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
  tmp.replace(out)
  trees = [t for c in result["calls"] for t in c["trees"]]
  seconds = sum(c["seconds"] for c in result["calls"])
  print(f"{result['strategy']}: {len(trees)} trees, "
        f"{sum(t['informative_forks'] for t in trees):.0f} informative forks of "
        f"{sum(t['forks'] for t in trees)}, {sum(t['policy_tokens'] for t in trees)} policy "
        f"tokens, {seconds:.1f} s; written to {out}", flush=True)


if __name__ == "__main__":
  app.run(main)
