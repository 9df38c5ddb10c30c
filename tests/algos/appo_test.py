"""APPO (arXiv 2606.12384, §3.2-3.3): a hand-worked fixture, oracle agreement, invariances.

Every batch is padded to 4 trees with the TEST_BUCKETS sizes, so each jitted
kernel compiles once per config for the whole module.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from tests.algos import harness, ref_appo
from tests.strategies import TEST_BUCKETS, appo_tree, examples, general_tree
from tree_rl.algos import appo, registry
from tree_rl.tree import Buckets, LeafTag, NodeKind, RolloutTree, derived, pack

APPO = registry.AdvEstimator.APPO
BUCKETS = dataclasses.replace(TEST_BUCKETS, trees=(4,))
N_TREES = 4

_future = jax.jit(appo.future_value, static_argnames=("config",))
_score = jax.jit(appo.branching_score, static_argnames=("config",))
_select = jax.jit(appo.select_branch_points,
                  static_argnames=("num_branches", "require_both_positive"))
_zscores = jax.jit(appo.dual_group_zscores, static_argnames=("config",))
_bounds = jax.jit(appo._node_bounds, static_argnums=1)
_policy_tokens = jax.jit(appo._node_policy_tokens)

# One compile per config for the whole module: the fixture and the random
# trees share these configs and the padded shapes.
DEFAULT = appo.APPOConfig()
NODE_LEAF_CONFIGS = [
    appo.APPOConfig(),
    appo.APPOConfig(base_adv_mode="literal"),
    appo.APPOConfig(base_adv_mode="code_sum"),
    appo.APPOConfig(dual_group=False),
    appo.APPOConfig(base_adv_mode="literal", dual_group=False),
]
SCORE_CONFIGS = [
    appo.APPOConfig(),
    appo.APPOConfig(bs_mode="future", first_minibatch_fallback="skip_branching", std_ddof=1),
]


def _run(batch, config, logp, entropy):
  # compute_advantages types its inputs as jax Arrays (checked under the test hook).
  return registry.compute_advantages(APPO, batch, config, logp=jnp.asarray(logp),
                                     entropy=jnp.asarray(entropy))


def _token_starts(tree):
  return np.cumsum([0] + [len(n.tokens) for n in tree.nodes])


def _path(tree, leaf):
  """[(packed index, node)] along leaf's root-to-leaf sequence (canonical tree)."""
  start = _token_starts(tree)
  return [(int(start[n]) + j, n) for n in tree.path(tree.leaves[leaf].node)
          for j in range(len(tree.nodes[n].tokens))]


# ----------------------------------------------------------------------------
# Hand-worked fixture: N = 2 initial rollouts, B = 2 branches each
# ----------------------------------------------------------------------------

PROMPT = [7]  # one prompt token: sequence offset = rollout position + 1
H1_POLICY = (1, 1, 1, 0, 0, 1, 1, 1)  # positions 3-4 are tool output
H1_ENT = (0.2, 1.5, 0.9, 0.0, 0.0, 2.0, 0.1, 0.8)
H1_LOGRHO = (0.00, 0.05, -0.02, 0.0, 0.0, 0.10, -0.08, 0.01)
H2_POLICY = (1, 1, 1, 1, 1, 1)
H2_ENT = (0.3, 0.5, 1.6, 0.2, 1.4, 0.1)
H2_LOGRHO = (-0.06, -0.04, 0.05, -0.02, 0.06, -0.01)
# name -> (parent rollout, branch position, reward).
BRANCHES = {"b11": ("H1", 1, 0.0), "b12": ("H1", 5, 1.0),
            "b21": ("H2", 2, 1.0), "b22": ("H2", 4, 1.0)}
ROLLOUTS = {"H1": (H1_POLICY, 1.0, 100), "H2": (H2_POLICY, 0.0, 200)}  # mask, reward, tokens

# Worked by hand: Omega at every position; Z/BS at the model positions only.
OMEGA = {"H1": (1.059561, 1.060905, 1.009365, 1.030417, 1.031093, 1.031785, 0.932194, 1.010050),
         "H2": (0.976327, 1.037518, 1.081678, 1.029567, 1.051496, 0.990050)}
Z_FUT = {"H1": (1.273420, 1.328683, -0.791851, 0.130588, -1.177172, -0.763668),
         "H2": (-1.165439, 0.144614, 1.686590, -0.133026, 0.632701, -1.165439)}
Z_ENT = {"H1": (-1.066699, 0.868243, -0.024807, 1.612452, -1.215540, -0.173649),
         "H2": (-0.646670, -0.309277, 1.546384, -0.815366, 1.208991, -0.984063)}
BS = {"H1": (-1.358355, 1.153620, 0.019643, 0.210567, 1.430900, 0.132610),
      "H2": (0.753654, -0.044726, 2.608116, 0.108465, 0.764929, 1.146865)}
