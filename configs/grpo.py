"""GRPO on the tool world: flat groups of independent episodes, outcome reward only
(DeepSeekMath, arXiv 2402.03300, §4.1; docs/methods/grpo.md).

Command (CPU, the default SmolLM2-135M-Instruct with LoRA):
  python launch/train.py --config=configs/grpo.py --workdir=/tmp/grpo
Ablations: --config=configs/grpo.py:task=math,steps=20 ; runlocal (tiny model, 2 steps).
Hardware: a 2-core CPU runs the default; a GPU runs larger models (model=hf).
Expected metric: eval/accuracy on held-out tool-world tasks vs the SFT model. These
defaults are not yet measured. On the notebooks' CPU preset (notebooks/portool.py): SFT
0.344 -> 0.469 (seed 0) and 0.438 -> 0.438 (seed 1): results/portool/, RESULTS.md.
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **common.COMMON_ARGS, group=4)
  c = common.base_config()
  c.algo.estimator = "grpo"
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  return common.apply_common_args(c, arg)
