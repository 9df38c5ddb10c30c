"""DAPO on the tool world: flat groups, clip-higher (eps_low 0.2, eps_high 0.28),
token-mean aggregation and overlong shaping (DAPO's defaults).

Command: python launch/train.py --config=configs/dapo.py --workdir=/tmp/dapo
Ablations: :task=math ; :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy vs GRPO at equal steps (not yet measured).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4)
  c = common.base_config()
  c.algo.estimator = "dapo"
  c.algo.loss = dict(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean")
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