MODEL_POS = {"H1": (0, 1, 2, 5, 6, 7), "H2": (0, 1, 2, 3, 4, 5)}
# Base advantages at MODEL_POS per Eq. 6 reading, and the final advantages.
BASE = {
    "literal": {"H1": (0.788675,) * 6, "H2": (-1.366025,) * 6},
    "avg_flowback": {"H1": (0.211325, 0.788675, 0.788675, 1, 1, 1),
                     "H2": (-0.211325,) * 4 + (-1, -1)},
    "code_sum": {"H1": (0.422650, 1.577350, 1.577350, 1, 1, 1),
                 "H2": (-0.422650,) * 4 + (-1, -1)},
    "code_sum_inclusive": {"H1": (0.422650, 0.422650, 1.577350, 1.577350, 1, 1),
                           "H2": (-0.422650,) * 5 + (-1,)},
}
FINAL = {"H1": (0.323281, 1.207030, 1.186706, 1.515892, 1.500000, 1.505025),
         "H2": (-0.316987, -0.320952, -0.325618, -0.320111, -1.525748, -1.500000)}
# The fixture has N = 2, B = 2, M = 6. n_init and budget only size the selection metric
# (B per rollout), so the other fixture tests run the shared DEFAULT config.
FIX_CONFIG = appo.APPOConfig(n_init=2, budget=6)


def _add_rollout(tree, mask, cuts, tok0):
  """A rollout under the root, one node per run between policy/env changes and cuts.

  Returns the last node and, per cut c, the node a branch cut at c hangs from
  (the parent of the node starting at c, so the branch shares positions < c).
  """
  bounds = sorted({0, *cuts} | {p for p in range(1, len(mask)) if mask[p] != mask[p - 1]})
  parent, hang = 0, {}
  for a, b in zip(bounds, bounds[1:] + [len(mask)]):
    hang[a] = parent
    if mask[a]:
      parent = tree.add_node(parent, NodeKind.POLICY, [tok0 + p for p in range(a, b)],
                             logprobs=[-0.5 - 0.1 * p for p in range(a, b)])
    else:
      parent = tree.add_node(parent, NodeKind.ENV, [tok0 + p for p in range(a, b)])
  return parent, hang


def fixture_tree(inclusive: bool = False) -> tuple[RolloutTree, dict[str, int]]:
  """The fixture tree (canonical order) and each rollout's leaf index.

  Paper convention: the branch at p is a sibling of the node starting at p.
  `inclusive` hangs it one position later (the public code's prefix H_{<=p}).
  """
  tree = RolloutTree.new(PROMPT)
  ends = []
  for name, (mask, reward, tok0) in ROLLOUTS.items():
    mine = {b: v for b, v in BRANCHES.items() if v[0] == name}
    cuts = {b: p + 1 if inclusive else p for b, (_, p, _) in mine.items()}
    end, hang = _add_rollout(tree, mask, set(cuts.values()), tok0)
    ends.append((end, reward, LeafTag.INIT, tok0))
    for b, (_, _, r) in mine.items():
      tok = int(b[1:])  # b11 -> token 11: names the leaf after canonical()
      node = tree.add_node(hang[cuts[b]], NodeKind.POLICY, [tok, tok], logprobs=[-1.0, -1.0])
      ends.append((node, r, LeafTag.BRANCH, tok))
  for node, r, tag, _ in ends:
    tree.add_leaf(node, {"outcome": r}, tag=tag)
  tree = tree.canonical()
  names = {}
  for k, leaf in enumerate(tree.leaves):
    t = tree.nodes[leaf.node].tokens[0]
    names["H2" if t >= 200 else "H1" if t >= 100 else f"b{t}"] = k
  return tree, names


def fixture_inputs(tree, names, batch):
  """Current logp (behaviour + log rho) and entropy at the fixture's positions.

  Every other token (prompt, tool output, branch tokens) gets absurd values
  (logp = behaviour + 30, entropy 1e3) that must never reach H1's or H2's Omega
  or z-scores.
  """
  logrho = {"H1": H1_LOGRHO, "H2": H2_LOGRHO}
  ent = {"H1": H1_ENT, "H2": H2_ENT}
  behav = np.asarray(batch.behavior_logp, np.float32)
  logp = behav + 30.0
  entropy = np.full(behav.shape, 1e3, np.float32)
  for h in ("H1", "H2"):
    for i, (t, n) in enumerate(_path(tree, names[h])[len(PROMPT):]):
      if tree.nodes[n].kind == NodeKind.POLICY:
        logp[0, t] = behav[0, t] + logrho[h][i]
        entropy[0, t] = ent[h][i]
  return logp, entropy


@pytest.fixture(scope="module")
def fixture():
  tree, names = fixture_tree()
  batch = pack([tree], BUCKETS)
  logp, entropy = fixture_inputs(tree, names, batch)
  return tree, names, batch, logp, entropy


def _seq(tree, names, h):
  """Packed indices of rollout h's positions (prompt excluded)."""
  return [t for t, _ in _path(tree, names[h])[len(PROMPT):]]


def test_fixture_tree_shape(fixture):
  tree, names, batch, _, _ = fixture
  assert sorted(names) == ["H1", "H2", "b11", "b12", "b21", "b22"]
  # Coverage is structural: b11 (at 1) shares H1's node [0, 1) only.
  h1_nodes = tree.path(tree.leaves[names["H1"]].node)
  assert set(tree.path(tree.leaves[names["b11"]].node)) & set(h1_nodes) == {0, h1_nodes[1]}
  assert batch.tokens.shape == (N_TREES, TEST_BUCKETS.tokens[-1])


