"""ARPO's advantage (GRPO over every leaf of the tree) on the tool world (ARPO, arXiv
2507.19849; tree_rl's reading: docs/methods/grpo.md#arpo-advantage-attribution).

Command: python launch/train.py --config=configs/arpo.py --workdir=/tmp/arpo
Ablations: :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy vs GRPO. These defaults are not yet measured. On the main
job's CPU preset with :group=2 (notebooks/portool.py): SFT 0.344 -> 0.344 (seed 0) and
0.438 -> 0.469 (seed 1), GRPO 0.469 and 0.438: results/portool/, RESULTS.md.
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4)
  c = common.base_config()
  c.algo.estimator = "arpo"
  c.rollout.strategy = "arpo"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
