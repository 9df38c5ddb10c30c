"""RolloutTree: the host-side record of one prompt's rollouts.

A node is a maximal run of tokens that the same set of leaves passes through
and that has one kind (prompt, policy or env). Node 0 is the root and holds
the prompt. Every childless node ends exactly one trajectory and carries one
`Leaf` record with its outcome reward channels.

Trees are built incrementally by the agent loop (or by tests) with
`RolloutTree.new(prompt_tokens)`, `add_node` and `add_leaf`, round-trip
through JSON, and are validated by `check()`, which names the offending node
for every malformed input.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tree_rl.tree.types import LeafTag, NodeKind

Real = float | int  # host inputs: ints are accepted wherever a float is


class TreeError(ValueError):
  """A malformed RolloutTree. The message names the node or leaf."""


def _values_ok(nodes: Sequence[Node], vocab_size: int | None) -> bool:
  """Whether every token id is in [0, vocab_size) and every log-prob and entropy is finite
  (one vectorised pass; False also where an array's length is off, left to `check`)."""
  try:
    tokens = np.fromiter(itertools.chain.from_iterable(n.tokens for n in nodes), np.int64)
    values = np.fromiter(itertools.chain.from_iterable(
        a for n in nodes for a in (n.logprobs, n.entropies) if a is not None), np.float64)
  except (TypeError, ValueError, OverflowError):
    return False
  if tokens.size and (tokens.min() < 0 or (vocab_size is not None and tokens.max() >= vocab_size)):
    return False
  return bool(np.isfinite(values).all())


@dataclasses.dataclass
class Node:
  """One node of a rollout tree.

  Attributes:
    parent: index of the parent node, -1 for the root.
    kind: NodeKind of every token in the node.
    tokens: token ids.
    logprobs: behaviour log-probs, one per token (policy nodes only).
    entropies: behaviour entropies, one per token, when the strategy needs
      them (policy nodes only; optional).
    step: tool-call step of the episode the node belongs to (0 = prompt).
    rewards: per-node reward channels, e.g. {"format": 0.725} for PORTool's
      formatting rubric of this step (raw, in [0, 1]).
    version: the policy version whose weights sampled the node (policy nodes from a
      versioned engine; None when unknown). Asynchronous rollouts can grow one tree
      across versions; the trainer's staleness is its version minus this.
  """

  parent: int
  kind: NodeKind
  tokens: list[int]
  logprobs: list[float] | None = None
  entropies: list[float] | None = None
  step: int = 0
  rewards: dict[str, float] = dataclasses.field(default_factory=dict)
  version: int | None = None


@dataclasses.dataclass
class Leaf:
  """The end of one trajectory.

  Attributes:
    node: index of the (childless) node where the trajectory ends.
    rewards: outcome reward channels, e.g. {"outcome": 1.0}.
    truncated: True when the episode hit a turn or token limit instead of
      finishing; such leaves are kept and flagged, never dropped.
    tag: method-specific role (APPO: INIT or BRANCH).
  """

  node: int
  rewards: dict[str, float]
  truncated: bool = False
  tag: LeafTag = LeafTag.INIT


@dataclasses.dataclass
class RolloutTree:
  """All rollouts of one prompt, as a tree of token runs."""

  nodes: list[Node]
  leaves: list[Leaf] = dataclasses.field(default_factory=list)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  # --------------------------------------------------------------------------
  # Builders
  # --------------------------------------------------------------------------

  @classmethod
  def new(
      cls, prompt_tokens: Sequence[int], meta: Mapping[str, Any] | None = None
  ) -> RolloutTree:
    """A tree holding only its root prompt node."""
    root = Node(parent=-1, kind=NodeKind.PROMPT, tokens=list(prompt_tokens))
    return cls(nodes=[root], leaves=[], meta=dict(meta or {}))

  def add_node(
      self,
      parent: int,
      kind: NodeKind | int,
      tokens: Sequence[int],
      logprobs: Sequence[Real] | None = None,
      entropies: Sequence[Real] | None = None,
      step: int | None = None,
      rewards: Mapping[str, Real] | None = None,
      version: int | None = None,
  ) -> int:
    """Appends a node under `parent` and returns its index.

    When `step` is None it is derived: a policy node that follows a non-policy
    node starts a new step (parent's step + 1); anything else keeps the
    parent's step.
    """
    kind = NodeKind(kind)
    if step is None:
      if not 0 <= parent < len(self.nodes):
        raise TreeError(f"add_node: parent {parent} does not exist")
      par = self.nodes[parent]
      new_step = kind == NodeKind.POLICY and par.kind != NodeKind.POLICY
      step = par.step + 1 if new_step else par.step
    self.nodes.append(
        Node(
            parent=parent,
            kind=kind,
            tokens=list(tokens),
            logprobs=None if logprobs is None else [float(x) for x in logprobs],
            entropies=None if entropies is None else [float(x) for x in entropies],
            step=step,
            rewards={k: float(v) for k, v in (rewards or {}).items()},
            version=None if version is None else int(version),
        )
    )
    return len(self.nodes) - 1

  def add_leaf(
      self,
      node: int,
      rewards: Mapping[str, Real],
      truncated: bool = False,
      tag: LeafTag | int = LeafTag.INIT,
  ) -> int:
    """Marks `node` as the end of a trajectory and returns the leaf index."""
    self.leaves.append(Leaf(node=node, rewards={k: float(v) for k, v in rewards.items()},
                            truncated=truncated, tag=LeafTag(tag)))
    return len(self.leaves) - 1

  @classmethod
  def merge_prompts(cls, trees: Sequence[RolloutTree]) -> RolloutTree:
    """One tree holding every trajectory of `trees` below their roots' shared prefix.

    The root keeps the longest common prefix of the root prompts (at most one
    token shorter than the shortest, so every tree keeps a non-empty rest);
    each tree's rest of its prompt becomes an ENV node under it (context, never
    trained) with the tree's nodes and leaves below. Every root-to-leaf token
    sequence is unchanged, so the merged tree packs to the same contexts while
    storing the shared prefix once: SFT batches of tasks with one system prompt
    pay for it once. `meta["merged"]` lists the input trees' meta.

    Raises:
      TreeError: no trees, or the root prompts share no token.
    """
    if not trees:
      raise TreeError("merge_prompts: no trees to merge")
    roots = [t.nodes[0].tokens for t in trees]
    shared = min(len(r) for r in roots) - 1
    for r in roots[1:]:
      shared = next((i for i, (a, b) in enumerate(zip(roots[0][:shared], r[:shared]))
                     if a != b), shared)
    if shared < 1:
      raise TreeError("merge_prompts: the root prompts share no leading token")
    out = cls.new(roots[0][:shared], meta={"merged": [dict(t.meta) for t in trees]})
    for t in trees:
      rest = out.add_node(0, NodeKind.ENV, t.nodes[0].tokens[shared:], step=0)
      index = {0: rest}
      for i, node in enumerate(t.nodes[1:], start=1):
        index[i] = len(out.nodes)
        out.nodes.append(dataclasses.replace(
            node, parent=index[node.parent], tokens=list(node.tokens),
            logprobs=None if node.logprobs is None else list(node.logprobs),
            entropies=None if node.entropies is None else list(node.entropies),
            rewards=dict(node.rewards)))
      out.leaves.extend(dataclasses.replace(lf, node=index[lf.node], rewards=dict(lf.rewards))
                        for lf in t.leaves)
    return out

  # --------------------------------------------------------------------------
  # Editing (used by branching rollouts)
  # --------------------------------------------------------------------------

  def split_node(self, node: int, pos: int) -> int:
    """Cuts `node` at token offset `pos` and returns the index of the new tail node.

    The node keeps tokens[:pos] (and the matching log-probs and entropies);
    a new node of the same kind and step holding tokens[pos:] is inserted
    right after it, at index node + 1, and takes over the node's children,
    its leaf and its per-node rewards (a step's rewards sit on the node that
    ends the step). Inserting there keeps parents before children without
    touching any other node's relative order, at one price: **every index
    >= node + 1 shifts up by one**, in parents and leaves here and in any
    index a caller holds (the rule is: i > node becomes i + 1).

    The result is the same token sequence on every root-to-leaf path, so a
    split tree packs to the same sequences and the same behaviour log-probs.

    Raises:
      TreeError: `node` is the root or does not exist, or pos is not in
        (0, len(tokens)) (an empty prefix or tail would be an empty node).
    """
    if not 0 < node < len(self.nodes):
      raise TreeError(f"split_node: node {node} is the root or does not exist")
    old = self.nodes[node]
    if not 0 < pos < len(old.tokens):
      raise TreeError(
          f"split_node: pos {pos} must be in (0, {len(old.tokens)}) for node {node}")
    cut = lambda a: (None, None) if a is None else (a[:pos], a[pos:])
    (lp_head, lp_tail), (ent_head, ent_tail) = cut(old.logprobs), cut(old.entropies)
    tail = Node(parent=node, kind=old.kind, tokens=old.tokens[pos:], logprobs=lp_tail,
                entropies=ent_tail, step=old.step, rewards=old.rewards, version=old.version)
    old.tokens, old.logprobs, old.entropies, old.rewards = (
        old.tokens[:pos], lp_head, ent_head, {})
    for other in self.nodes:
      if other.parent > node:
        other.parent += 1
      elif other.parent == node:
        other.parent = node + 1  # the node's children now hang below its tail
    self.nodes.insert(node + 1, tail)
    tail.parent = node
    for leaf in self.leaves:
      if leaf.node >= node:
        leaf.node += 1  # a leaf on the node moves to its tail, the others shift
    return node + 1

  def prune(self) -> list[int]:
    """Removes every non-root node with no leaf record at or below it.

    Used for trajectories a strategy discards after sampling them (PORTool's
    DupAndSamp keeps n - n_c of the f (n - n_c) copies). Surviving nodes keep
    their relative order, so parents still precede children.

    Returns:
      old index -> new index, -1 for removed nodes.
    """
    alive = [False] * len(self.nodes)
    alive[0] = True
    for leaf in self.leaves:
      i = leaf.node
      while i != -1 and not alive[i]:
        alive[i] = True
        i = self.nodes[i].parent
    new_index, kept = [], []
    for i, node in enumerate(self.nodes):
      new_index.append(len(kept) if alive[i] else -1)
      if alive[i]:
        kept.append(node)
    for node in kept:
      if node.parent != -1:
        node.parent = new_index[node.parent]
    self.nodes = kept
    for leaf in self.leaves:
      leaf.node = new_index[leaf.node]
    return new_index

  # --------------------------------------------------------------------------
  # Queries
  # --------------------------------------------------------------------------

  def preorder(self) -> list[int]:
    """Node indices in depth-first preorder, children in index order.

    Position c of the result is the index that `canonical()` (and so `pack`)
    gives node `preorder()[c]`.
    """
    kids = self.children()
    order: list[int] = []
    stack = [0]
    while stack:
      n = stack.pop()
      order.append(n)
      stack.extend(reversed(kids[n]))
    return order

  def context(self, node: int) -> list[int]:
    """Every token from the root down to and including `node`."""
    return [t for i in self.path(node) for t in self.nodes[i].tokens]

  def children(self) -> list[list[int]]:
    """Children of every node, in index order."""
    out: list[list[int]] = [[] for _ in self.nodes]
    for i, node in enumerate(self.nodes):
      if 0 <= node.parent < len(self.nodes):
        out[node.parent].append(i)
    return out

  def path(self, node: int) -> list[int]:
    """Node indices from the root down to `node` (inclusive)."""
    out = []
    while node != -1:
      out.append(node)
      node = self.nodes[node].parent
    return out[::-1]

  def leaf_paths(self) -> list[list[int]]:
    """Root-to-leaf node paths, one per leaf record."""
    return [self.path(leaf.node) for leaf in self.leaves]

  def num_tokens(self) -> int:
    return sum(len(n.tokens) for n in self.nodes)

  def max_path_tokens(self) -> int:
    return max(
        (sum(len(self.nodes[i].tokens) for i in p) for p in self.leaf_paths()),
        default=0,
    )

  def canonical(self) -> RolloutTree:
    """A copy with nodes renumbered in depth-first preorder.

    Children are visited in index order; leaves are sorted by node. This is
    the order `pack` lays tokens out in, so parents precede children and
    every node's tokens are contiguous.
    """
    order = self.preorder()
    new_index = {old: new for new, old in enumerate(order)}
    nodes = []
    for old in order:
      node = dataclasses.replace(self.nodes[old])
      node.parent = -1 if node.parent == -1 else new_index[node.parent]
      node.tokens = list(node.tokens)
      node.rewards = dict(node.rewards)
      nodes.append(node)
    leaves = sorted(
        (dataclasses.replace(l, node=new_index[l.node], rewards=dict(l.rewards))
         for l in self.leaves),
        key=lambda l: l.node,
    )
    return RolloutTree(nodes=nodes, leaves=leaves, meta=dict(self.meta))

  # --------------------------------------------------------------------------
  # Validation
  # --------------------------------------------------------------------------

  def check(
      self,
      vocab_size: int | None = None,
      reward_channels: Iterable[str] = ("outcome",),
  ) -> None:
    """Raises TreeError naming the first malformed node or leaf.

    Checks, in order: a single prompt root at index 0; every parent exists
    (orphans); no cycle; parents precede children; no empty node; log-prob
    and entropy arrays match the tokens and are finite; tokens are inside the
    vocabulary; every childless node has exactly one leaf record and every
    leaf record sits on a childless node; every leaf has a finite reward in
    each of `reward_channels`; node rewards are finite.
    """
    n = len(self.nodes)
    if n == 0:
      raise TreeError("tree has no nodes (the root prompt node is missing)")
    root = self.nodes[0]
    if root.parent != -1:
      raise TreeError(f"node 0 (the root) has parent {root.parent}; it must be -1")
    if root.kind != NodeKind.PROMPT:
      raise TreeError(f"node 0 (the root) has kind {NodeKind(root.kind).name}; it must be PROMPT")

    for i, node in enumerate(self.nodes[1:], start=1):
      if node.parent == -1:
        raise TreeError(f"node {i}: orphan, parent -1 but only node 0 may be the root")
      if not 0 <= node.parent < n:
        raise TreeError(f"node {i}: orphan, parent {node.parent} does not exist (tree has {n} nodes)")
      if node.kind == NodeKind.PROMPT:
        raise TreeError(f"node {i}: kind PROMPT is only allowed for the root")
    # Parents that precede their children rule out cycles; only otherwise is each chain
    # walked, to name a cycle before the order error below.
    ordered = all(node.parent < i for i, node in enumerate(self.nodes[1:], start=1))
    for i in range(1, 1 if ordered else n):
      seen = [i]
      j = self.nodes[i].parent
      while j != -1:
        if j in seen:
          cycle = " -> ".join(str(x) for x in seen[seen.index(j):] + [j])
          raise TreeError(f"node {i}: cycle through parents {cycle}")
        seen.append(j)
        j = self.nodes[j].parent
    for i, node in enumerate(self.nodes[1:], start=1):
      if node.parent >= i:
        raise TreeError(
            f"node {i}: child before parent (parent {node.parent} has a larger index)"
        )

    # One vectorised pass over every token value; only a tree that fails it is searched
    # token by token below, for the message naming the first bad one.
    values_ok = _values_ok(self.nodes, vocab_size)
    for i, node in enumerate(self.nodes):
      kind = NodeKind(node.kind).name.lower()
      if not node.tokens:
        raise TreeError(f"node {i}: empty {kind} node (no tokens)")
      if node.kind == NodeKind.POLICY:
        if node.logprobs is None:
          raise TreeError(f"node {i}: policy node without behaviour log-probs")
      for name in ("logprobs", "entropies"):
        arr = getattr(node, name)
        if arr is None:
          continue
        if len(arr) != len(node.tokens):
          raise TreeError(
              f"node {i}: {len(arr)} {name} for {len(node.tokens)} tokens"
          )
        if values_ok:
          continue
        for t, v in enumerate(arr):
          if not math.isfinite(v):
            raise TreeError(f"node {i}: {name}[{t}] is {v} (must be finite)")
      for t, tok in enumerate(() if values_ok else node.tokens):
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
          raise TreeError(
              f"node {i}: token {tok} at offset {t} is outside the vocabulary"
              f" (size {vocab_size})"
          )
      for name, v in node.rewards.items():
        if not math.isfinite(v):
          raise TreeError(f"node {i}: node reward {name!r} is {v} (must be finite)")

    kids = self.children()
    leaf_of: dict[int, int] = {}
    for k, leaf in enumerate(self.leaves):
      if not 0 <= leaf.node < n:
        raise TreeError(f"leaf {k}: node {leaf.node} does not exist")
      if kids[leaf.node]:
        raise TreeError(
            f"leaf {k}: node {leaf.node} has children {kids[leaf.node]}; a leaf"
            " must end its trajectory"
        )
      if leaf.node in leaf_of:
        raise TreeError(
            f"leaf {k}: node {leaf.node} already ends leaf {leaf_of[leaf.node]}"
        )
      leaf_of[leaf.node] = k
    for i in range(n):
      if not kids[i] and i not in leaf_of:
        raise TreeError(f"node {i}: childless node has no leaf record (leaf without reward)")
    for k, leaf in enumerate(self.leaves):
      for name in reward_channels:
        if name not in leaf.rewards:
          raise TreeError(
              f"leaf {k} (node {leaf.node}): leaf without reward {name!r}"
          )
      for name, v in leaf.rewards.items():
        if not math.isfinite(v):
          raise TreeError(f"leaf {k} (node {leaf.node}): reward {name!r} is {v}")

  # --------------------------------------------------------------------------
  # JSON
  # --------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "parent": node.parent,
                "kind": NodeKind(node.kind).name.lower(),
                "tokens": list(node.tokens),
                "logprobs": node.logprobs,
                "entropies": node.entropies,
                "step": node.step,
                "rewards": dict(node.rewards),
                **({} if node.version is None else {"version": node.version}),
            }
            for node in self.nodes
        ],
        "leaves": [
            {
                "node": leaf.node,
                "rewards": dict(leaf.rewards),
                "truncated": leaf.truncated,
                "tag": LeafTag(leaf.tag).name.lower(),
            }
            for leaf in self.leaves
        ],
        "meta": self.meta,
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> RolloutTree:
    try:
      nodes = [
          Node(
              parent=int(x["parent"]),
              kind=NodeKind[str(x["kind"]).upper()],
              tokens=[int(t) for t in x["tokens"]],
              logprobs=x.get("logprobs"),
              entropies=x.get("entropies"),
              step=int(x.get("step", 0)),
              rewards={k: float(v) for k, v in x.get("rewards", {}).items()},
              version=None if x.get("version") is None else int(x["version"]),
          )
          for x in d["nodes"]
      ]
      leaves = [
          Leaf(
              node=int(x["node"]),
              rewards={k: float(v) for k, v in x["rewards"].items()},
              truncated=bool(x.get("truncated", False)),
              tag=LeafTag[str(x.get("tag", "init")).upper()],
          )
          for x in d["leaves"]
      ]
    except KeyError as e:
      raise TreeError(f"malformed tree JSON: missing or unknown {e}") from e
    return cls(nodes=nodes, leaves=leaves, meta=dict(d.get("meta", {})))

  def to_json(self) -> str:
    # allow_nan=False: a NaN must be caught by check(), not written silently.
    return json.dumps(self.to_dict(), allow_nan=False)

  @classmethod
  def from_json(cls, s: str) -> RolloutTree:
    return cls.from_dict(json.loads(s))
