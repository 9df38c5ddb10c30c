"""GRPO, Dr.GRPO, DAPO, RLOO, ARPO, Tree-GRPO and TreeRPO: hand fixtures,
oracle agreement on random trees, and reductions to GRPO on depth-1 trees."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import dapo as dapo_config
from tests import strategies as S
from tests.algos import harness
from tests.algos.ref_baselines import REFERENCES
from tree_rl import algos
from tree_rl.algos import grpo, registry, tree_baselines  # noqa: F401  (registers)
from tree_rl.config_types import RunConfig
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack, structure

SETTINGS = settings(max_examples=S.examples(200), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TREES = st.lists(st.one_of(S.general_tree(), S.flat_tree()), min_size=1, max_size=4)


def _flat(rewards, lengths=None):
  """A depth-1 tree: one single-node rollout per reward."""
  t = RolloutTree.new([1, 2])
  for i, r in enumerate(rewards):
    n = (lengths or [2] * len(rewards))[i]
    node = t.add_node(0, NodeKind.POLICY, [3] * n, logprobs=[-0.5] * n)
    t.add_leaf(node, {"outcome": r})
  return t


def _leaf_adv(name, tree, config=None):
  """Per-leaf advantage read off the leaf's own (last policy) node."""
  batch, adv = harness.run(name, [tree], config)
  nl = np.asarray(adv.dense(batch))[0]
  return np.array([nl[l.node, k] for k, l in enumerate(tree.canonical().leaves)])


# ----------------------------------------------------------------------------
# Hand fixtures
# ----------------------------------------------------------------------------


def test_advantage_forms_expand_on_paths():
  # GRPO returns [B, K] leaf values, ARPO-hard [B, N] node values; dense() puts them on the
  # policy nodes of each leaf's path (0 on the prompt and off the path), and an output with
  # no form or two forms is refused.
  t = RolloutTree.new([1])
  a = t.add_node(0, NodeKind.POLICY, [2], logprobs=[-1.0])
  e = t.add_node(a, NodeKind.ENV, [3])
  b = t.add_node(e, NodeKind.POLICY, [4], logprobs=[-1.0])
  c = t.add_node(0, NodeKind.POLICY, [5], logprobs=[-1.0])
  t.add_leaf(b, {"outcome": 1.0})
  t.add_leaf(c, {"outcome": 0.0})
  batch, adv = harness.run("grpo", [t])
  assert adv.leaf_values.shape == batch.leaf_node.shape and adv.node_leaf is None
  z = 0.707106  # [1, 0]: mean 0.5, unbiased std 0.707107
  want = np.zeros(adv.dense(batch).shape[1:])
  want[[a, b], 0], want[c, 1] = z, -z
  np.testing.assert_allclose(np.asarray(adv.dense(batch))[0], want, atol=5e-6)
  _, hard = harness.run("arpo", [t], grpo.ARPOConfig(attribution="hard"))
  assert hard.node_values.shape == batch.parent.shape
  np.testing.assert_allclose(np.asarray(hard.dense(batch))[0], want, atol=5e-6)
  with pytest.raises(ValueError, match="exactly one of"):
    adv.replace(leaf_values=None).dense(batch)
  with pytest.raises(ValueError, match="exactly one of"):
    adv.replace(node_values=hard.node_values).dense(batch)




def test_grpo_hand():
  # rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.577350
  # -> A = +-0.5 / 0.577350 = +-0.866025 (eps 1e-6 changes the 6th digit).
  np.testing.assert_allclose(_leaf_adv("grpo", _flat([1, 0, 0, 1])),
                             [0.866025, -0.866025, -0.866025, 0.866025], atol=5e-6)
  # Population std (ddof=0) is 0.5 -> +-1.
  cfg = grpo.GRPOConfig(std_ddof=0)
  np.testing.assert_allclose(_leaf_adv("grpo", _flat([1, 0, 0, 1]), cfg), [1, -1, -1, 1],
                             atol=1e-5)


