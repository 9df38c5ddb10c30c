"""RolloutTree: builders, JSON round trip, canonical order and check()."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import strategies as S
from tree_rl.tree import LeafTag, NodeKind, RolloutTree, TreeError


def small_tree() -> RolloutTree:
  t = RolloutTree.new([1, 2, 3], meta={"prompt_id": "q0"})
  a = t.add_node(0, NodeKind.POLICY, [4, 5], logprobs=[-0.1, -0.2], entropies=[0.5, 0.7])
  e = t.add_node(a, NodeKind.ENV, [6])
  b = t.add_node(e, NodeKind.POLICY, [7], logprobs=[-0.3], rewards={"format": 0.725})
  c = t.add_node(e, NodeKind.POLICY, [8, 9], logprobs=[-0.3, -0.4])
  d = t.add_node(0, NodeKind.POLICY, [10], logprobs=[-0.5])
  t.add_leaf(b, {"outcome": 1.0})
  t.add_leaf(c, {"outcome": 0.0}, truncated=True, tag=LeafTag.BRANCH)
  t.add_leaf(d, {"outcome": -1.0})
  return t


def test_builders_derive_steps_and_paths():
  t = small_tree()
  assert [n.step for n in t.nodes] == [0, 1, 1, 2, 2, 1]
  assert t.leaf_paths() == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5]]
  assert t.children()[2] == [3, 4]
  assert t.max_path_tokens() == 3 + 2 + 1 + 2
  t.check(vocab_size=11)


def test_json_round_trip():
  t = small_tree()
  back = RolloutTree.from_json(t.to_json())
  assert back == t
  assert json.loads(t.to_json())["nodes"][1]["kind"] == "policy"


@settings(max_examples=S.examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.general_tree())
def test_json_round_trip_random(tree):
  assert RolloutTree.from_json(tree.to_json()) == tree


def test_canonical_is_depth_first_and_keeps_paths():
  t = RolloutTree.new([1])
  a = t.add_node(0, NodeKind.POLICY, [2], logprobs=[-1])
  b = t.add_node(0, NodeKind.POLICY, [3], logprobs=[-1])
  a2 = t.add_node(a, NodeKind.POLICY, [4], logprobs=[-1])  # added after b
  t.add_leaf(b, {"outcome": 0})
  t.add_leaf(a2, {"outcome": 1})
  c = t.canonical()
  assert [n.tokens for n in c.nodes] == [[1], [2], [4], [3]]
  assert [n.parent for n in c.nodes] == [-1, 0, 1, 0]
  assert [(l.node, l.rewards["outcome"]) for l in c.leaves] == [(2, 1.0), (3, 0.0)]
  c.check()


# ----------------------------------------------------------------------------
# check(): every malformed case names the node.
# ----------------------------------------------------------------------------


def _broken(edit):
  t = small_tree()
  edit(t)
  return t


@pytest.mark.parametrize("edit,match", [
    (lambda t: setattr(t.nodes[3], "parent", 4), r"node 3: child before parent"),
    (lambda t: (setattr(t.nodes[1], "parent", 2)), r"node 1: cycle through parents 1 -> 2 -> 1"),
    (lambda t: setattr(t.nodes[5], "parent", 17), r"node 5: orphan, parent 17 does not exist"),
    (lambda t: setattr(t.nodes[5], "parent", -1), r"node 5: orphan"),
    (lambda t: t.leaves.pop(0), r"node 3: childless node has no leaf record"),
    (lambda t: t.leaves[2].rewards.pop("outcome"), r"leaf 2 \(node 5\): leaf without reward"),
    (lambda t: t.leaves[1].rewards.update(outcome=float("nan")),
     r"leaf 1 \(node 4\): reward 'outcome' is nan"),
    (lambda t: t.nodes[3].rewards.update(format=float("inf")), r"node 3: node reward 'format'"),
    (lambda t: t.nodes[4].logprobs.__setitem__(1, float("nan")), r"node 4: logprobs\[1\] is nan"),
    (lambda t: t.nodes[4].tokens.__setitem__(1, 11), r"node 4: token 11 at offset 1 is outside"),
    (lambda t: t.nodes[4].tokens.__setitem__(0, -3), r"node 4: token -3 at offset 0 is outside"),
    (lambda t: (setattr(t.nodes[5], "tokens", []), setattr(t.nodes[5], "logprobs", [])),
     r"node 5: empty policy node"),
    (lambda t: setattr(t.nodes[4], "logprobs", [-1.0]), r"node 4: 1 logprobs for 2 tokens"),
    (lambda t: setattr(t.nodes[4], "logprobs", None), r"node 4: policy node without behaviour"),
    (lambda t: setattr(t.nodes[0], "kind", NodeKind.POLICY), r"node 0 \(the root\)"),
    (lambda t: setattr(t.nodes[2], "kind", NodeKind.PROMPT), r"node 2: kind PROMPT"),
    (lambda t: t.add_leaf(2, {"outcome": 1.0}), r"leaf 3: node 2 has children"),
    (lambda t: t.add_leaf(5, {"outcome": 1.0}), r"leaf 3: node 5 already ends leaf 2"),
])
def test_check_rejects_malformed(edit, match):
  with pytest.raises(TreeError, match=match):
    _broken(edit).check(vocab_size=11)


def test_check_rejects_cycle_with_three_nodes():
  t = small_tree()
  t.nodes[1].parent = 3  # 1 -> 3 -> 2 -> 1
  with pytest.raises(TreeError, match=r"cycle through parents"):
    t.check()


def test_json_refuses_nan_and_names_missing_fields():
  t = small_tree()
  t.leaves[0].rewards["outcome"] = float("nan")
  with pytest.raises(ValueError):
    t.to_json()
  with pytest.raises(TreeError, match="missing or unknown 'nodes'"):
    RolloutTree.from_dict({"leaves": []})
  with pytest.raises(TreeError, match="unknown 'TOOL'"):
    RolloutTree.from_dict({"nodes": [{"parent": -1, "kind": "tool", "tokens": [1]}],
                           "leaves": []})


def _leaf_contexts(t: RolloutTree):
  """Per leaf: (tokens, kinds, behaviour log-probs) along its root-to-leaf path, and rewards."""
  out = []
  for leaf, path in zip(t.leaves, t.leaf_paths()):
    nodes = [t.nodes[i] for i in path]
    out.append((tuple(x for n in nodes for x in n.tokens),
                tuple(n.kind == NodeKind.POLICY for n in nodes for _ in n.tokens),
                tuple(x for n in nodes if n.logprobs for x in n.logprobs),
                tuple(sorted(leaf.rewards.items())), leaf.truncated, leaf.tag))
  return out


@settings(max_examples=S.examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(S.general_tree(max_nodes=12, max_leaves=4), min_size=2, max_size=4),
       st.integers(1, 5))
def test_merge_prompts_keeps_every_trajectory_and_stores_the_prefix_once(trees, shared):
  prefix = [900 + i for i in range(shared)]
  for k, t in enumerate(trees):  # a shared system prompt, then a per-task rest
    t.nodes[0].tokens = prefix + [800 + k] + t.nodes[0].tokens
  merged = RolloutTree.merge_prompts(trees)
  merged.check()
  assert merged.nodes[0].tokens == prefix
  assert _leaf_contexts(merged) == [c for t in trees for c in _leaf_contexts(t)]
  assert merged.num_tokens() == sum(t.num_tokens() for t in trees) - (len(trees) - 1) * shared
  assert merged.meta["merged"] == [t.meta for t in trees]


def test_merge_prompts_keeps_a_rest_and_refuses_unrelated_prompts():
  a, b = small_tree(), small_tree()  # identical prompts: the rest is their last token
  merged = RolloutTree.merge_prompts([a, b])
  assert merged.nodes[0].tokens == [1, 2]
  assert [merged.nodes[i].tokens for i, n in enumerate(merged.nodes) if n.parent == 0] == [[3], [3]]
  c = small_tree()
  c.nodes[0].tokens = [7, 2, 3]
  with pytest.raises(TreeError, match="share no leading token"):
    RolloutTree.merge_prompts([a, c])
  with pytest.raises(TreeError, match="no trees"):
    RolloutTree.merge_prompts([])
