"""PORTool advantages (arXiv 2510.26020, §3.2, Eqs. 2-3, Theorem 3.1): a hand-worked
fixture and its variants, oracle agreement with ref_portool on random trees, Theorem 3.1's
identities (docs/methods/portool.md#theorem-31-identities), and degenerate and invariance
cases (docs/methods/portool.md#trees-without-forks)."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tests.algos import ref_portool
from tree_rl.algos import portool, registry
from tree_rl.tree import NodeKind, RolloutTree, pack

# One shape for every test, so nothing recompiles for a new batch: TEST_BUCKETS
# widened to fit the hand-worked fixture (223 tokens, 99 on the longest path) and the
# largest portool_tree (n = 8 unshared, unfinished 4-step trajectories: 65
# nodes and up to 195 tokens, beyond TEST_BUCKETS' 64 and 128), with a fixed
# batch of 4 trees (fewer trees are padded with empty trees).
BUCKETS = dataclasses.replace(S.TEST_BUCKETS, tokens=(256,), nodes=(128,), path_tokens=(128,),
                              trees=(4,))
SETTINGS = settings(max_examples=S.examples(200), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FOUR_PORTOOL = st.lists(S.portool_tree(), min_size=4, max_size=4)
DEFAULT = portool.PORToolConfig()


# Every numeric setting is an array input of portool_kernel, so all variant
# configs share this one compile; the registered path (config static, one
# compile per config) runs the default config and is checked against it.
_KERNEL = jax.jit(portool.portool_kernel, static_argnames=("reward_channels", "format_channel"))


def _advantages(batch, config, registered):
  if registered:
    return registry.compute_advantages("portool", batch, config)
  return _KERNEL(batch, portool.PORToolParams.from_config(config),
                 reward_channels=config.reward_channels, format_channel=config.format_channel)


def _run(trees, config=DEFAULT, registered=None):
  """Canonical trees, and the estimator's Advantages as numpy (float64).

  By default the registered estimator runs the default config and the
  shared kernel compile runs every other config.
  """
  canon = [t.canonical() for t in trees]
  registered = config == DEFAULT if registered is None else registered
  adv = _advantages(pack(canon, BUCKETS), config, registered)
  out = dict(node_leaf=np.asarray(adv.node_leaf, np.float64),
             metrics={k: float(v) for k, v in adv.metrics.items()})
  out.update({k: np.asarray(v, np.float64) for k, v in adv.extras.items()})
  return canon, out


def _check_oracle(trees, config):
  canon, out = _run(trees, config)
  assert np.isfinite(out["node_leaf"]).all()
  for b, t in enumerate(canon):
    got = out["node_leaf"][b]
    want = ref_portool.reference(t, config)
    np.testing.assert_allclose(got[: len(t.nodes), : len(t.leaves)], want, atol=1e-4,
                               rtol=1e-4, err_msg=f"tree {b}")
    assert not got[len(t.nodes):].any() and not got[:, len(t.leaves):].any()
  np.testing.assert_allclose(out["node_leaf"], out["trajectory_term"] + out["fork_term"],
                             atol=1e-6)
  return canon, out


def _policy_tokens(t, path):
  return sum(len(t.nodes[i].tokens) for i in path if t.nodes[i].kind == NodeKind.POLICY)


# ----------------------------------------------------------------------------
# Hand-worked fixture
# ----------------------------------------------------------------------------


def _fixture(c_raw=1.0):
  """The hand-worked tree (n = 4, f = 2, T_max = 3). Node ids (preorder): A=1,
  A1=3, A1x=5, A2=7, B=8, B1=10, C=11, C1=13; env nodes 2, 4, 6, 9, 12 (two
  tokens each). Leaves: tau1 ends at the env node 6 after A1x (truncated at
  T_max, R_out -1), tau2 at A2, tau3 at B1, tau4 at C1 (all +1)."""
  t = RolloutTree.new([1, 2, 3])

  def step(parent, n_tok, raw, s):
    return t.add_node(parent, NodeKind.POLICY, [5] * n_tok, logprobs=[-1.0] * n_tok, step=s,
                      rewards={"format": raw})

  def env(parent, s):
    return t.add_node(parent, NodeKind.ENV, [7, 7], step=s)

  a = step(0, 40, 1.0, 1)
  a1 = step(env(a, 1), 20, 0.725, 2)
  t.add_leaf(env(step(env(a1, 2), 30, 0.3, 3), 3), {"outcome": -1.0}, truncated=True)
  t.add_leaf(step(2, 10, 1.0, 2), {"outcome": 1.0})
  t.add_leaf(step(env(step(0, 30, 1.0, 1), 1), 10, 1.0, 2), {"outcome": 1.0})
  t.add_leaf(step(env(step(0, 50, c_raw, 1), 1), 20, 1.0, 2), {"outcome": 1.0})
  return t


# (trajectory k, node) of the fixture's advantage table, in its row order.
CELLS = [(0, 1), (0, 3), (0, 5), (1, 1), (1, 7), (2, 8), (2, 10), (3, 11), (3, 13)]
FIXTURE_ADV = [-1.638010, -6.232051, -1.732051, -1.166606, 5.577350, 1.205890, 0.577350,
            1.237317, 0.577350]
FIXTURE_TRAJ_TERM = [-0.577350, -1.732051, -1.732051, -0.577350, 0.577350, 0.577350, 0.577350,
                 0.577350, 0.577350]
FIXTURE_OMEGA2 = [0.75, 4.5, 0.0, 5 / 12, 5.0, 8 / 9, 0.0, 14 / 15, 0.0]

VARIANTS = {
    # n_forks = 1 (fork A only); omega2(1, A1) = 9, omega2(2, A2) = 10.
    "root_not_fork": (dict(root_is_fork=False),
                      [-0.577350, -10.732051, -1.732051, -0.577350, 10.577350, 0.577350,
                       0.577350, 0.577350, 0.577350]),
    # Sample std: A_trj = [-1.5, .5, .5, .5], A_fork root [-1.154701, .57735, .57735].
    "ddof1": (dict(std_ddof=1),
              [-1.366025, -4.681981, -1.5, -0.981125, 4.035534, 1.013200, 0.5, 1.038860, 0.5]),
    # G = max gives R(A) = R(B) = R(C) = 1.2, so no root fork term.
    "g_max": (dict(g_rule="max"),
              [-0.577350, -6.232051, -1.732051, -0.577350, 5.577350, 0.577350, 0.577350,
               0.577350, 0.577350]),
    # G = avg equals adaptive (A1, A2 each hold one trajectory: max = avg).
    "g_avg": (dict(g_rule="avg"), FIXTURE_ADV),
    # mix2: the outcome-only maxima are A: max(-0.9025, 0.95), B: 0.95, C: 0.95,
    # a tie -> avg at the root, as adaptive; at A: -0.95 vs 1 -> max. Same table.
    "mix2": (dict(g_rule="mix2"), FIXTURE_ADV),
    # traj_only: omega2 = 0, so A = the fixture's trajectory-term column.
    "traj_only": (dict(omega_mode="traj_only"), FIXTURE_TRAJ_TERM),
    # fork_only: omega1 = 0, A = omega2 A_fork: 0.75 * -1.414214 = -1.060660,
    # 4.5 * -1 = -4.5, 0, (5/12) * -1.414214 = -0.589256, 5 * 1 = 5,
    # (8/9) * 0.707107 = 0.628539, 0, (14/15) * 0.707107 = 0.659966, 0.
    "fork_only": (dict(omega_mode="fork_only"),
                  [-1.060660, -4.5, 0.0, -0.589256, 5.0, 0.628539, 0.0, 0.659966, 0.0]),
    # no_scale: omega2 = 1 on fork children: -0.577350 - 1.414214 = -1.991564,
    # -1.732051 - 1 = -2.732051, -1.732051, -1.991564, 0.577350 + 1 = 1.577350,
    # 0.577350 + 0.707107 = 1.284457, 0.577350, 1.284457, 0.577350.
    "no_scale": (dict(omega_mode="no_scale"),
                 [-1.991564, -2.732051, -1.732051, -1.991564, 1.577350, 1.284457, 0.577350,
                  1.284457, 0.577350]),
}


def _cells(x, b=0):
  return np.array([x[b, n, k] for k, n in CELLS])


def test_fixture_table():
  canon, out = _run([_fixture()])
  assert [len(t.nodes) for t in canon] == [14] and canon[0].leaves[0].node == 6
  nl = out["node_leaf"]
  np.testing.assert_allclose(_cells(nl), FIXTURE_ADV, atol=1e-5)
  np.testing.assert_allclose(_cells(out["trajectory_term"]), FIXTURE_TRAJ_TERM, atol=1e-5)
  np.testing.assert_allclose(_cells(out["omega2"]), FIXTURE_OMEGA2, atol=1e-5)
  # A_fork: root [-1.414214, .707107, .707107] on A, B, C; fork A: [-1, 1] on A1, A2.
  np.testing.assert_allclose(out["fork_adv"][0, [1, 8, 11, 3, 7]],
                             [-1.414214, 0.707107, 0.707107, -1, 1], atol=1e-5)
  # Everything else (root, env nodes, off-path cells, padding trees) is 0.
  mask = np.zeros_like(nl, bool)
  for k, n in CELLS:
    mask[0, n, k] = True
  assert not nl[~mask].any()
  # Metrics over the one real tree: forks = {root (avg), A (max)}.
  m = out["metrics"]
  assert m["n_forks_mean"] == 2 and m["fork_avg_frac"] == 0.5 and m["zero_std_frac"] == 0
  np.testing.assert_allclose(m["omega2_max"], 5.0, rtol=1e-6)
  np.testing.assert_allclose(m["omega2_mean"], sum(FIXTURE_OMEGA2) / 6, rtol=1e-6)

  # Weight check: (1/n) sum_j (1/|tau_j|) sum_t omega2 |s| = mean(4/3, 4/3, 2/3, 2/3) = 1.
  t = canon[0]
  paths = t.leaf_paths()
  tau = [_policy_tokens(t, p) for p in paths]
  assert tau == [90, 50, 40, 70]
  w = [sum(out["omega2"][0, i, k] * len(t.nodes[i].tokens) for i in p) / tau[k]
       for k, p in enumerate(paths)]
  np.testing.assert_allclose(w, [4 / 3, 4 / 3, 2 / 3, 2 / 3], atol=1e-6)
  np.testing.assert_allclose(np.mean(w), 1.0, atol=1e-6)
  # Objective at rho = 1: J = (1/n) sum_j (1/|tau_j|) sum_t |s| A = -0.102640.
  j = np.mean([sum(nl[0, i, k] * len(t.nodes[i].tokens) for i in p
                   if t.nodes[i].kind == NodeKind.POLICY) / tau[k]
               for k, p in enumerate(paths)])
  np.testing.assert_allclose(j, -0.102640, atol=1e-6)
  # ... and J_trj alone is the same number (J_fork = 0 at rho = 1: the A_fork of a fork's
  # children sum to 0).
  j_trj = np.mean([sum(out["trajectory_term"][0, i, k] * len(t.nodes[i].tokens) for i in p)
                   / tau[k] for k, p in enumerate(paths)])
  np.testing.assert_allclose(j_trj, -0.102640, atol=1e-6)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fixture_variants(name):
  overrides, want = VARIANTS[name]
  config = portool.PORToolConfig(**overrides)
  canon, out = _run([_fixture()], config)
  np.testing.assert_allclose(_cells(out["node_leaf"]), want, atol=1e-5, err_msg=name)
  if name == "root_not_fork":
    assert out["metrics"]["n_forks_mean"] == 1
    np.testing.assert_allclose(out["omega2"][0, 3, 0], 9.0, rtol=1e-6)
    np.testing.assert_allclose(out["omega2"][0, 7, 1], 10.0, rtol=1e-6)
  if name == "ddof1":
    np.testing.assert_allclose(out["fork_adv"][0, [1, 8, 11, 3, 7]],
                               [-1.154701, 0.577350, 0.577350, -0.707107, 0.707107], atol=1e-5)


def test_mix2_differs_from_adaptive():
  # The hand-worked fixture with C's rubric at 0.725 (R_fm(C) = 0.1125).
  # Root values v_k = gamma^(T_k - 1) R_out + R_fm:
  #   Rmax(A) = 1.2, Rmax(B) = 1.2, Rmax(C) = 0.95 + 0.1125 = 1.0625.
  # adaptive: the Rmax differ -> G = max: R = [1.2, 1.2, 1.0625], mean 1.154167,
  #   std 0.064818, A_fork = [0.707107, 0.707107, -1.414214], so
  #   (1,A) = -0.577350 + 0.75 * 0.707107 = -0.047020, (2,A) = -0.577350 + 5/12 * 0.707107
  #   = -0.282722, (3,B) = 1.205890, (4,C) = 0.577350 - 14/15 * 1.414214 = -0.742582.
  # mix2: outcome-only maxima all 0.95 -> G = avg: R = [0.27375, 1.2, 1.0625],
  #   mean 0.845417, std 0.408108, A_fork = [-1.400772, 0.868846, 0.531926], so
  #   (1,A) = -0.577350 - 0.75 * 1.400772 = -1.627929, (2,A) = -1.161005,
  #   (3,B) = 0.577350 + 8/9 * 0.868846 = 1.349658, (4,C) = 0.577350 + 14/15 * 0.531926
  #   = 1.073814. Fork A is unchanged (-6.232051, 5.577350).
  want = {
      "adaptive": [-0.047020, -6.232051, -1.732051, -0.282722, 5.577350, 1.205890, 0.577350,
                   -0.742582, 0.577350],
      "mix2": [-1.627929, -6.232051, -1.732051, -1.161005, 5.577350, 1.349658, 0.577350,
               1.073814, 0.577350],
  }
  for rule, values in want.items():
    _, out = _run([_fixture(c_raw=0.725)], portool.PORToolConfig(g_rule=rule))
    # atol 5e-5: std_eps = 1e-6 on a std of 0.065 moves A_fork by 1.5e-5 relative.
    np.testing.assert_allclose(_cells(out["node_leaf"]), values, atol=5e-5, err_msg=rule)
    assert out["metrics"]["fork_avg_frac"] == (0.5 if rule == "mix2" else 0.0)


# ----------------------------------------------------------------------------
# Degenerate trees
# ----------------------------------------------------------------------------


def _pol(t, parent, n_tok, raw):
  return t.add_node(parent, NodeKind.POLICY, [4] * n_tok, logprobs=[-0.3] * n_tok,
                    rewards={"format": raw})


def _env(t, parent):
  return t.add_node(parent, NodeKind.ENV, [6])


def test_degenerate_hand_trees():
  # (a) One leaf through a two-step chain: n = 1, std 0 -> A_trj = 0; the
  # root has one child -> no fork. Everything is 0.
  one = RolloutTree.new([1])
  one.add_leaf(_pol(one, _env(one, _pol(one, 0, 3, 1.0)), 2, 0.2), {"outcome": 1.0})
  # (b) Depth 1 (a flat group): outcomes [+1, -1] -> A_trj = [1, -1];
  # R = [1 + 0.25, -1 - 0.25] -> A_fork = [1, -1]; omega2 = n|tau|/(1 |s| n 1) = 1.
  # A = [2, -2].
  flat = RolloutTree.new([1])
  flat.add_leaf(_pol(flat, 0, 4, 1.0), {"outcome": 1.0})
  flat.add_leaf(_pol(flat, 0, 2, 0.0), {"outcome": -1.0})
  # (c) A chain P1 (2 tok, raw 0.4) -> P2 (3) -> P3 (1), R_out +1, beside a
  # truncated one-step Q1 (2 tok, raw 1.0), R_out -1. A_trj = [1, -1].
  # F = {root}: R(P1) = 0.95^2 + (0.2 - 0.25) = 0.8525, R(Q1) = -1 + 0.25 = -0.75
  # -> A_fork = [1, -1]; omega2(1, P1) = 2*6/(1*2*2*1) = 3, omega2(2, Q1) =
  # 2*2/(1*2*2*1) = 1. A(P1) = 1 + 3 = 4, A(P2) = A(P3) = 1 (single children),
  # A(Q1) = -1 - 1 = -2.
  chain = RolloutTree.new([1])
  p1 = _pol(chain, 0, 2, 0.4)
  p2 = _pol(chain, _env(chain, p1), 3, 1.0)
  chain.add_leaf(_pol(chain, _env(chain, p2), 1, 1.0), {"outcome": 1.0})
  chain.add_leaf(_pol(chain, 0, 2, 1.0), {"outcome": -1.0}, truncated=True)
  # (d) A trajectory with no step at all (an env leaf under the root, R_out 0)
  # beside one step with R_out +1: A_trj = [-1, 1] (leaf order: node 1, 2);
  # the root has one step child, so no fork: A(step) = 1.
  no_step = RolloutTree.new([1])
  no_step.add_leaf(_env(no_step, 0), {"outcome": 0.0})
  no_step.add_leaf(_pol(no_step, 0, 2, 0.5), {"outcome": 1.0})

  trees = [one, flat, chain, no_step]
  canon, out = _run(trees)
  nl = out["node_leaf"]
  assert not nl[0].any()
  np.testing.assert_allclose([nl[1, 1, 0], nl[1, 2, 1]], [2, -2], atol=1e-5)
  assert [l.node for l in canon[2].leaves] == [5, 6]
  np.testing.assert_allclose([nl[2, 1, 0], nl[2, 3, 0], nl[2, 5, 0], nl[2, 6, 1]],
                             [4, 1, 1, -2], atol=1e-5)
  np.testing.assert_allclose(nl[3, 2, 1], 1, atol=1e-5)
  assert np.count_nonzero(nl[3]) == 1
  for b, t in enumerate(canon):
    np.testing.assert_allclose(nl[b, : len(t.nodes), : len(t.leaves)],
                               ref_portool.reference(t, DEFAULT), atol=1e-5)
  # n_forks per tree: 0, 1, 1, 0.
  assert out["metrics"]["n_forks_mean"] == 0.5
  assert out["metrics"]["zero_std_frac"] == 0.25

  # root_is_fork=False on (c): n_forks = 0 -> the fork term vanishes
  # (docs/methods/portool.md#trees-without-forks).
  _, out = _run(trees, portool.PORToolConfig(root_is_fork=False))
  np.testing.assert_allclose([out["node_leaf"][2, n, k] for n, k in [(1, 0), (3, 0), (6, 1)]],
                             [1, 1, -1], atol=1e-5)
  assert not out["fork_term"].any() and out["metrics"]["n_forks_mean"] == 0


def test_config_validation():
  with pytest.raises(ValueError, match=r"g_rule='maximum'.*adaptive.*max.*avg.*mix2"):
    portool.PORToolConfig(g_rule="maximum")
  with pytest.raises(ValueError, match=r"omega_mode.*theorem.*traj_only.*fork_only.*no_scale"):
    portool.PORToolConfig(omega_mode="both")
  with pytest.raises(ValueError, match="std_ddof"):
    portool.PORToolConfig(std_ddof=2)
  with pytest.raises(ValueError, match="gamma"):
    portool.PORToolConfig(gamma=1.5)
  with pytest.raises(ValueError, match="g_tie_tol"):
    portool.PORToolConfig(g_tie_tol=-1.0)
  assert registry.make_config("portool", g_rule="max") == portool.PORToolConfig(g_rule="max")
  hash(DEFAULT)


@pytest.mark.parametrize("config", [DEFAULT, portool.PORToolConfig(root_is_fork=False,
                                                                    g_rule="mix2")])
def test_registered_estimator_matches_kernel(config):
  trees = [_fixture(), _fixture(c_raw=0.725)]
  _, reg = _run(trees, config, registered=True)
  _, ker = _run(trees, config, registered=False)
  for key in ("node_leaf", "trajectory_term", "fork_term", "omega2", "fork_adv"):
    np.testing.assert_allclose(reg[key], ker[key], atol=1e-6, err_msg=key)
  for key, v in reg["metrics"].items():
    np.testing.assert_allclose(v, ker["metrics"][key], rtol=1e-6, err_msg=key)


# ----------------------------------------------------------------------------
# Oracle agreement on random trees
# ----------------------------------------------------------------------------


@SETTINGS
@given(trees=FOUR_PORTOOL)
def test_oracle_default(trees):
  _check_oracle(trees, DEFAULT)


GAMMA1_SCALED = portool.PORToolConfig(gamma=1.0, format_is_raw=False)
ORACLE_VARIANTS = [portool.PORToolConfig(**kw) for kw, _ in VARIANTS.values()] + [
    GAMMA1_SCALED,
    portool.PORToolConfig(gamma=0.0, g_rule="mix2", std_ddof=1),
    portool.PORToolConfig(gamma=0.9, fm_half_range=0.1, g_rule="max", root_is_fork=False,
                          omega_mode="no_scale"),
]


@settings(SETTINGS, max_examples=S.examples(60))
@given(trees=FOUR_PORTOOL, config=st.sampled_from(ORACLE_VARIANTS))
def test_oracle_variants(trees, config):
  _check_oracle(trees, config)


@settings(SETTINGS, max_examples=S.examples(40))
@given(trees=st.lists(S.general_tree(), min_size=4, max_size=4))
def test_general_trees_finite_and_match(trees):
  # Policy nodes split into chains, env leaves, env-after-env: no NaN/inf,
  # and still the reference's values.
  canon, out = _check_oracle(trees, DEFAULT)
  for key in ("trajectory_term", "fork_term", "omega2", "fork_adv"):
    assert np.isfinite(out[key]).all(), key
  assert all(np.isfinite(v) for v in out["metrics"].values())


# ----------------------------------------------------------------------------
# Theorem 3.1 identities (PORTool App. B)
# ----------------------------------------------------------------------------


def _phi(a, rho, eps=0.2):
  return np.minimum(rho * a, np.clip(rho, 1 - eps, 1 + eps) * a)


@settings(SETTINGS, max_examples=S.examples(60))
@given(trees=FOUR_PORTOOL, seed=st.integers(0, 2**31 - 1))
def test_identities_i1_i3(trees, seed):
  """The omega2-weighted per-trajectory fork sum equals the fork-wise GRPO
  objective for random per-token ratios, and the weights sum to 1
  (docs/methods/portool.md#theorem-31-identities)."""
  canon, out = _run(trees)
  rng = np.random.default_rng(seed)
  for b, t in enumerate(canon):
    # One ratio per token of each distinct node, shared by all its copies
    # (docs/methods/portool.md#shared-steps).
    rho = [rng.uniform(0.5, 1.5, len(node.tokens)) for node in t.nodes]
    kids, fork_set = ref_portool.forks(t, DEFAULT)
    paths = t.leaf_paths()
    n = len(paths)
    tau = [_policy_tokens(t, p) for p in paths]
    steps = [[i for i in p if t.nodes[i].kind == NodeKind.POLICY] for p in paths]
    lhs = sum(_phi(out["fork_term"][b, i, k], rho[i]).sum() / (n * tau[k])
              for k in range(n) for i in steps[k])
    rhs = sum(_phi(out["fork_adv"][b, c], rho[c]).sum()
              / (len(fork_set) * len(kids[p]) * len(t.nodes[c].tokens))
              for p in fork_set for c in kids[p])
    np.testing.assert_allclose(lhs, rhs, atol=1e-6)
    i3 = sum(out["omega2"][b, i, k] * len(t.nodes[i].tokens) / (n * tau[k])
             for k in range(n) for i in steps[k])
    np.testing.assert_allclose(i3, 1.0 if fork_set else 0.0, atol=1e-5)


# ----------------------------------------------------------------------------
# Invariances
# ----------------------------------------------------------------------------


def _with_constant_rewards(tree, outcome, raw):
  t = dataclasses.replace(tree, nodes=[dataclasses.replace(n, rewards=dict(n.rewards))
                                       for n in tree.nodes],
                          leaves=[dataclasses.replace(l, rewards=dict(l.rewards))
                                  for l in tree.leaves])
  for leaf in t.leaves:
    leaf.rewards["outcome"] = outcome
  for node in t.nodes:
    if node.kind == NodeKind.POLICY:
      node.rewards["format"] = raw
  return t


@settings(SETTINGS, max_examples=S.examples(30))
@given(trees=st.lists(st.one_of(S.portool_tree(), S.general_tree()), min_size=4, max_size=4),
       outcome=st.sampled_from(S.OUTCOMES), raw=st.sampled_from(S.FORMAT_RAW))
def test_constant_rewards_give_zero(trees, outcome, raw):
  trees = [_with_constant_rewards(t, outcome, raw) for t in trees]
  # gamma = 1: every step value equals outcome + R_fm, so every z-score is 0
  # (format_is_raw=False reads the rubric as R_fm directly: still constant).
  _, out = _run(trees, GAMMA1_SCALED)
  assert not out["node_leaf"].any()
  # gamma < 1: A_trj = 0, but the fork term may still rank siblings
  # through gamma^(T_k - t).
  _, out = _run(trees)
  assert not out["trajectory_term"].any()
  assert out["metrics"]["zero_std_frac"] == 1.0


@st.composite
def chains_tree(draw):
  """Algorithm 1 with f = 1: n independent chains under the root
  (docs/methods/portool.md#trees-without-forks)."""
  t = RolloutTree.new([1, 2])
  for _ in range(draw(st.integers(1, 6))):
    node = 0
    for s in range(draw(st.integers(1, 3))):
      if s:
        node = _env(t, node)
      node = _pol(t, node, draw(st.integers(1, 4)), draw(st.sampled_from(S.FORMAT_RAW)))
    t.add_leaf(node, {"outcome": draw(st.sampled_from(S.OUTCOMES))})
  return t


@settings(SETTINGS, max_examples=S.examples(30))
@given(trees=st.lists(chains_tree(), min_size=4, max_size=4))
def test_f1_only_root_forks(trees):
  """f = 1: the trajectory term everywhere, plus a fork term on first steps
  only: omega2 = n |tau_j| / (1 |s_j1| n 1) = |tau_j| / |s_j1| times the
  z-score of R(s_j1) = gamma^(T_j - 1) R_out_j + R_fm(s_j1) over the n first steps."""
  canon, out = _run(trees)
  _, out_nf = _run(trees, portool.PORToolConfig(root_is_fork=False))
  for b, t in enumerate(canon):
    paths = t.leaf_paths()
    steps = [[i for i in p if t.nodes[i].kind == NodeKind.POLICY] for p in paths]
    r_out = np.array([l.rewards["outcome"] for l in t.leaves])
    a_trj = np.zeros_like(r_out)
    if r_out.std() > 1e-6:
      a_trj = (r_out - r_out.mean()) / (r_out.std() + 1e-6)
    first = [s[0] for s in steps]
    r1 = np.array([0.95 ** (len(s) - 1) * r + 0.25 * (2 * t.nodes[s[0]].rewards["format"] - 1)
                   for s, r in zip(steps, r_out)])
    z = np.zeros_like(r1)
    if r1.std() > 1e-6:
      z = (r1 - r1.mean()) / (r1.std() + 1e-6)
    for k, s in enumerate(steps):
      tau = _policy_tokens(t, paths[k])
      want = np.full(len(s), a_trj[k])
      if len(paths) >= 2:
        want[0] += tau / len(t.nodes[first[k]].tokens) * z[k]
      np.testing.assert_allclose(out["node_leaf"][b, s, k], want, atol=1e-4, rtol=1e-5)
      # Without the root as a fork there is no fork at all: trajectory-only.
      np.testing.assert_allclose(out_nf["node_leaf"][b, s, k], a_trj[k], atol=1e-5)
    assert out["metrics"]["n_forks_mean"] == np.mean([len(t.leaves) >= 2 for t in canon])


def _mirror(tree):
  """The same tree with every node's children in reverse order."""
  kids = tree.children()
  new = RolloutTree.new(tree.nodes[0].tokens)
  new_of = {0: 0}
  stack = [0]
  while stack:
    i = stack.pop()
    for c in reversed(kids[i]):
      node = tree.nodes[c]
      new_of[c] = new.add_node(new_of[i], node.kind, node.tokens, logprobs=node.logprobs,
                               step=node.step, rewards=node.rewards)
    stack.extend(kids[i])  # any order: parents are always added before children
  for leaf in reversed(tree.leaves):
    new.add_leaf(new_of[leaf.node], leaf.rewards, leaf.truncated, leaf.tag)
  return new, new_of


@settings(SETTINGS, max_examples=S.examples(30))
@given(trees=FOUR_PORTOOL)
def test_sibling_permutation_equivariance(trees):
  """Reordering siblings permutes the (node, leaf) table and changes nothing else."""
  canon, out = _run(trees)
  mirrored = [_mirror(t) for t in canon]
  canon_m, out_m = _run([m for m, _ in mirrored])
  for b, (t, (m, new_of)) in enumerate(zip(canon, mirrored)):
    # Original canonical node -> mirror node -> its index after canonical().
    order = _canonical_index(m)
    leaf_new = {l.node: k for k, l in enumerate(canon_m[b].leaves)}
    for k, leaf in enumerate(t.leaves):
      km = leaf_new[order[new_of[leaf.node]]]
      for i in t.path(leaf.node):
        # Equal up to float32 summation order (the group sums see the leaves permuted).
        np.testing.assert_allclose(out_m["node_leaf"][b, order[new_of[i]], km],
                                   out["node_leaf"][b, i, k], atol=1e-5, rtol=2e-5)
  for key in out["metrics"]:
    np.testing.assert_allclose(out_m["metrics"][key], out["metrics"][key], rtol=1e-5)


def _canonical_index(tree):
  """Old node index -> index after tree.canonical() (preorder, children in index order)."""
  kids = tree.children()
  order, stack = [], [0]
  while stack:
    i = stack.pop()
    order.append(i)
    stack.extend(reversed(kids[i]))
  return {old: new for new, old in enumerate(order)}