def test_grpo_with_the_formatting_reward_hand():
  """PORTool's GRPO_fm: R = outcome + mean over the path's steps of 0.25 (2 raw - 1). A step
  split by a fork inside it counts once, at its last node (the one holding the rubric)."""
  t = RolloutTree.new([1])
  a = t.add_node(0, NodeKind.POLICY, [2], logprobs=[-1.0], rewards={"format": 1.0})
  e = t.add_node(a, NodeKind.ENV, [3])
  b = t.add_node(e, NodeKind.POLICY, [4], logprobs=[-1.0], rewards={"format": 0.5})
  head = t.add_node(0, NodeKind.POLICY, [5], logprobs=[-1.0])  # a step forked inside
  c = t.add_node(head, NodeKind.POLICY, [6], logprobs=[-1.0], rewards={"format": 0.0})
  d = t.add_node(head, NodeKind.POLICY, [7], logprobs=[-1.0], rewards={"format": 1.0})
  for node in (b, c, d):
    t.add_leaf(node, {"outcome": 1.0 if node == b else -1.0})
  # Formatting terms: leaf b (0.25 + 0) / 2 = 0.125, leaf c -0.25, leaf d +0.25, so
  # R = [1.125, -1.25, -0.75]: mean -0.291667, unbiased std 1.252081.
  r = np.array([1.125, -1.25, -0.75])
  want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
  np.testing.assert_allclose(_leaf_adv("grpo", t, grpo.GRPOConfig(format_reward=True)), want,
                             atol=5e-6)
  plain = np.array([1.0, -1.0, -1.0])
  np.testing.assert_allclose(_leaf_adv("grpo", t), (plain - plain.mean()) / plain.std(ddof=1),
                             atol=5e-6)
  with pytest.raises(ValueError, match="fm_half_range=0.0"):
    grpo.GRPOConfig(format_reward=True, fm_half_range=0.0)


def test_dr_grpo_and_rloo_hand():
  # Dr.GRPO: R - mean = [0.75, -0.25, -0.25, -0.25].
  np.testing.assert_allclose(_leaf_adv("dr_grpo", _flat([1, 0, 0, 0])),
                             [0.75, -0.25, -0.25, -0.25], atol=1e-6)
  # RLOO: 1 - mean(0,0,0) = 1; 0 - mean(1,0,0) = -1/3.
  np.testing.assert_allclose(_leaf_adv("rloo", _flat([1, 0, 0, 0])),
                             [1, -1 / 3, -1 / 3, -1 / 3], atol=1e-6)
  np.testing.assert_allclose(_leaf_adv("rloo", _flat([1])), [0.0])


def test_dapo_overlong_penalty_hand():
  # L_max = 10, L_cache = 4 -> free up to 6 tokens; 8 tokens -> (6 - 8)/4 = -0.5;
  # 11 tokens -> -1.
  y = jnp.array([[6.0, 8.0, 10.0, 11.0]])
  np.testing.assert_allclose(grpo.overlong_penalty(y, 10, 4), [[0, -0.5, -1.0, -1.0]])
  cfg = grpo.DAPOConfig(max_response_tokens=10, overlong_buffer_tokens=4, std_ddof=0)
  # All outcomes 1, lengths 6 and 8 -> shaped rewards [1, 0.5] -> z = [1, -1].
  np.testing.assert_allclose(_leaf_adv("dapo", _flat([1, 1], [6, 8]), cfg), [1, -1], atol=1e-5)


# ----------------------------------------------------------------------------
# DAPO's overlong lengths from the run's response budget (docs/methods/dapo.md)
# ----------------------------------------------------------------------------


def _dapo_run(**rollout) -> RunConfig:
  """configs/dapo.py with `rollout` fields replaced, through the typed config."""
  c = dapo_config.get_config()
  with c.unlocked():
    c.rollout.update(rollout)
  return RunConfig.from_config_dict(c)


def test_dapo_lengths_follow_the_response_budget():
  cfg = _dapo_run()
  # configs/dapo.py: the tool world's 6 turns x 160 new tokens = 960, inside the 4096 window.
  assert cfg.response_budget() == 960
  est = cfg.estimator_config()
  # L_max = min(20480, 960); L_cache = 960 * 4096 / 20480 = 192: the penalty starts at 768.
  assert (est.max_response_tokens, est.overlong_buffer_tokens) == (960, 192)
  assert _dapo_run(max_turns=3).response_budget() == 3 * 160
  assert _dapo_run(max_context_tokens=512).response_budget() == 512  # the window caps it
  assert _dapo_run(strategy="portool").response_budget() == 5 * 160  # PORTool's t_max = 5
  assert _dapo_run(strategy="portool", strategy_kwargs={"t_max": 2}).response_budget() == 320
  # Forks inside a step resume with max_new_tokens more: only the window bounds a path.
  assert _dapo_run(strategy="random").response_budget() == 4096
  # Where the budget holds them, the paper's lengths stand: 8 x 4096 = 32768 >= 20480.
  big = _dapo_run(max_turns=8, max_new_tokens=4096, max_context_tokens=40000)
  est = big.estimator_config()
  assert (est.max_response_tokens, est.overlong_buffer_tokens) == (20480, 4096)