def test_fixture_future_value(fixture):
  tree, names, batch, logp, _ = fixture
  omega = np.asarray(_future(batch, logp, DEFAULT))
  for h in ("H1", "H2"):
    np.testing.assert_allclose(omega[0, _seq(tree, names, h)], OMEGA[h], atol=1e-5)
  # Hand checks of the Omega table.
  g = 2 ** (-1 / 32)
  assert math.isclose(OMEGA["H1"][6], math.exp(-0.08 + g * 0.01), abs_tol=1e-6)
  # Shared prompt, branch-only tokens and padding trees: Omega = 1.
  on_init = {t for h in ("H1", "H2") for t, _ in _path(tree, names[h])[len(PROMPT):]}
  others = [t for t in range(tree.num_tokens()) if t not in on_init]
  np.testing.assert_array_equal(omega[0, others], 1.0)
  np.testing.assert_array_equal(omega[1:], 1.0)


def test_fixture_branching_score(fixture):
  tree, names, batch, logp, entropy = fixture
  score = _score(batch, logp, entropy, DEFAULT)
  for h in ("H1", "H2"):
    k = names[h]
    pos = [len(PROMPT) + p for p in MODEL_POS[h]]
    valid = np.asarray(score.valid[0, k])
    assert np.flatnonzero(valid).tolist() == pos
    np.testing.assert_allclose(np.asarray(score.z_fut[0, k, pos]), Z_FUT[h], atol=1e-5)
    np.testing.assert_allclose(np.asarray(score.z_ent[0, k, pos]), Z_ENT[h], atol=1e-5)
    np.testing.assert_allclose(np.asarray(score.bs[0, k, pos]), BS[h], atol=1e-5)
  for name in ("b11", "b12", "b21", "b22"):
    assert not np.asarray(score.valid[0, names[name]]).any()
    assert not np.asarray(score.bs[0, names[name]]).any()
  # An extra candidate filter (e.g. punctuation, docs/methods/appo.md#valid-branch-positions)
  # removes H1 position 1.
  token_mask = np.ones(batch.tokens.shape, bool)
  token_mask[0, _seq(tree, names, "H1")[1]] = False
  score = _score(batch, logp, entropy, DEFAULT, token_mask)
  valid = np.asarray(score.valid[0, names["H1"]])
  assert np.flatnonzero(valid).tolist() == [len(PROMPT) + p for p in (0, 2, 5, 6, 7)]
  # Z over the 5 remaining positions (population std, by hand): BS at 0, 2, 5, 6, 7 =
  # -1.545390, -0.088042, 0.795879, 1.067648, 0; only 5 is both-positive, then 6.
  pos = [len(PROMPT) + p for p in (0, 2, 5, 6, 7)]
  np.testing.assert_allclose(np.asarray(score.bs[0, names["H1"], pos]),
                             [-1.545390, -0.088042, 0.795879, 1.067648, 0.0],
                             atol=1e-4)  # hand values from the 6-digit Omega table
  assert (_points(score, True)[0, names["H1"]] - len(PROMPT)).tolist() == [5, 6]


def _points(score, require, nb=2):
  """Best-first branch points; top-nb is a prefix of top-3, so nb <= 3 shares one compile."""
  width = max(nb, 3)
  out = _select(score.bs, score.z_fut, score.z_ent, score.valid, width, require)
  return np.asarray(out)[..., :nb]


def test_fixture_selection(fixture):
  tree, names, batch, logp, entropy = fixture
  score = _score(batch, logp, entropy, DEFAULT)
  off = len(PROMPT)
  strict, raw = _points(score, True), _points(score, False)
  # Strict: position 6 (H1) and 5 (H2) have both z < 0 and are rejected.
  assert (strict[0, names["H1"]] - off).tolist() == [1, 5]
  assert (strict[0, names["H2"]] - off).tolist() == [2, 4]
  assert (raw[0, names["H1"]] - off).tolist() == [6, 1]
  assert (raw[0, names["H2"]] - off).tolist() == [2, 5]
  for name in ("b11", "b12", "b21", "b22"):
    assert strict[0, names[name]].tolist() == [-1, -1]
  assert (strict[1:] == -1).all()
  # More branches than valid positions repeat the best ones cyclically
  # (docs/methods/appo.md#too-few-branch-points).
  many = _points(score, True, nb=8)
  # Both-positive {1, 5}, then the rest by raw BS (6, 7, 2, 0), then cycle.
  assert (many[0, names["H1"]] - off).tolist() == [1, 5, 6, 7, 2, 0, 1, 5]


