"""tree_rl.policy: the run's policy, optimizer and path bounds, built apart from the trainer,
so that evaluation and checkpoint loading never import `tree_rl.train`."""

import subprocess
import sys

import numpy as np
import pytest

from tree_rl.config_types import RunConfig
from tree_rl.policy import make_optimizer, path_bounds


def _cfg(**sections) -> RunConfig:
  return RunConfig.from_config_dict(sections)


@pytest.mark.parametrize("module", ["tree_rl.evaluate", "tree_rl.checkpoint", "tree_rl.policy"])
@pytest.mark.e2e
def test_module_imports_without_the_trainer(module):
  # A fresh interpreter: this one has imported tree_rl.train through other tests.
  code = (f"import sys, {module}; "
          f"print(sorted(m for m in sys.modules if m in ('tree_rl.train', 'tree_rl.evaluate')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  loaded = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own printed list)
  assert "tree_rl.train" not in loaded
  if module == "tree_rl.checkpoint":  # and loading a checkpoint needs no evaluator either
    assert "tree_rl.evaluate" not in loaded


def test_checkpoint_restore_policy_is_the_one_public_name():
  from tree_rl import checkpoint, evaluate, train

  assert callable(checkpoint.restore_policy)
  assert not hasattr(train, "restore_policy") and not hasattr(train, "build_policy")
  assert "restore_policy" not in vars(evaluate)  # imported where used, not at module level


def test_path_bounds_count_prompt_policy_and_env_nodes():
  # 3 turns: a prompt node, then a policy and an env node per turn = 7, doubled for
  # token-position forks that split a node.
  assert path_bounds(_cfg(rollout=dict(max_turns=3, max_context_tokens=2048))) == (2048, 14)
  # max_turns 0 (the family's limit) is bounded by 8 turns.
  assert path_bounds(_cfg(rollout=dict(max_turns=0))) == (4096, 34)


def test_make_optimizer_warms_up_linearly():
  cfg = _cfg(optim=dict(lr=0.1, warmup_steps=2, grad_clip=1.0, weight_decay=0.0))
  opt = make_optimizer(0.1, cfg)
  params = {"w": np.zeros(2, np.float32)}
  state = opt.init(params)
  grads = {"w": np.array([30.0, 40.0], np.float32)}
  steps = []
  for _ in range(3):
    updates, state = opt.update(grads, state, params)
    steps.append(np.asarray(updates["w"]))
  # Adam's first step moves every coordinate by lr(t) (sign of the gradient); the
  # schedule is 0, lr/2, lr for t = 0, 1, 2.
  np.testing.assert_allclose(steps[0], [0.0, 0.0], atol=1e-7)
  np.testing.assert_allclose(steps[1], [-0.05, -0.05], rtol=1e-3)
  np.testing.assert_allclose(steps[2], [-0.1, -0.1], rtol=1e-3)