def _steps_tree() -> RolloutTree:
  """Three leaves at the tool world's budget of 6 steps x 160 tokens: two share their first
  five steps (5 x 160 = 800 policy tokens, env nodes of 2 tokens between steps), then end
  with 160 (960 tokens: the full budget) and 64 (864) tokens; a third ends after 100."""
  t = RolloutTree.new([1, 2])
  node = 0
  for _ in range(5):
    node = t.add_node(node, NodeKind.POLICY, [3] * 160, logprobs=[-0.5] * 160)
    node = t.add_node(node, NodeKind.ENV, [4, 5])
  for n in (160, 64):
    t.add_leaf(t.add_node(node, NodeKind.POLICY, [3] * n, logprobs=[-0.5] * n), {"outcome": 1.0})
  t.add_leaf(t.add_node(0, NodeKind.POLICY, [3] * 100, logprobs=[-0.5] * 100), {"outcome": 1.0})
  return t


def test_dapo_config_penalises_a_response_at_its_budget():
  est = _dapo_run().estimator_config()
  batch, adv = harness.run("dapo", [_steps_tree()], est, buckets=Buckets.exact())
  st = structure(batch)
  lengths = np.asarray(st.path_policy_tokens)[0][np.asarray(st.leaf_valid)[0]]
  leaves = [l.node for l in _steps_tree().canonical().leaves]
  got = np.array([np.asarray(adv.dense(batch))[0, n, k] for k, n in enumerate(leaves)])
  # Equal outcomes; R_length (Eq. 13, L_max 960, L_cache 192): 960 -> (768 - 960)/192 = -1,
  # 864 -> -0.5, 100 -> 0. Shaped rewards [0, 0.5, 1] (mean 0.5, unbiased std 0.5) -> z -1, 0, 1.
  want = {960: -1.0, 864: 0.0, 100: 1.0}
  assert sorted(lengths.tolist()) == [100, 864, 960]
  np.testing.assert_allclose(got, [want[int(n)] for n in lengths], atol=1e-5)
  assert float(adv.metrics["reward_mean"]) == pytest.approx(0.5, abs=1e-6)
  # The paper's defaults on the same tree: the penalty starts at 16,384 tokens, never here.
  batch, paper = harness.run("dapo", [_steps_tree()], grpo.DAPOConfig(), buckets=Buckets.exact())
  np.testing.assert_array_equal(np.asarray(paper.dense(batch)), 0.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_response_tokens=20480),
     r"estimator_kwargs\.max_response_tokens: DAPO's overlong penalty starts after "
     r"L_max - L_cache = 20480 - 4096 = 16384 policy tokens, but a root-to-leaf path in this "
     r"run holds at most 960 \(6 turn\(s\) x rollout\.max_new_tokens=160"),
    (dict(max_response_tokens=1200, overlong_buffer_tokens=200),
     r"max_response_tokens and overlong_buffer_tokens: .* = 1000 policy tokens.*never fire"),
    (dict(overlong_buffer_tokens=2000),
     r"overlong_buffer_tokens=2000 must be in \(0, max_response_tokens=960\].*budget is 960"),
    (dict(overlong_shaping=False, max_response_tokens=960),
     r"\['max_response_tokens'\] have no effect with overlong_shaping=False"),
])
def test_dapo_lengths_that_cannot_fire_fail_at_start_up(kwargs, message):
  c = dapo_config.get_config()
  with c.unlocked():
    c.algo.estimator_kwargs.update(kwargs)
  with pytest.raises(ValueError, match=message):
    RunConfig.from_config_dict(c)


