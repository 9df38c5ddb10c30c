"""Tree-GRPO's advantage (intra- plus inter-subtree z-scores) on the tool world (Tree-GRPO,
arXiv 2509.21240, as TRACE, arXiv 2606.11119, restates it in Eqs. 48-49;
docs/methods/grpo.md#tree-grpo-intra-group).

Command: python launch/train.py --config=configs/tree_grpo.py --workdir=/tmp/tree_grpo
Ablations: :group=N (N initial rollouts a prompt: the random strategy's n_init) ; :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy vs GRPO (not yet measured).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4)
  c = common.base_config()
  c.algo.estimator = "tree_grpo"
  c.rollout.strategy = "random"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