def test_fixture_first_minibatch(fixture):
  tree, names, batch, _, entropy = fixture
  logp = np.asarray(batch.behavior_logp)  # theta = theta_old: log rho == 0
  np.testing.assert_array_equal(np.asarray(_future(batch, logp, DEFAULT)), 1.0)
  skip = SCORE_CONFIGS[1]  # bs_mode="future", first_minibatch_fallback="skip_branching"
  score = _score(batch, logp, entropy, skip)
  assert not np.asarray(score.z_fut).any()  # Z(clip Omega) == 0, so Eq. 5 gives BS == 0
  assert not np.asarray(score.bs).any() and not np.asarray(score.valid).any()
  assert (_points(score, True) == -1).all()
  score = _score(batch, logp, entropy, DEFAULT)  # the "entropy" fallback
  np.testing.assert_array_equal(np.asarray(score.bs), np.asarray(score.z_ent))
  assert (_points(score, True)[0, names["H1"]] - len(PROMPT)).tolist() == [5, 1]
  assert (_points(score, True)[0, names["H2"]] - len(PROMPT)).tolist() == [2, 4]
  m = appo.branching_metrics(score, DEFAULT)  # the fallback of every rollout is logged
  assert float(m["fallback_frac"]) == 1.0
  assert float(m["bs_both_positive_frac"]) == 0.0
  m = appo.branching_metrics(_score(batch, logp, entropy, skip), DEFAULT)
  assert float(m["fallback_frac"]) == 1.0  # rollouts skipped for the fallback still count
  assert float(m["bs_both_positive_frac"]) == 0.0  # no branch point at all
  adv = _run(batch, DEFAULT, logp, entropy)
  # A = 1.5 A_base (first mini-batch): Omega == 1 on every model token of H1 and H2.
  ts = np.asarray(adv.token_scale[0])
  for h in ("H1", "H2"):
    seq = _seq(tree, names, h)
    np.testing.assert_allclose(ts[[seq[p] for p in MODEL_POS[h]]], 1.5, rtol=1e-7)


def test_fixture_group_zscores(fixture):
  _, names, batch, _, _ = fixture
  z_i, z_b = (np.asarray(x[0]) for x in _zscores(batch, DEFAULT))
  np.testing.assert_allclose([z_i[names["H1"]], z_i[names["H2"]]], [1.0, -1.0], atol=1e-5)
  np.testing.assert_allclose([z_b[names[b]] for b in ("b11", "b12", "b21", "b22")],
                             [-1.732051, 0.577350, 0.577350, 0.577350], atol=1e-5)
  assert z_i[[names[b] for b in BRANCHES]].tolist() == [0.0] * 4
  assert z_b[[names["H1"], names["H2"]]].tolist() == [0.0] * 2
  pooled = dataclasses.replace(DEFAULT, dual_group=False)
  z_i, z_b = (np.asarray(x[0]) for x in _zscores(batch, pooled))
  z = z_i + z_b
  order = ["H1", "H2", "b11", "b12", "b21", "b22"]
  np.testing.assert_allclose([z[names[n]] for n in order],
                             [0.707107, -1.414214, -1.414214, 0.707107, 0.707107, 0.707107],
                             atol=1e-5)


def _base_at(tree, names, adv, h):
  """node_leaf of rollout h at each of its positions (0 on tool positions)."""
  nl = np.asarray(adv.node_leaf[0])
  return [nl[n, names[h]] for _, n in _path(tree, names[h])[len(PROMPT):]]


@pytest.mark.parametrize("mode", ["literal", "avg_flowback", "code_sum", "code_sum_inclusive"])
def test_fixture_base_advantages(fixture, mode):
  tree, names, batch, logp, entropy = fixture
  if mode == "code_sum_inclusive":  # needs its own tree: branches hang one position later
    tree, names = fixture_tree(inclusive=True)
    batch = pack([tree], BUCKETS)
    logp, entropy = fixture_inputs(tree, names, batch)
  config = dataclasses.replace(DEFAULT, base_adv_mode=mode.replace("_inclusive", ""))
  adv = _run(batch, config, logp, entropy)
  for h, policy in (("H1", H1_POLICY), ("H2", H2_POLICY)):
    got = _base_at(tree, names, adv, h)
    want = dict(zip(MODEL_POS[h], BASE[mode][h]))
    np.testing.assert_allclose(got, [want.get(p, 0.0) for p in range(len(policy))], atol=1e-5)
  nl = np.asarray(adv.node_leaf)
  assert not nl[0][:, [names[b] for b in BRANCHES]].any()  # branches are never trained
  assert not nl[1:].any()
  assert np.asarray(adv.leaf_mask[0]).tolist() == [
      tree.leaves[k].tag == LeafTag.INIT for k in range(len(tree.leaves))] + [False] * (
          batch.leaf_node.shape[1] - len(tree.leaves))


