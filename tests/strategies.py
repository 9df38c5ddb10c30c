"""Hypothesis strategies that build random RolloutTrees.

All trees fit `TEST_BUCKETS`, so every jitted kernel compiles once per test
module. Shapes cover the degenerate cases the estimators must survive: one
leaf, single-child chains, depth-1 trees, all-equal rewards, truncated leaves.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import strategies as st

from tree_rl.tree import Buckets, LeafTag, NodeKind, RolloutTree

# CI (CI=true) draws every property test's full count of examples; elsewhere, as in the
# fast tier (`pytest -m "not e2e"`), an eighth of it, at least 10 (and never more than the
# full count). TREE_RL_FULL_EXAMPLES=1 asks for the full count anywhere.
FULL_EXAMPLES = (os.environ.get("CI", "").lower() == "true"
                 or os.environ.get("TREE_RL_FULL_EXAMPLES") == "1")


def examples(n: int) -> int:
  """The `max_examples` of a property test whose full count is `n` (see FULL_EXAMPLES)."""
  return n if FULL_EXAMPLES else min(n, max(10, n // 8))


TEST_BUCKETS = Buckets(tokens=(256,), nodes=(128,), leaves=(16,), path_tokens=(64,),
                       trees=(4, 8, 16, 32, 64))
VOCAB = 50

OUTCOMES = (-1.0, 0.0, 1.0)
FORMAT_RAW = (0.0, 0.2, 0.3, 0.4, 0.45, 0.725, 1.0)  # PORTool rubric values
REASONING = (0.0, 0.2, 0.6, 1.0)


def _tokens(draw, lo=1, hi=3):
  n = draw(st.integers(lo, hi))
  return [draw(st.integers(1, VOCAB - 1)) for _ in range(n)]


def _policy(draw, tree, parent, lo=1, hi=3, step=None):
  toks = _tokens(draw, lo, hi)
  lps = [-draw(st.floats(0.01, 3.0)) for _ in toks]
  fm = draw(st.sampled_from(FORMAT_RAW))
  return tree.add_node(parent, NodeKind.POLICY, toks, logprobs=lps, step=step,
                       rewards={"format": fm})


def _env(draw, tree, parent, lo=1, hi=2):
  return tree.add_node(parent, NodeKind.ENV, _tokens(draw, lo, hi))


def _leaf_rewards(draw, outcomes):
  return {"outcome": draw(st.sampled_from(outcomes)),
          "format": draw(st.sampled_from(FORMAT_RAW)),
          "reasoning": draw(st.sampled_from(REASONING))}


@st.composite
def general_tree(draw, outcomes=OUTCOMES, max_nodes=40, max_leaves=12):
  """Arbitrary shape: random branching, policy/env alternation, splits."""
  tree = RolloutTree.new(_tokens(draw, 1, 3))
  frontier = [0]
  budget_nodes = draw(st.integers(2, max_nodes))
  while frontier:
    node = frontier.pop(draw(st.integers(0, len(frontier) - 1)))
    kind = tree.nodes[node].kind
    open_ends = len(frontier) + len(tree.leaves)  # leaves this tree will have at least
    if node == 0:
      n_child = draw(st.integers(1, 3))
    elif len(tree.nodes) < budget_nodes and open_ends < max_leaves:
      n_child = min(draw(st.sampled_from((0, 1, 1, 2, 3))), max_leaves - open_ends)
    else:
      n_child = 0
    if n_child == 0:
      tree.add_leaf(node, _leaf_rewards(draw, outcomes), truncated=draw(st.booleans()),
                    tag=draw(st.sampled_from(list(LeafTag))))
      continue
    for _ in range(n_child):
      if kind == NodeKind.POLICY and draw(st.booleans()):
        child = _env(draw, tree, node)
      else:
        child = _policy(draw, tree, node)
      frontier.append(child)
  return tree


@st.composite
def flat_tree(draw, outcomes=OUTCOMES, max_group=8):
  """A depth-1 tree: G independent (possibly multi-turn) rollouts."""
  tree = RolloutTree.new(_tokens(draw, 1, 3))
  for _ in range(draw(st.integers(1, max_group))):
    node = _policy(draw, tree, 0)
    for _ in range(draw(st.integers(0, 2))):
      node = _policy(draw, tree, _env(draw, tree, node))
    tree.add_leaf(node, _leaf_rewards(draw, outcomes), truncated=draw(st.booleans()))
  return tree


@st.composite
def portool_tree(draw, outcomes=OUTCOMES, n_max=8, f_max=3, t_max_max=4):
  """A tree grown by PORTool's Algorithm 1 (arXiv 2510.26020, App. A).

  Step ids are shared by copies; the tree is the trie of the final n
  trajectories (discarded ones leave no trace). A completed step (one that
  called response_gen) has no env node after it; an unfinished step has one.
  """
  n = draw(st.integers(1, n_max))
  f = draw(st.integers(1, f_max))
  t_max = draw(st.integers(1, t_max_max))
  steps = []  # step id -> (completed,)
  def new_step():
    steps.append(draw(st.booleans()) and draw(st.booleans()))  # P(complete) = 1/4
    return len(steps) - 1
  traj = [[new_step()] for _ in range(n)]
  completed = []
  for _t in range(2, t_max + 1):
    still = []
    for tr in traj:
      (completed if steps[tr[-1]] else still).append(tr)
    traj = still
    if len(completed) == n:
      break
    pool = [tr for tr in traj for _ in range(f)]
    pick = draw(st.permutations(range(len(pool))))[: n - len(completed)]
    traj = [list(pool[i]) + [new_step()] for i in sorted(pick)]
  completed.extend(traj)
  assert len(completed) == n

  tree = RolloutTree.new(_tokens(draw, 1, 3))
  after = {}  # tuple(prefix of step ids) -> node to attach the next step under
  after[()] = 0
  for tr in completed:
    for t in range(len(tr)):
      key = tuple(tr[: t + 1])
      if key in after:
        continue
      pol = _policy(draw, tree, after[key[:-1]], 1, 4, step=t + 1)
      last = t == len(tr) - 1
      if steps[tr[t]] and last:
        after[key] = pol
      else:
        after[key] = tree.add_node(pol, NodeKind.ENV, _tokens(draw, 1, 2), step=t + 1)
  for tr in completed:
    finished = steps[tr[-1]]
    outcome = draw(st.sampled_from(outcomes)) if finished else -1.0
    tree.add_leaf(after[tuple(tr)], {"outcome": outcome}, truncated=not finished)
  return tree


@st.composite
def appo_tree(draw, outcomes=(0.0, 1.0), n_init_max=4, branches_max=3):
  """N initial rollouts plus branches resampled at token positions.

  Paper convention (APPO, arXiv 2606.12384, §3.2; docs/methods/appo.md#branch-prefix): a
  branch at position p shares the
  initial rollout's positions < p (p = 0 shares only the prompt).
  """
  tree = RolloutTree.new(_tokens(draw, 1, 2))
  n_init = draw(st.integers(1, n_init_max))
  inits = []
  for _ in range(n_init):
    length = draw(st.integers(2, 10))
    kinds = [NodeKind.POLICY]
    for _ in range(length - 1):
      kinds.append(NodeKind.ENV if draw(st.integers(0, 4)) == 0 else NodeKind.POLICY)
    policy_pos = [p for p, k in enumerate(kinds) if k == NodeKind.POLICY]
    n_br = draw(st.integers(0, branches_max))
    cuts = sorted(draw(st.sampled_from(policy_pos)) for _ in range(n_br))
    inits.append((kinds, cuts))

  leaves = []
  for kinds, cuts in inits:
    boundaries = sorted(set([0] + [c for c in cuts] + [p for p in range(1, len(kinds))
                                                        if kinds[p] != kinds[p - 1]]))
    boundaries.append(len(kinds))
    node_at = {}  # start position -> node created for the segment starting there
    parent = 0
    for a, b in zip(boundaries[:-1], boundaries[1:]):
      if kinds[a] == NodeKind.POLICY:
        node = _policy(draw, tree, parent, b - a, b - a)
      else:
        node = _env(draw, tree, parent, b - a, b - a)
      node_at[a] = parent  # a branch at position a hangs off the node before it
      parent = node
    leaves.append((parent, LeafTag.INIT))
    for c in cuts:
      node = _policy(draw, tree, node_at[c], 1, 3)
      if draw(st.booleans()):
        node = _policy(draw, tree, _env(draw, tree, node), 1, 2)
      leaves.append((node, LeafTag.BRANCH))
  for node, tag in leaves:
    tree.add_leaf(node, {"outcome": draw(st.sampled_from(outcomes))}, tag=tag)
  return tree


def random_token_array(seed: int, shape, lo=-2.0, hi=0.0) -> np.ndarray:
  return np.random.default_rng(seed).uniform(lo, hi, size=shape).astype(np.float32)
