"""TRACE-style training on multi-hop search QA: tree-structured groups optimised with
TreeRPO (sibling z-scores of backed-up means) (specs/trace.md).

Command: python launch/train.py --config=configs/trace.py --workdir=/tmp/trace
Ablations: :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy (exact match) on held-out questions (not yet measured).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **{**common.COMMON_ARGS, "task": "search_qa"}, group=4)
  c = common.base_config()
  c.algo.estimator = "tree_rpo"
  c.rollout.strategy = "trace"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
