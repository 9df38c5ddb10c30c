"""Rollout counts at a fixed policy (tree_rl.rollout.measure): forks, informative forks and
sibling spread on hand-built trees, and a tiny run's policy growing flat and PORTool trees
through launch/measure_rollouts.py."""

import importlib
import json
import math
import pathlib
import subprocess
import sys

import pytest

from tree_rl import train
from tree_rl.rollout.measure import per_prompt, tree_stats
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import NodeKind

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _tree(leaves):
  """A prompt (node 0) and policy nodes given as (parent, tokens, outcome or None)."""
  tree = RolloutTree.new([1, 2, 3])
  for parent, tokens, outcome in leaves:
    node = tree.add_node(parent, NodeKind.POLICY, tokens, logprobs=[0.0] * len(tokens))
    if outcome is not None:
      tree.add_leaf(node, {"outcome": outcome})
  return tree


def test_a_two_level_tree_counts_each_fork_by_its_childrens_mean_outcomes():
  # 0 -> 1 -> {3: +1, 4: -1}, 0 -> 2: +1. The root compares 1 (mean 0) with 2 (+1); node 1
  # compares +1 with -1.
  tree = _tree([(0, [5, 6], None), (0, [7], 1.0), (1, [8, 9, 10], 1.0), (1, [11], -1.0)])
  got = tree_stats(tree)
  assert got["leaves"] == 3 and got["outcomes"] == [1.0, 1.0, -1.0]
  assert (got["forks"], got["informative_forks"], got["informative"]) == (2, 2.0, 1.0)
  assert got["sibling_spread"] == pytest.approx((1.0 + 2.0) / 2)
  assert (got["branch_forks"], got["informative_branch_forks"]) == (1, 1.0)
  assert got["branch_spread"] == 2.0  # node 1's fork only
  assert got["policy_tokens"] == 2 + 1 + 3 + 1


def test_a_flat_group_is_one_fork_informative_only_with_reward_spread():
  same = tree_stats(_tree([(0, [5], 0.0), (0, [6, 7], 0.0), (0, [8], 0.0)]))
  assert (same["forks"], same["informative_forks"], same["informative"]) == (1, 0.0, 0.0)
  assert same["sibling_spread"] == 0.0
  assert same["branch_forks"] == 0 and math.isnan(same["branch_spread"])
  mixed = tree_stats(_tree([(0, [5], 0.0), (0, [6, 7], 1.0)]))
  assert (mixed["forks"], mixed["informative_forks"], mixed["informative"]) == (1, 1.0, 1.0)


def test_equal_child_means_are_uninformative_though_the_leaves_differ():
  # Both children of the root average 0: the root fork has no spread, node 1's has.
  tree = _tree([(0, [5], None), (0, [6], None), (1, [7], 1.0), (1, [8], -1.0),
                (2, [9], 1.0), (2, [10], -1.0)])
  got = tree_stats(tree)
  assert (got["forks"], got["informative_forks"], got["informative"]) == (3, 2.0, 1.0)
  assert (got["branch_forks"], got["informative_branch_forks"], got["branch_spread"]) == (
      2, 2.0, 2.0)


def test_a_chain_has_no_fork_and_a_bad_leaf_makes_the_counts_nan():
  chain = tree_stats(_tree([(0, [5], 1.0)]))
  assert (chain["forks"], chain["informative_forks"], chain["informative"]) == (0, 0.0, 0.0)
  assert math.isnan(chain["sibling_spread"])
  bad = tree_stats(_tree([(0, [5], 1.0), (0, [6], float("nan"))]))
  assert bad["forks"] == 1
  assert all(math.isnan(bad[k]) for k in ("informative", "informative_forks", "sibling_spread",
                                          "informative_branch_forks", "branch_spread"))
  empty = tree_stats(RolloutTree.new([1]))
  assert (empty["leaves"], empty["forks"], empty["informative"]) == (0, 0, 0.0)


def test_per_prompt_keys_trees_by_repeat_and_task_and_scales_per_1k_tokens():
  result = {"calls": [{"repeat": r, "trees": [
      {"task_index": 4, "informative_forks": 1.0 + r, "policy_tokens": 500, "forks": 2},
      {"task_index": 7, "informative_forks": 0.0, "policy_tokens": 0, "forks": 0}]}
      for r in range(2)]}
  per_1k = per_prompt(result, "informative_forks_per_1k")
  assert per_1k[(0, 4)] == 2.0 and per_1k[(1, 4)] == 4.0 and math.isnan(per_1k[(0, 7)])
  assert per_prompt(result, "forks") == {(0, 4): 2.0, (0, 7): 0.0, (1, 4): 2.0, (1, 7): 0.0}


def _config(name: str, arg: str = "runlocal"):
  return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.e2e
def test_a_runs_policy_grows_flat_and_portool_trees_on_the_configs_prompts(tmp_path):
  run = tmp_path / "run"
  c = _config("grpo")
  c.num_steps, c.eval_base, c.sft.steps = 0, False, 1  # a checkpoint after one SFT step
  train.train_and_evaluate(c, str(run))
  out = tmp_path / "m"
  results = {}
  for name in ("grpo", "portool"):
    cmd = [sys.executable, "launch/measure_rollouts.py", f"--model={run}",
           f"--config=configs/{name}.py:runlocal", "--overrides="
           + json.dumps({"rollout.task_ids": [3, 1]}), "--repeats=2", f"--out={out / name}.json"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"written to {out / name}.json" in done.stdout
    results[name] = json.loads((out / f"{name}.json").read_text())
  for name, got in results.items():
    assert got["task_ids"] == [3, 1] and [c["repeat"] for c in got["calls"]] == [0, 1]
    for call in got["calls"]:
      assert call["seconds"] > 0 and call["sampled_tokens"] >= sum(
          t["policy_tokens"] for t in call["trees"])
      assert [t["task_index"] for t in call["trees"]] == [3, 1]
      for t in call["trees"]:
        assert 0 <= t["informative_forks"] <= t["forks"] and t["leaves"] == len(t["outcomes"])
  flat = results["grpo"]["calls"][0]["trees"]
  n = _config("grpo").rollout.samples_per_task
  assert all(t["leaves"] == n and t["forks"] == 1 for t in flat)  # one group at the prompt
  # A config whose train split is not the run's is refused, naming the field.
  bad = subprocess.run([sys.executable, "launch/measure_rollouts.py", f"--model={run}",
                        "--config=configs/grpo.py:runlocal", "--config.task.seed=5",
                        f"--out={out / 'bad.json'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert bad.returncode != 0 and "task.seed" in bad.stderr, bad.stderr[-2000:]
  dapo = subprocess.run([sys.executable, "launch/measure_rollouts.py", f"--model={run}",
                         "--config=configs/dapo.py:runlocal", f"--out={out / 'bad.json'}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert dapo.returncode != 0 and "rollout.dynamic_sampling" in dapo.stderr, dapo.stderr[-2000:]
  assert not (out / "bad.json").exists()
