"""Bad trees and non-finite updates do not end a run: a tree that fails its checks (a NaN
reward) or does not fit the largest token bucket is dropped, logged and counted, and only
more than `rollout.max_bad_tree_fraction` of a step's trees stops the run, naming them; an
update with a non-finite loss is skipped with the pre-step state kept, and
`algo.max_skipped_steps` of them in a row stop the run."""

import dataclasses
import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tree_rl import train
from tree_rl.algos import ppo
from tree_rl.envs.base import Outcome
from tree_rl.models import Decoder, ModelConfig
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack
from tree_rl.tree.batch import check_bad_trees, pack_sound

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _tree(task_id, reward=1.0, tokens=4):
  t = RolloutTree.new([1, 2, 3], meta={"task_id": task_id})
  node = t.add_node(0, NodeKind.POLICY, [5] * tokens, [-1.0] * tokens)
  t.add_leaf(node, {"outcome": reward})
  return t


def test_pack_drops_a_nan_reward_an_oversized_tree_and_a_foreign_token_and_names_them():
  oov = RolloutTree.new([1, 2, 3], meta={"task_id": "oov"})
  oov.add_leaf(oov.add_node(0, NodeKind.POLICY, [5, 4000], [-1.0, -1.0]), {"outcome": 1.0})
  trees = [_tree("ok"), _tree("nan", reward=float("nan")), _tree("big", tokens=300), oov,
           RolloutTree.new([1, 2], meta={"task_id": "empty"})]
  packed = pack_sound(trees, Buckets(tokens=(256,), trees=(4,)), vocab_size=1000)
  batch, bad = packed.batch, packed.bad
  assert batch is not None and batch.tokens.shape[0] == 4  # the sound tree, padded
  assert packed.kv_blocks == 0  # no attention block asked for
  assert [t for t, _ in bad] == ["nan", "big", "oov"]
  assert "reward 'outcome' is nan" in bad[0][1] and "exceed the largest bucket" in bad[1][1]
  assert "4000" in bad[2][1], bad[2]
  check_bad_trees(1, bad, len(trees), 0.6)  # 3 of 5: allowed
  with pytest.raises(RuntimeError, match=r"step 1: 3 of 5 trees.*task nan: .*task big: .*oov"):
    check_bad_trees(1, bad, len(trees), 0.25)


class _NaNWorld:
  """The tool world whose first training task always scores NaN."""

  def __init__(self, inner):
    self.inner, self.first = inner, None

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def generate(self, split, num_tasks, seed):
    tasks = self.inner.generate(split, num_tasks, seed)
    if split == "train":
      self.first = tasks[0].task_id
    return tasks

  def score(self, task, episode, truncated):
    if task.task_id == self.first:
      return Outcome(float("nan"), correct=False, answered=True)
    return self.inner.score(task, episode, truncated)


@pytest.mark.e2e
def test_a_run_fed_nan_rewards_keeps_training_until_past_the_drop_fraction(tmp_path,
                                                                         monkeypatch):
  make_family = train.make_family
  monkeypatch.setattr(train, "make_family", lambda name, **kw: _NaNWorld(make_family(name, **kw)))
  c = importlib.import_module("configs.grpo").get_config("runlocal,steps=2")
  c.sft.steps = 0
  c.rollout.max_bad_tree_fraction = 0.5  # 2 prompts a step: the NaN one may be dropped
  out = train.train_and_evaluate(c, str(tmp_path / "ok"))
  rows = [r for r in out["history"] if "rollout/bad_trees" in r]
  assert [r["rollout/bad_trees"] for r in rows] == [1.0, 0.0]  # task 0 comes back at step 5
  assert int(out["state"].step) == 2 and all(np.isfinite(r["loss"]) for r in rows)
  c.rollout.max_bad_tree_fraction = 0.25
  with pytest.raises(RuntimeError, match=r"step 1: 1 of 2 trees .* task toolworld/train/0\S*: "
                                         r"leaf \d+ \(node \d+\): reward 'outcome' is nan"):
    train.train_and_evaluate(c, str(tmp_path / "strict"))


def test_a_non_finite_update_is_skipped_and_keeps_the_pre_step_state():
  model = Decoder(ModelConfig.tiny("qwen3", vocab_size=64), rngs=nnx.Rngs(0))
  opt = optax.adam(1e-2)
  step = jax.jit(ppo.make_update_step(ppo.PPOConfig(estimator="grpo", logprob_chunk=64), opt))
  trees = [_tree(f"t{i}", reward=float(i % 2)) for i in range(4)]
  for t in trees:  # two leaves a tree, so GRPO has a spread
    node = t.add_node(0, NodeKind.POLICY, [7, 8], [-1.0, -1.0])
    t.add_leaf(node, {"outcome": 1.0 - t.leaves[0].rewards["outcome"]})
  batch = pack(trees, Buckets(tokens=(64,), trees=(4,)))
  state = ppo.init_state(model, opt)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  poisoned = dataclasses.replace(batch, behavior_logp=jnp.where(
      batch.behavior_logp != 0, jnp.nan, batch.behavior_logp))
  after, m = step(state, poisoned, jax.random.key(0))
  assert float(m["skipped"]) == 1.0 and not np.isfinite(float(m["loss"]))
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, (after.params, after.opt_state)))
  good, m = step(after, batch, jax.random.key(1))
  assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), good.params,
                       before[0])
  assert max(jax.tree.leaves(moved)) > 0


def test_an_update_that_makes_a_weight_non_finite_is_skipped():
  """A finite loss and gradient can still give non-finite weights (here a NaN learning
  rate, which the config now refuses at start-up): the step is skipped, the state kept."""
  model = Decoder(ModelConfig.tiny("qwen3", vocab_size=64), rngs=nnx.Rngs(0))
  opt = optax.sgd(float("nan"))
  step = jax.jit(ppo.make_update_step(ppo.PPOConfig(estimator="grpo", logprob_chunk=64), opt))
  trees = [_tree(f"t{i}", reward=float(i % 2)) for i in range(4)]
  for t in trees:
    node = t.add_node(0, NodeKind.POLICY, [7, 8], [-1.0, -1.0])
    t.add_leaf(node, {"outcome": 1.0 - t.leaves[0].rewards["outcome"]})
  batch = pack(trees, Buckets(tokens=(64,), trees=(4,)))
  state = ppo.init_state(model, opt)
  before = jax.tree.map(np.asarray, state.params)
  after, m = step(state, batch, jax.random.key(0))
  assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["l2_grads"]))
  assert float(m["skipped"]) == 1.0
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after.params))