def test_fixture_pooled_ablation(fixture):
  tree, names, batch, logp, entropy = fixture
  zp = {"H1": 0.707107, "H2": -1.414214, "b11": -1.414214, "b12": 0.707107,
        "b21": 0.707107, "b22": 0.707107}
  for mode in ("literal", "avg_flowback"):
    config = dataclasses.replace(DEFAULT, dual_group=False, base_adv_mode=mode)
    adv = _run(batch, config, logp, entropy)
    if mode == "literal":  # both baselines pooled: 1/2 (z + z) = z
      want = {"H1": [zp["H1"]] * 6, "H2": [zp["H2"]] * 6}
    else:  # same coverage as the fixture, pooled z-scores
      h1_0 = 0.5 * (zp["H1"] + 0.5 * (zp["b11"] + zp["b12"]))
      h1_1 = 0.5 * (zp["H1"] + zp["b12"])
      h2_0 = 0.5 * (zp["H2"] + 0.5 * (zp["b21"] + zp["b22"]))
      h2_2 = 0.5 * (zp["H2"] + zp["b22"])
      want = {"H1": [h1_0, h1_1, h1_1, zp["H1"], zp["H1"], zp["H1"]],
              "H2": [h2_0, h2_0, h2_2, h2_2, zp["H2"], zp["H2"]]}
    for h in ("H1", "H2"):
      got = np.asarray(_base_at(tree, names, adv, h))[list(MODEL_POS[h])]
      np.testing.assert_allclose(got, want[h], atol=1e-5)


def test_fixture_final_advantage_and_metrics(fixture):
  tree, names, batch, logp, entropy = fixture
  adv = _run(batch, FIX_CONFIG, logp, entropy)
  ts = np.asarray(adv.token_scale[0])
  for h in ("H1", "H2"):
    seq = _seq(tree, names, h)
    final = np.asarray(_base_at(tree, names, adv, h)) * ts[seq]
    np.testing.assert_allclose(final[list(MODEL_POS[h])], FINAL[h], atol=1e-5)
    fut = [min(max(OMEGA[h][p], 1.0), 1.2) for p in MODEL_POS[h]]
    np.testing.assert_allclose(ts[[seq[p] for p in MODEL_POS[h]]],
                               1 + 0.5 * np.asarray(fut), atol=1e-5)
  # Tool, prompt and branch tokens keep scale 1; so does every padding tree.
  np.testing.assert_array_equal(ts[~np.asarray(batch.loss_mask[0])], 1.0)
  branch_toks = [t for b in ("b11", "b12", "b21", "b22") for t, _ in _path(tree, names[b])[-2:]]
  np.testing.assert_array_equal(ts[branch_toks], 1.0)
  np.testing.assert_array_equal(np.asarray(adv.token_scale[1:]), 1.0)
  m = {k: float(v) for k, v in adv.metrics.items()}
  omegas = [OMEGA[h][p] for h in ("H1", "H2") for p in MODEL_POS[h]]
  assert m["omega_mean"] == pytest.approx(np.mean(omegas), abs=1e-5)
  assert m["fut_clip_frac"] == pytest.approx(3 / 12)  # H1@6, H2@0, H2@5 are below 1
  # The Branching Score logs come with the score, not with the estimator.
  assert "fallback_frac" not in m and "bs_both_positive_frac" not in m
  bm = appo.branching_metrics(_score(batch, logp, entropy, DEFAULT), FIX_CONFIG)
  assert float(bm["fallback_frac"]) == 0.0
  assert float(bm["bs_both_positive_frac"]) == 1.0  # strict picks {1, 5} and {2, 4}
  assert m["z_init_zero_std_rate"] == 0.0 and m["z_branch_zero_std_rate"] == 0.0
  assert m["coverage_mean"] == pytest.approx(10 / 12)  # the fixture's coverage counts
  assert m["reward_mean_init"] == pytest.approx(0.5)
  assert m["reward_mean_branch"] == pytest.approx(0.75)
  np.testing.assert_allclose(np.asarray(adv.extras["omega"]),
                             np.asarray(_future(batch, logp, DEFAULT)), rtol=1e-6)


# ----------------------------------------------------------------------------
# Omega: reverse scan vs the O(L^2) decay-matrix definition
# ----------------------------------------------------------------------------


def _chain_tree(rng, n_init):
  """n_init long multi-turn rollouts (policy/env alternating) under one prompt."""
  tree = RolloutTree.new(rng.integers(1, 50, rng.integers(1, 4)).tolist())
  for _ in range(n_init):
    node, kind = 0, NodeKind.POLICY
    for _ in range(rng.integers(1, 6)):
      toks = rng.integers(1, 50, rng.integers(1, 6)).tolist()
      lps = (-rng.uniform(0.01, 3.0, len(toks))).tolist() if kind == NodeKind.POLICY else None
      node = tree.add_node(node, kind, toks, logprobs=lps)
      kind = NodeKind.ENV if kind == NodeKind.POLICY and rng.random() < 0.4 else NodeKind.POLICY
    tree.add_leaf(node, {"outcome": float(rng.integers(0, 2))})
  return tree.canonical()


def _decay_matrix_omega(x, gamma):
  """Omega_i = exp(clip(sum_j D[i, j] x_j, -20, 20)) with D[i, j] = gamma^(j - i), j >= i."""
  i, j = np.meshgrid(np.arange(len(x)), np.arange(len(x)), indexing="ij")
  decay = np.where(j >= i, gamma ** (j - i).astype(np.float64), 0.0)
  return np.exp(np.clip(decay @ np.asarray(x, np.float64), -20.0, 20.0))


