"""AWPO on single-step function calling (BFCL format): outcome reward S_format + S_exec,
variance-aware gating, difficulty weighting and the adaptive clip (specs/awpo.md).

Command: python launch/train.py --config=configs/awpo.py --workdir=/tmp/awpo
Ablations: :group=8 ; :runlocal. Needs `pip install --no-deps bfcl-eval` for the eval split.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy (BFCL AST rule) on the bundled BFCL files (not yet measured).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **{**common.COMMON_ARGS, "task": "bfcl"}, group=4)
  c = common.base_config()
  c.algo.estimator = "awpo"
  c.algo.loss = dict(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