def test_dapo_explicit_lengths_that_fire_win():
  c = dapo_config.get_config()
  with c.unlocked():
    c.algo.estimator_kwargs.update(max_response_tokens=1000)
  est = RunConfig.from_config_dict(c).estimator_config()
  # L_cache in DAPO's proportion of the set L_max: 200; the penalty starts at 800 < 960.
  assert (est.max_response_tokens, est.overlong_buffer_tokens) == (1000, 200)
  assert grpo.DAPOConfig().overlong_buffer_tokens == 4096  # the paper's, from the proportion


def test_dapo_keep_mask():
  batch = pack([_flat([1, 1, 1]), _flat([1, 0, 1]), _flat([0, 0])], S.TEST_BUCKETS)
  # The fourth row pads the batch to its tree bucket: no group, not kept.
  np.testing.assert_array_equal(grpo.dapo_keep_mask(batch), [False, True, False, False])


def test_arpo_hard_attribution_averages_shared_tokens():
  t = RolloutTree.new([1])
  a = t.add_node(0, NodeKind.POLICY, [2, 3], logprobs=[-1, -1])
  b = t.add_node(a, NodeKind.POLICY, [4], logprobs=[-1])
  c = t.add_node(a, NodeKind.POLICY, [5], logprobs=[-1])
  d = t.add_node(0, NodeKind.POLICY, [6], logprobs=[-1])
  for n, r in [(b, 1), (c, 0), (d, 0)]:
    t.add_leaf(n, {"outcome": r})
  batch, soft = harness.run("arpo", [t])
  _, hard = harness.run("arpo", [t], grpo.ARPOConfig(attribution="hard"))
  z = np.array([1.154701, -0.577350, -0.577350])  # [1, 0, 0], unbiased std
  np.testing.assert_allclose(np.asarray(soft.dense(batch))[0, a, :3], [z[0], z[1], 0], atol=5e-6)
  mean_a = (z[0] + z[1]) / 2
  np.testing.assert_allclose(np.asarray(hard.dense(batch))[0, a, :3], [mean_a, mean_a, 0], atol=5e-6)
  np.testing.assert_allclose(np.asarray(hard.dense(batch))[0, b, 0], z[0], atol=5e-6)


def test_tree_grpo_hand():
  # root -> X -> {x1: 1, x2: 0};  root -> Y: 0.
  # intra (sub-tree X): [1, 0] -> +-0.707107; sub-tree Y alone -> 0.
  # inter [1, 0, 0] -> [1.154701, -0.577350, -0.577350].
  t = RolloutTree.new([1])
  x = t.add_node(0, NodeKind.POLICY, [2], logprobs=[-1])
  e = t.add_node(x, NodeKind.ENV, [3])
  x1 = t.add_node(e, NodeKind.POLICY, [4], logprobs=[-1])
  x2 = t.add_node(e, NodeKind.POLICY, [5], logprobs=[-1])
  y = t.add_node(0, NodeKind.POLICY, [6], logprobs=[-1])
  for n, r in [(x1, 1), (x2, 0), (y, 0)]:
    t.add_leaf(n, {"outcome": r})
  got = _leaf_adv("tree_grpo", t)
  np.testing.assert_allclose(got, [1.861808, -1.284457, -0.577350], atol=5e-6)