def _check_node_layout(batch):
  """Packed node boundaries and loss-mask counts agree with derived.structure."""
  st = derived.structure(batch)
  bounds = _bounds(batch.node_of_token, batch.parent.shape[1])
  np.testing.assert_array_equal(np.diff(np.asarray(bounds), axis=1), st.node_tokens)
  np.testing.assert_array_equal(_policy_tokens(batch, bounds), st.node_policy_tokens)


@pytest.mark.parametrize("exact", [False, True])
def test_future_value_matches_decay_matrix(exact):
  """`exact` packs to the longest tree: L is then not a multiple of the scan block."""
  config = DEFAULT
  rng = np.random.default_rng(0)
  lengths = []
  for _ in range(4):
    trees = [_chain_tree(rng, rng.integers(1, 4)) for _ in range(N_TREES)]
    batch = pack(trees, Buckets.exact() if exact else BUCKETS)
    lengths.append(batch.tokens.shape[1])
    _check_node_layout(batch)
    behav = np.asarray(batch.behavior_logp)
    logp = (behav + rng.uniform(-0.5, 0.5, behav.shape)).astype(np.float32)
    omega = np.asarray(_future(batch, logp, config))
    for b, tree in enumerate(trees):
      for k in range(len(tree.leaves)):
        path = _path(tree, k)
        x = [(logp[b, t] - behav[b, t]) if tree.nodes[n].kind == NodeKind.POLICY else 0.0
             for t, n in path]
        want = _decay_matrix_omega(x, config.gamma)
        idx = [t for t, _ in path]
        exclusive = np.array([len(tree.leaves) == 1 or n != 0 for _, n in path])
        np.testing.assert_allclose(omega[b, idx][exclusive], want[exclusive], rtol=2e-5)
        np.testing.assert_array_equal(omega[b, idx][~exclusive], 1.0)  # shared prompt
  assert not exact or any(l % appo.SCAN_BLOCK for l in lengths)


@pytest.mark.parametrize("log_rho", [2.0, -2.0])
def test_future_value_clamps_log_sum(log_rho):
  """60 tokens of log rho = +-2 sum to ~+-66 near the start: clamped to +-20
  (docs/methods/appo.md#future-value-clamp)."""
  tree = _single([[(P, 30), (E, 5), (P, 25)]], [LeafTag.INIT], [1.0])
  batch = pack([tree], BUCKETS)
  behav = np.asarray(batch.behavior_logp)
  logp = np.where(np.asarray(batch.loss_mask), behav + log_rho, behav).astype(np.float32)
  omega = np.asarray(_future(batch, logp, DEFAULT))[0, :tree.num_tokens()]
  x = [log_rho if m else 0.0 for m in np.asarray(batch.loss_mask)[0, :tree.num_tokens()]]
  want = _decay_matrix_omega(x, DEFAULT.gamma)
  np.testing.assert_allclose(omega, want, rtol=2e-5)
  assert omega[0] == pytest.approx(math.exp(20.0 * np.sign(log_rho)), rel=1e-5)
  assert np.isfinite(omega).all()


def _few_leaves(tree):
  return len(tree.leaves) <= TEST_BUCKETS.leaves[-1]


@settings(max_examples=examples(100), deadline=None)
@given(trees=hst.lists(hst.one_of(appo_tree(), general_tree().filter(_few_leaves)), min_size=1,
                       max_size=N_TREES),
       seed=hst.integers(0, 2**31 - 1))
def test_future_value_matches_reference(trees, seed):
  """Omega on the packed layout vs the O(L^2) definition along every INIT path.

  Arbitrary tagged trees (INIT leaves sharing nodes, branch-only subtrees
  between INIT nodes) included: a token on exactly one INIT path gets that
  path's Omega, every other token exactly 1.
  """
  canon = [t.canonical() for t in trees]
  batch = pack(canon, BUCKETS)
  behav = np.asarray(batch.behavior_logp)
  rng = np.random.default_rng(seed)
  logp = (behav + rng.uniform(-0.3, 0.3, behav.shape)).astype(np.float32)
  omega = np.asarray(_future(batch, logp, DEFAULT))
  _check_node_layout(batch)
  for b, tree in enumerate(canon):
    t = tree.num_tokens()
    want, paths = np.ones(t), np.zeros(t, int)
    for k, om in ref_appo.reference_omega(tree, DEFAULT, logp[b]).items():
      idx = [i for i, _ in _path(tree, k)]
      want[idx] = om
      paths[idx] += 1
    np.testing.assert_allclose(omega[b, :t][paths == 1], want[paths == 1], rtol=2e-5)
    np.testing.assert_array_equal(omega[b, :t][paths != 1], 1.0)
    np.testing.assert_array_equal(omega[b, t:], 1.0)  # padding tokens
  np.testing.assert_array_equal(omega[len(canon):], 1.0)  # padding trees


# ----------------------------------------------------------------------------
# Oracle agreement on random APPO trees
# ----------------------------------------------------------------------------

def _fits(tree):
  return len(tree.nodes) <= TEST_BUCKETS.nodes[-1] and tree.num_tokens() <= TEST_BUCKETS.tokens[-1]


