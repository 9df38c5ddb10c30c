"""GRPO on the tool world: flat groups of independent episodes, outcome reward only
(DeepSeekMath, arXiv 2402.03300, §4.1; docs/methods/grpo.md).

Command (CPU, the default SmolLM2-135M-Instruct with LoRA):
  python launch/train.py --config=configs/grpo.py --workdir=/tmp/grpo
Ablations: --config=configs/grpo.py:task=math,steps=20 ; runlocal (tiny model, 2 steps).
Hardware: a 2-core CPU runs the default; a GPU runs larger models (model=hf).
Expected metric: eval/accuracy on held-out tool-world tasks vs the SFT model
(not yet measured on reference hardware; see the README's results table).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4)
  c = common.base_config()
  c.algo.estimator = "grpo"
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
