"""TRACE's learned success predictor (eqs. 17-19): supervision pairs, learning, shapes,
determinism, state round trips (direct and through the trainer's checkpoint helpers) and the
predictor registry."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tree_rl import checkpoint, train
from tree_rl.algos.trace_value import ValueHeadConfig, ValueHeadPredictor, supervision_examples
from tree_rl.checkpoint import RunCheckpointer
from tree_rl.config_types import RunConfig
from tree_rl.rollout.strategies import (PREDICTORS, RunningMeanPredictor, TRACEStrategy,
                                        make_predictor)
from tree_rl.tree import NodeKind, RolloutTree

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 64
WIN, LOSE = 3, 4  # the token that ends a tool reply decides the episode in `episode_tree`
TINY = ValueHeadConfig(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
                       max_prefix_tokens=128, lr=3e-3, epochs=2, batch_size=16)


def policy(tree, parent, tokens):
  return tree.add_node(parent, NodeKind.POLICY, tokens, logprobs=[-1.0] * len(tokens))


def noise(rng, lo, hi):
  return [int(x) for x in rng.integers(10, VOCAB, rng.integers(lo, hi))]


def episode_tree(rng, task_id="t"):
  """A prompt and two rollouts: call a tool, read a reply, answer. A reply that ends with WIN
  leads to outcome +1, one that ends with LOSE to -1 (success 0); one rollout of each."""
  tree = RolloutTree.new(noise(rng, 8, 30), meta={"task_id": task_id})
  for end in (WIN, LOSE):
    env = tree.add_node(policy(tree, 0, noise(rng, 2, 6)), NodeKind.ENV,
                        noise(rng, 2, 10) + [end])
    tree.add_leaf(policy(tree, env, noise(rng, 1, 4)), {"outcome": 1.0 if end == WIN else -1.0})
  return tree


def reply_prefixes(trees):
  """(prefix, success) of every tool reply of the trees."""
  out = []
  for tree in trees:
    for i, node in enumerate(tree.nodes):
      if node.kind == NodeKind.ENV:
        out.append((tree.context(i), float(node.tokens[-1] == WIN)))
  return out


# ---------------------------------------------------------------------------
# Supervision pairs (eq. 18 on success = clip(outcome, 0, 1))
# ---------------------------------------------------------------------------


def test_supervision_examples_hand_tree():
  # 0 root [5, 6] -> 1 p [7] -> 2 env [8, 9] -> 3 p [10] (outcome +1) and 4 p [11] (-1);
  #               -> 5 p [12] (-1).
  # Successes: 1, 0, 0. Root: V_hat = 1/3 (the unclipped mean outcome would be -1/3); the
  # reply prefix [5..9] (an env node a policy node follows): (1 + 0) / 2 = 1/2. Env-less
  # rollouts add no prefix, and the empty tree adds nothing.
  tree = RolloutTree.new([5, 6])
  env = tree.add_node(policy(tree, 0, [7]), NodeKind.ENV, [8, 9])
  tree.add_leaf(policy(tree, env, [10]), {"outcome": 1.0})
  tree.add_leaf(policy(tree, env, [11]), {"outcome": -1.0})
  tree.add_leaf(policy(tree, 0, [12]), {"outcome": -1.0})
  prefixes, targets, is_root = supervision_examples([tree, RolloutTree.new([1])])
  assert prefixes == [[5, 6], [5, 6, 7, 8, 9]]
  np.testing.assert_allclose(targets, [1 / 3, 1 / 2], atol=1e-6)
  np.testing.assert_array_equal(is_root, [True, False])


# ---------------------------------------------------------------------------
# Learning, shapes, determinism
# ---------------------------------------------------------------------------


def test_value_head_learns_which_replies_succeed():
  # Every root's target is 1/2 and a reply's is 1 (ends with WIN) or 0 (LOSE); the rest of
  # every prefix is noise. A constant predictor's best MSE on held-out replies is 1/4 (half
  # of each); the value head must read the end of the prefix to go well below it.
  rng = np.random.default_rng(0)
  predictor = ValueHeadPredictor(VOCAB, seed=0, config=TINY)
  held_out = reply_prefixes([episode_tree(rng) for _ in range(16)])
  prefixes = [p for p, _ in held_out]
  y = np.array([s for _, s in held_out])
  before = predictor.predict(["t"] * len(prefixes), prefixes)
  np.testing.assert_array_equal(before, 0.5)  # zero head: the cold start says 1/2
  metrics = [predictor.update([episode_tree(rng) for _ in range(6)]) for _ in range(25)]
  after = predictor.predict(["t"] * len(prefixes), prefixes)
  mse = float(np.mean((after - y) ** 2))
  assert mse < 0.05, mse
  assert after[y == 1].min() > after[y == 0].max()  # the two classes are separated
  assert metrics[0]["predictor_examples"] == 6 * 3  # 6 roots and 12 replies per update
  # The step's pre-update MSE (fresh trees: a held-out measure) fell, and so did the loss.
  assert metrics[-1]["predictor_mse_before"] < 0.5 * metrics[0]["predictor_mse_before"]
  assert metrics[-1]["predictor_loss"] < metrics[0]["predictor_loss"]


def test_predict_shapes_range_truncation_and_compiles():
  rng = np.random.default_rng(1)
  predictor = ValueHeadPredictor(VOCAB, seed=0, config=TINY)
  predictor.update([episode_tree(rng) for _ in range(4)])
  assert predictor.predict([], []).shape == (0,)
  prefixes = [noise(rng, 1, 200) for _ in range(40)]
  v = predictor.predict(["t"] * 40, prefixes)
  assert v.shape == (40,) and v.dtype == np.float64
  assert ((v > 0) & (v < 1)).all() and np.ptp(v) > 0
  # A prefix over max_prefix_tokens (128) is cut from the left: its last 128 tokens decide.
  long = noise(rng, 300, 301)
  np.testing.assert_array_equal(predictor.predict(["t"] * 2, [long, long[-128:]])[0],
                                predictor.predict(["t"], [long[-128:]])[0])
  # Row counts and lengths are bucketed: 5, 6 and 7 prefixes of 10-60 tokens are one shape.
  before = predictor._predict._cache_size()
  for n in (5, 6, 7):
    predictor.predict(["t"] * n, [noise(rng, 10, 60) for _ in range(n)])
  assert predictor._predict._cache_size() - before <= 1


def test_value_head_is_deterministic_given_its_seed():
  def trained(seed):
    rng = np.random.default_rng(2)  # the same trees for every predictor
    p = ValueHeadPredictor(VOCAB, seed=seed, config=TINY)
    for _ in range(2):
      p.update([episode_tree(rng) for _ in range(5)])
    return p

  probe = [noise(np.random.default_rng(3), 5, 40) for _ in range(8)]
  a, b, c = trained(0), trained(0), trained(1)
  np.testing.assert_array_equal(a.predict(["t"] * 8, probe), b.predict(["t"] * 8, probe))
  assert not np.array_equal(a.predict(["t"] * 8, probe), c.predict(["t"] * 8, probe))


# ---------------------------------------------------------------------------
# State: direct round trip, and the trainer's checkpoint path
# ---------------------------------------------------------------------------


def test_state_round_trip_continues_exactly():
  rng = np.random.default_rng(4)
  a = ValueHeadPredictor(VOCAB, seed=0, config=TINY)
  a.update([episode_tree(rng) for _ in range(4)])
  b = ValueHeadPredictor(VOCAB, seed=7, config=TINY)  # other weights until loaded
  state = a.state_dict()
  b.load_state_dict({"meta": json.loads(json.dumps(state["meta"])),
                     "arrays": jax.tree.map(np.asarray, state["arrays"])})
  probe = [noise(rng, 5, 90) for _ in range(10)]
  np.testing.assert_array_equal(a.predict(["t"] * 10, probe), b.predict(["t"] * 10, probe))
  trees = [episode_tree(rng) for _ in range(4)]  # the next update: same shuffle, same Adam
  assert a.update(trees) == b.update(trees)
  for x, y in zip(jax.tree.leaves(a.state_dict()["arrays"]),
                  jax.tree.leaves(b.state_dict()["arrays"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", PREDICTORS)
def test_predictor_state_survives_the_trainer_checkpoint(tmp_path, name):
  kwargs = dataclasses.asdict(TINY) if name == "value_head" else {}
  rng = np.random.default_rng(5)

  def strategy(seed):
    return TRACEStrategy(predictor=make_predictor(name, vocab_size=VOCAB, seed=seed, **kwargs))

  ran = strategy(0)
  ran.predictor.update([episode_tree(rng, task_id=f"t{i}") for i in range(4)])
  policy_state = {"w": jnp.arange(4.0)}
  ckpt = RunCheckpointer(tmp_path / "checkpoints")
  meta = {"step": 3}
  checkpoint.save_run(ckpt, 3, policy_state, meta, checkpoint.method_state(ran))
  ckpt.close()
  assert set(meta["method_state"]) >= {"predictor"}

  source = RunCheckpointer(tmp_path / "checkpoints")  # a fresh process resumes
  _, restored_meta = source.restore(policy_state)
  resumed = strategy(1)
  checkpoint.restore_method_state(resumed, source, restored_meta)
  source.close()
  probe = [noise(rng, 5, 90) for _ in range(6)]
  ids = [f"t{i}" for i in range(6)]
  np.testing.assert_array_equal(ran.predictor.predict(ids, probe),
                                resumed.predictor.predict(ids, probe))
  trees = [episode_tree(rng, task_id=f"t{i}") for i in range(3)]
  assert ran.predictor.update(trees) == resumed.predictor.update(trees)
  np.testing.assert_array_equal(ran.predictor.predict(ids, probe),
                                resumed.predictor.predict(ids, probe))


def test_checkpoint_of_another_predictor_fails_clearly(tmp_path):
  ckpt = RunCheckpointer(tmp_path)
  meta = {"step": 1}
  checkpoint.save_run(ckpt, 1, {"w": jnp.zeros(2)}, meta,
              checkpoint.method_state(TRACEStrategy(predictor=RunningMeanPredictor())))
  other = TRACEStrategy(predictor=make_predictor("value_head", vocab_size=VOCAB,
                                                 **dataclasses.asdict(TINY)))
  with pytest.raises((ValueError, FileNotFoundError), match="RunningMeanPredictor|another config"):
    checkpoint.restore_method_state(other, ckpt, ckpt.restore({"w": jnp.zeros(2)})[1])
  ckpt.close()


# ---------------------------------------------------------------------------
# Registry and config validation
# ---------------------------------------------------------------------------


def test_unknown_predictor_fails_listing_the_valid_ones():
  with pytest.raises(ValueError, match=r"valid: \['running_mean', 'value_head'\]"):
    make_predictor("value_heads", vocab_size=VOCAB)
  with pytest.raises(ValueError, match="valid keys: .*'max_prefix_tokens'"):
    make_predictor("value_head", vocab_size=VOCAB, max_len=3)
  sys.path.insert(0, str(ROOT))
  trace_config = importlib.import_module("configs.trace")
  config = trace_config.get_config("runlocal,predictor=oracle")
  with pytest.raises(ValueError, match=r"config.rollout.strategy_kwargs: .*'oracle'; valid: "
                                       r"\['running_mean', 'value_head'\]"):
    RunConfig.from_config_dict(config)
  for arg in ("runlocal", "runlocal,predictor=running_mean", None):
    RunConfig.from_config_dict(trace_config.get_config(arg))  # the shipped presets validate