def _appo_batch(trees, seed, first_minibatch):
  """Pack and draw current logp / entropy; some trees get log rho == 0 (fallback path)."""
  canon = [t.canonical() for t in trees]
  batch = pack(canon, BUCKETS)
  rng = np.random.default_rng(seed)
  behav = np.asarray(batch.behavior_logp)
  logp = behav + rng.uniform(-0.3, 0.3, behav.shape)
  for b, first in enumerate(first_minibatch):
    if first:
      logp[b] = behav[b]
  entropy = rng.uniform(0.0, 3.0, behav.shape)
  return canon, batch, logp.astype(np.float32), entropy.astype(np.float32)


@settings(max_examples=examples(200), deadline=None)
@given(trees=hst.lists(appo_tree().filter(_fits), min_size=N_TREES, max_size=N_TREES),
       first=hst.lists(hst.booleans(), min_size=N_TREES, max_size=N_TREES),
       seed=hst.integers(0, 2**31 - 1))
def test_matches_reference(trees, first, seed):
  canon, batch, logp, entropy = _appo_batch(trees, seed, first)
  # node_leaf (A_base) for every base mode and the pooled ablation.
  for config in NODE_LEAF_CONFIGS:
    adv = _run(batch, config, logp, entropy)
    got = harness.node_leaf_per_tree(batch, adv, canon)
    for b, tree in enumerate(canon):
      np.testing.assert_allclose(got[b], ref_appo.reference(tree, config), atol=1e-5,
                                 err_msg=f"{config.base_adv_mode} dual={config.dual_group}")
    assert np.isfinite(np.asarray(adv.node_leaf)).all()
    assert all(np.isfinite(float(v)) for v in adv.metrics.values())
  # token scale 1 + b clip(Omega) (same for every config above).
  for b, tree in enumerate(canon):
    t = tree.num_tokens()
    want = ref_appo.reference_token_scale(tree, config, logp[b, :t])
    np.testing.assert_allclose(np.asarray(adv.token_scale)[b, :t], want, rtol=1e-5)
  # Branching Score and top-B selection.
  for config in SCORE_CONFIGS:
    score = _score(batch, logp, entropy, config)
    arrays = {f: np.asarray(getattr(score, f)) for f in score._fields}
    refs = [ref_appo.reference_branching(tree, config, logp[b], entropy[b])
            for b, tree in enumerate(canon)]
    for require in (True, False):
      points = _points(score, require, nb=3)
      for b, (tree, ref) in enumerate(zip(canon, refs)):
        for k in range(len(tree.leaves)):
          if k not in ref:
            assert not arrays["valid"][b, k].any() and (points[b, k] == -1).all()
            continue
          r, n = ref[k], len(ref[k]["bs"])
          assert arrays["valid"][b, k, :n].tolist() == r["valid"]
          for f in ("bs", "z_fut", "z_ent"):
            np.testing.assert_allclose(arrays[f][b, k, :n], r[f], atol=2e-4)
          _assert_same_selection(points[b, k], r, require)


def _assert_same_selection(got, r, require):
  """Same picks as the reference, up to float32 near-ties in BS."""
  want = ref_appo.reference_select(r["bs"], r["z_fut"], r["z_ent"], r["valid"], len(got),
                                   require)
  if want[0] == -1:
    assert got.tolist() == want
    return
  tier = lambda p: require and r["z_fut"][p] > 0 and r["z_ent"][p] > 0
  for g, w in zip(got.tolist(), want):
    assert g >= 0 and r["valid"][g]
    assert tier(g) == tier(w) and abs(r["bs"][g] - r["bs"][w]) < 1e-3, (got, want)


# ----------------------------------------------------------------------------
# Invariances and degenerate cases
# ----------------------------------------------------------------------------


@settings(max_examples=examples(30), deadline=None)
@given(trees=hst.lists(appo_tree(outcomes=(1.0,)).filter(_fits), min_size=N_TREES,
                       max_size=N_TREES))
def test_equal_rewards_give_zero_advantage(trees):
  _, batch, logp, entropy = _appo_batch(trees, 0, [False] * N_TREES)
  for config in NODE_LEAF_CONFIGS:
    adv = _run(batch, config, logp, entropy)
    np.testing.assert_array_equal(np.asarray(adv.node_leaf), 0.0)
    assert float(adv.metrics["z_init_zero_std_rate"]) == 1.0


@settings(max_examples=examples(30), deadline=None)
@given(trees=hst.lists(appo_tree(branches_max=0).filter(_fits), min_size=N_TREES,
                       max_size=N_TREES))
def test_no_branches_reduces_to_z_init(trees):
  canon, batch, logp, entropy = _appo_batch(trees, 1, [False] * N_TREES)
  for config in NODE_LEAF_CONFIGS[:3]:  # every base mode
    adv = _run(batch, config, logp, entropy)
    got = harness.node_leaf_per_tree(batch, adv, canon)
    for b, tree in enumerate(canon):
      r = np.array([leaf.rewards["outcome"] for leaf in tree.leaves])
      sd = r.std()
      z = (r - r.mean()) / (sd + config.std_eps) if sd > 1e-6 else np.zeros_like(r)
      want = np.zeros_like(got[b])
      for k, path in enumerate(tree.leaf_paths()):
        for n in path:
          if tree.nodes[n].kind == NodeKind.POLICY:
            want[n, k] = z[k]
      np.testing.assert_allclose(got[b], want, atol=1e-6)


