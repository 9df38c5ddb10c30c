"""The SFT step skips a non-finite update as the RL update step does: the state before it is
kept, `sft/skipped` says so, and the SFT loop warns and counts the skipped steps."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np
import optax
from flax import nnx

from tree_rl.algos import ppo, sft
from tree_rl.checkpoint import RunCheckpointer
from tree_rl.config_types import SFTSpec
from tree_rl.metrics import MetricWriter
from tree_rl.models import Decoder, ModelConfig
from tree_rl.phases import StopFlag, sft_warm_start
from tree_rl.resume import RunState
from tree_rl.rollout.agent_loop import AgentLoop
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack
from tree_rl.tree.batch import pack_sound

BUCKETS = Buckets(tokens=(64,), trees=(2,))


def _tree(task_id: str) -> RolloutTree:
  t = RolloutTree.new([1, 2, 3], meta={"task_id": task_id})
  t.add_leaf(t.add_node(0, NodeKind.POLICY, [5, 6, 7, 8], [-1.0] * 4), {"outcome": 1.0})
  return t


def _state(opt: optax.GradientTransformation) -> ppo.TrainState:
  return ppo.init_state(Decoder(ModelConfig.tiny("qwen3", vocab_size=64), rngs=nnx.Rngs(0)),
                        opt)


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _same(a, b) -> None:
  jax.tree.map(np.testing.assert_array_equal, _host(a), _host(b))


def test_an_infinite_or_nan_learning_rate_step_is_skipped_and_keeps_the_state():
  batch = pack([_tree("a"), _tree("b")], BUCKETS)
  # An unbounded rate (Adam's step makes every moved weight inf or NaN) and a NaN one: the
  # loss and gradient are finite, the new parameters are not.
  for opt in (optax.adam(float("inf")), optax.sgd(float("nan"))):
    state = _state(opt)
    before = _host((state.params, state.opt_state))
    after, m = sft.jit_sft_step(opt, 64)(state, batch)
    assert np.isfinite(float(m["sft/loss"])) and np.isfinite(float(m["sft/l2_grads"]))
    assert not np.isfinite(float(m["sft/l2_params"]))
    assert float(m["sft/skipped"]) == 1.0
    _same(before, (after.params, after.opt_state))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(_host(after.params)))


def test_a_finite_step_is_taken():
  opt = optax.adam(1e-2)
  state = _state(opt)
  before = _host(state.params)
  after, m = sft.jit_sft_step(opt, 64)(state, pack([_tree("a"), _tree("b")], BUCKETS))
  assert float(m["sft/skipped"]) == 0.0 and np.isfinite(float(m["sft/l2_params"]))
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), after.params, before)
  assert max(jax.tree.leaves(moved)) > 0


class _Teacher(AgentLoop):
  """An oracle that answers every task with the same one-leaf trajectory."""

  def __init__(self):  # no engine: rollout is all the SFT loop calls
    pass

  def rollout(self, tasks):
    return [_tree(t.task_id) for t in tasks]


@dataclasses.dataclass(frozen=True)
class _Task:
  task_id: str
  messages: tuple = ()


def test_the_sft_loop_warns_and_counts_skipped_steps(tmp_path, caplog):
  opt = optax.adam(float("inf"))
  state = _state(opt)
  before = _host(state.params)
  writer = MetricWriter(tmp_path, primary=False)
  run = RunState()
  stop = StopFlag()
  try:
    with caplog.at_level(logging.WARNING):
      out = sft_warm_start(SFTSpec(steps=2, tasks_per_step=2, ckpt_every_steps=2), state,
                           lambda s, packed: sft.jit_sft_step(opt, 64)(s, packed.batch), _Teacher(),
                           [_Task(f"t{i}") for i in range(3)],
                           functools.partial(pack_sound, buckets=Buckets(tokens=(64,), trees=(1,))),
                           RunCheckpointer(tmp_path / "ckpt"), run, writer, stop)
  finally:
    stop.restore()
  _same(before, out.params)  # both steps skipped: the weights are the ones SFT started from
  assert [r["sft/skipped"] for r in writer.history] == [1.0, 1.0]
  assert run.sft_skipped == 2 and run.sft_step == 2
  warned = [r.getMessage() for r in caplog.records if "SFT step" in r.getMessage()]
  assert len(warned) == 2 and "SFT step 2 skipped" in warned[1], warned
  assert "2 SFT step(s) skipped so far" in warned[1] and "config.sft.lr" in warned[1]