def test_tree_rpo_hand():
  # root -> A -> env -> {A1: 1, A2 -> {A2a: 0, A2b: 0}};  root -> B: 1.
  # Backed-up (unweighted) means: R(A2) = 0, R(A) = (1 + 0)/2 = 0.5, R(B) = 1.
  # Root group [0.5, 1], unbiased std 0.353553 -> A: -0.707107, B: +0.707107.
  # Group under env [1, 0] -> A1: +0.707107, A2: -0.707107; A2's children tie -> 0.
  t = RolloutTree.new([1])
  a = t.add_node(0, NodeKind.POLICY, [2], logprobs=[-1])
  e = t.add_node(a, NodeKind.ENV, [3])
  a1 = t.add_node(e, NodeKind.POLICY, [4], logprobs=[-1])
  a2 = t.add_node(e, NodeKind.POLICY, [5], logprobs=[-1])
  a2a = t.add_node(a2, NodeKind.POLICY, [6], logprobs=[-1])
  a2b = t.add_node(a2, NodeKind.POLICY, [7], logprobs=[-1])
  b = t.add_node(0, NodeKind.POLICY, [8], logprobs=[-1])
  for n, r in [(a1, 1), (a2a, 0), (a2b, 0), (b, 1)]:
    t.add_leaf(n, {"outcome": r})
  batch, adv = harness.run("tree_rpo", [t])
  canon = t.canonical()
  nl = np.asarray(adv.dense(batch))[0]
  backed = np.asarray(adv.extras["backed_up"])[0]
  # Canonical order equals insertion order here (each node added under the
  # previous subtree in depth-first order).
  assert [n.parent for n in canon.nodes] == [n.parent for n in t.nodes]
  np.testing.assert_allclose(backed[[a, a2, b, 0]], [0.5, 0.0, 1.0, 0.75], atol=1e-6)
  np.testing.assert_allclose(nl[a, 0], -0.707107, atol=5e-6)
  np.testing.assert_allclose(nl[b, 3], 0.707107, atol=5e-6)
  np.testing.assert_allclose(nl[a1, 0], 0.707107, atol=5e-6)
  np.testing.assert_allclose(nl[a2, 1:3], [-0.707107, -0.707107], atol=5e-6)
  np.testing.assert_allclose(nl[a2a, 1], 0.0, atol=1e-7)
  assert nl[e].sum() == 0  # env node: no loss tokens, no advantage


# ----------------------------------------------------------------------------
# Oracle agreement
# ----------------------------------------------------------------------------

CONFIGS = {
    "grpo": [grpo.GRPOConfig(), grpo.GRPOConfig(std_ddof=0, reward_channels=("outcome", "format")),
             grpo.GRPOConfig(format_reward=True), grpo.GRPOConfig(format_reward=True,
                                                                 fm_half_range=1.0)],
    "dr_grpo": [grpo.DrGRPOConfig()],
    "dapo": [grpo.DAPOConfig(), grpo.DAPOConfig(max_response_tokens=8, overlong_buffer_tokens=4)],
    "rloo": [grpo.RLOOConfig()],
    "arpo": [grpo.ARPOConfig(), grpo.ARPOConfig(attribution="hard", std_ddof=0)],
    "tree_grpo": [tree_baselines.TreeGRPOConfig(), tree_baselines.TreeGRPOConfig(std_ddof=0)],
    "tree_rpo": [tree_baselines.TreeRPOConfig(), tree_baselines.TreeRPOConfig(std_ddof=0)],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference(name):
  @SETTINGS
  @given(TREES, st.integers(0, len(CONFIGS[name]) - 1))
  def check(trees, ci):
    harness.assert_matches_reference(name, trees, REFERENCES[name], CONFIGS[name][ci])

  check()


# ----------------------------------------------------------------------------
# Invariances
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,config", [
    ("tree_grpo", tree_baselines.TreeGRPOConfig()),
    ("tree_rpo", tree_baselines.TreeRPOConfig()),
    ("arpo", grpo.ARPOConfig()),
    ("arpo", grpo.ARPOConfig(attribution="hard")),
])
def test_depth_one_tree_gives_grpo(name, config):
  @settings(max_examples=S.examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
  @given(st.lists(S.flat_tree(), min_size=1, max_size=4))
  def check(trees):
    batch, want = harness.run("grpo", trees)
    _, got = harness.run(name, trees, config)
    np.testing.assert_allclose(np.asarray(got.dense(batch)), np.asarray(want.dense(batch)), atol=1e-5)

  check()


def test_bad_names_and_options_fail_listing_valid_values():
  with pytest.raises(ValueError, match="valid:.*'grpo'"):
    algos.AdvEstimator("grpoo")
  with pytest.raises(ValueError, match="unknown option.*valid"):
    registry.make_config("grpo", std_dof=1)
  with pytest.raises(ValueError, match="attribution.*choose one of"):
    grpo.ARPOConfig(attribution="sometimes")
  with pytest.raises(ValueError, match="std_ddof"):
    grpo.GRPOConfig(std_ddof=2)
  batch = pack([_flat([1, 0])], S.TEST_BUCKETS)
  with pytest.raises(TypeError, match="GRPOConfig"):
    registry.compute_advantages("grpo", batch, grpo.DAPOConfig())
  with pytest.raises(KeyError, match="unknown reward channel"):
    registry.compute_advantages("grpo", batch, grpo.GRPOConfig(reward_channels=("accuracy",)))
