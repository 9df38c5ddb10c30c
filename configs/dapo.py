"""DAPO on the tool world: flat groups, clip-higher (eps_low 0.2, eps_high 0.28),
token-mean aggregation, overlong shaping and dynamic sampling (DAPO's defaults,
arXiv 2503.14476 §3.1-3.4): a group whose rewards are all equal is dropped and the
next prompts are rolled out in its place, for at most 8 extra rounds a step (1 under
runlocal; a step with no mixed group skips its update).

Command: python launch/train.py --config=configs/dapo.py --workdir=/tmp/dapo
Ablations: :task=math ; :dynamic=false (no dynamic sampling: every group is trained
on) ; :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy vs GRPO at equal steps. These defaults are not yet
measured. On the notebooks' CPU preset (notebooks/portool.py): SFT 0.344 -> 0.531 (seed 0)
and 0.438 -> 0.469 (seed 1), GRPO 0.469 and 0.438: results/portool/, RESULTS.md.
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4, dynamic=True)
  c = common.base_config()
  c.algo.estimator = "dapo"
  c.algo.loss = dict(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean")
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  c.rollout.dynamic_sampling = arg.dynamic
  return common.apply_common_args(c, arg)