def _check_finite(batch, adv, config):
  nl = np.asarray(adv.node_leaf)
  ts = np.asarray(adv.token_scale)
  assert np.isfinite(nl).all() and np.isfinite(ts).all()
  assert all(np.isfinite(float(v)) for v in adv.metrics.values())
  assert ((ts >= 1.0) & (ts <= 1.0 + config.b * config.fut_clip[1] + 1e-6)).all()
  kinds = np.asarray(batch.node_kind)
  assert not nl[kinds != int(NodeKind.POLICY)].any()  # prompt, env and padding nodes
  init = (np.asarray(batch.leaf_tag) == int(LeafTag.INIT)) & (np.asarray(batch.leaf_node) >= 0)
  assert not np.transpose(nl, (0, 2, 1))[~init].any()  # branch and padding leaves
  assert (np.asarray(adv.leaf_mask) == init).all()


def _single(kinds_lens, tags, rewards):
  """A prompt with one chain per entry of kinds_lens, each ending in one leaf."""
  tree = RolloutTree.new([1])
  for chain, tag, r in zip(kinds_lens, tags, rewards):
    node = 0
    for kind, n in chain:
      lps = [-1.0] * n if kind == NodeKind.POLICY else None
      node = tree.add_node(node, kind, [2] * n, logprobs=lps)
    tree.add_leaf(node, {"outcome": r}, tag=tag)
  return tree


P, E = NodeKind.POLICY, NodeKind.ENV
DEGENERATE = [
    _single([[(P, 1)]], [LeafTag.INIT], [1.0]),  # one init leaf, one token
    _single([[(P, 2), (E, 3)]], [LeafTag.INIT], [0.0]),  # ends on tool output
    _single([[(P, 1)], [(P, 4)]], [LeafTag.BRANCH] * 2, [0.0, 1.0]),  # no init leaf at all
    _single([[(P, 3)], [(P, 2)]], [LeafTag.INIT, LeafTag.BRANCH], [1.0, 0.0]),  # branch at 0
]


@pytest.mark.parametrize("config", NODE_LEAF_CONFIGS + SCORE_CONFIGS[1:])
def test_degenerate_trees_are_finite(config):
  for trees in (DEGENERATE, DEGENERATE[:1]):  # the second batch has 3 padding trees
    batch = pack(trees, BUCKETS)
    behav = np.asarray(batch.behavior_logp)
    for logp in (behav, behav + 0.2):
      adv = _run(batch, config, logp.astype(np.float32), np.ones_like(behav))
      _check_finite(batch, adv, config)
  # One init leaf: z_I = 0, so every advantage is 0 without branches.
  batch = pack(DEGENERATE[:2], BUCKETS)
  adv = _run(batch, config, np.asarray(batch.behavior_logp), np.ones_like(batch.behavior_logp))
  assert not np.asarray(adv.node_leaf).any()


@settings(max_examples=examples(30), deadline=None)
@given(trees=hst.lists(general_tree().filter(lambda t: len(t.leaves) <= 16), min_size=N_TREES,
                       max_size=N_TREES),
       seed=hst.integers(0, 1000))
def test_arbitrary_tagged_trees_are_finite(trees, seed):
  """Trees that break the APPO layout (INIT leaves sharing nodes) still give finite output."""
  _, batch, logp, entropy = _appo_batch(trees, seed, [False] * N_TREES)
  config = NODE_LEAF_CONFIGS[0]
  _check_finite(batch, _run(batch, config, logp, entropy), config)
  score = _score(batch, logp, entropy, config)
  assert all(np.isfinite(np.asarray(x)).all() for x in score)


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


def test_config_defaults_and_validation():
  c = appo.APPOConfig()
  assert (c.n_init, c.budget, c.num_branches) == (4, 16, 3)
  assert c.gamma == pytest.approx(0.9785720621) and c.gamma ** 32 == pytest.approx(0.5)
  assert c.fut_clip == (1.0, 1.2) and c.b == 0.5 and c.base_adv_mode == "avg_flowback"
  hash(c)
  assert registry.make_config(APPO, budget=8).num_branches == 1
  for field, bad, words in [
      ("base_adv_mode", "sum", ["base_adv_mode", "avg_flowback", "code_sum", "literal"]),
      ("bs_mode", "ent", ["bs_mode", "entropy", "future"]),
      ("first_minibatch_fallback", "random", ["first_minibatch_fallback", "skip_branching"]),
      ("budget", 10, ["budget", "multiple"]),
      ("fut_clip", (1.2, 1.0), ["fut_clip"]),
      ("std_ddof", 2, ["std_ddof"]),
      ("tau_half", 0.0, ["tau_half"]),
  ]:
    with pytest.raises(ValueError) as e:
      appo.APPOConfig(**{field: bad})
    assert all(w in str(e.value) for w in words), str(e.value)
  batch = pack(DEGENERATE[:1], BUCKETS)
  with pytest.raises(ValueError, match="missing"):
    registry.compute_advantages(APPO, batch, c, logp=batch.behavior_logp)
