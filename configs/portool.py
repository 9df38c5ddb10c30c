"""PORTool: tree rollouts with fork factor f, step rewards (max/avg rule, gamma),
formatting rescale, A_trj + A_fork with the Theorem 3.1 weights (PORTool, arXiv 2510.26020,
§3.2, Eqs. 2-3, Theorem 3.1, App. A-B; tree_rl's readings: docs/methods/portool.md).

Command: python launch/train.py --config=configs/portool.py --workdir=/tmp/portool
Ablations: :n=8 (trajectories per prompt) ; :surrogate=two_term (App. B: trajectory and
fork terms clipped separately; default: Eq. 3's one clipped term) ; :runlocal.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy and eval/avg_formatting_raw. These defaults (all 17 tools,
difficulties 1-5) are not yet measured. On the notebooks' CPU preset (configs/apppo.py's
model, tasks, SFT and 5 RL steps; notebooks/portool.py) held-out accuracy went from SFT
0.344 -> 0.500 (seed 0) and 0.438 -> 0.469 (seed 1): results/portool/, RESULTS.md.
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, n=4, surrogate="combined")
  c = common.base_config()
  c.algo.estimator = "portool"
  c.algo.loss = dict(surrogate=arg.surrogate)
  c.rollout.strategy = "portool"
  c.rollout.samples_per_task = arg.n
  # f = 2 (docs/methods/portool.md#fork-factor-and-selection), T_max = 5 (PORTool §3.2).
  c.rollout.strategy_kwargs = dict(fork_factor=2, t_max=5)
  c = common.apply_common_args(c, arg)
  if arg.runlocal:
    c.rollout.strategy_kwargs = dict(fork_factor=2, t_max=2)
  return c
