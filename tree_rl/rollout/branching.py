"""Tree rollouts: open episodes ("branches"), forks between turns and forks at token positions.

A `Forest` holds one RolloutTree per task and every episode still growing it.
A branching strategy (`tree_rl.rollout.strategies`) drives it with four moves:

  start(t, k)             k fresh episodes at tree t's prompt.
  step(branches)          one turn of every given branch, all trees in ONE batched
                          `engine.generate`: the sampled step becomes a policy node
                          holding exactly the sampled tokens, log-probs and
                          entropies; its text is parsed and its calls run
                          (`envs.episode.advance`, the evaluation harness's step
                          logic); tool replies plus chat glue become an env node.
  fork(branch, k)         node-boundary fork between turns (PORTool's DupAndSamp):
                          k copies that share the branch's last node, so their
                          next policy nodes become siblings.
  branch_at(t, node, p)   token-position fork (APPO, random/TreePO): a new episode
                          that keeps tokens [0, p) of policy node `node` and
                          resamples from p. The node is split at p
                          (`RolloutTree.split_node`) so the prefix is one shared
                          node; the branch's context is everything up to p, and
                          its current step is prefix + new continuation: the step
                          text is parsed and scored on the combined text, while
                          the new node holds only what was sampled. p = 0 needs
                          no split: the new step is a sibling of the node (how
                          ARPO and TRACE restart a step after a tool reply).

Every move only sends *contexts* to the engine. Engines reuse the longest cached
prefix (the JAX sampler's row cache, vLLM's prefix cache), so k copies of one
context, or a branch whose context is a prefix of a rollout just sampled, cost
(almost) no prefill.

Endings. An episode ends on a final answer or a successful terminal call, or is
truncated (flagged, never dropped) at the turn limit, when its context reaches
`max_context_tokens` (a step whose tool replies and glue would reach it ends on its
policy node without them, so no path is longer than the window), or when a step
is cut by the per-step token limit (finish "length", e.g. a stop string that never
came): a cut step is incomplete, so its answer is not trusted. Every tool reply is
cut to the family's `max_tool_output_tokens` (`envs.base.ToolOutputCap`, the same
cap as the evaluation harness's). When the engine cannot sample a single token
(the prompt alone fills the context), the episode ends truncated on the node it
stands on if that node is otherwise childless (a too-long prompt gives a root
leaf, so no tree is lost); else it is counted in `tree.meta["dropped_episodes"]`.
The leaf records the family's outcome reward, any channels of the optional
`leaf_rewards` scorer (AWPO's judge score under "reasoning"; the episodes that
end in one turn are scored concurrently on the tool pool, since a judge is a
network call) and its tag (INIT for the initial rollouts, BRANCH for forks);
each step's last policy node records PORTool's formatting score of the step in
`rewards["format"]`.

Sampling identity. Every request carries a seed (`GenerationRequest.seed`) from
(task id, the task's occurrence among the Forest's tasks with that id, the
branch's creation index within its tree, the branch's turn), so with a
seed-aware engine (the JAX sampler, vLLM) a tree's tokens depend on the engine's
reseed key and on that tree's own history only: not on which other tasks share
the Forest, their order, or how a step's tasks are split across engines. This
holds as far as the strategy's own choices are per tree (flat, APPO with L = 1);
strategies that draw from one generator across all trees (PORTool's DupAndSamp,
ARPO's branch coin, random branching, APPO's L > 1 sources) or allocate a budget
across the tasks (TRACE) still couple the trees of one call.

Tool state is shared: every episode of a task calls the same `ToolExecutor` (as
in the flat loop), so forks of stateful tools see one world. Replaying a
prefix's calls is never needed for the stateless families here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tree_rl.envs.base import Message, Task, ToolOutputCap, family_max_tool_output_tokens
from tree_rl.envs.episode import OpenEpisode, StepRecord, advance
from tree_rl.envs.executor import ToolExecutor
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import (GenerationRequest, RolloutEngine, SamplingParams,
                                    request_seed)
from tree_rl.tree.rollout_tree import RolloutTree, TreeError
from tree_rl.tree.types import LeafTag, NodeKind

# Extra leaf reward channels of an ended episode: (task, messages, truncated) -> channels.
LeafRewards = Callable[[Task, Sequence[Message], bool], Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class _EpisodeState:
  """An episode's messages and steps before one of its steps: what a fork restarts from."""

  messages: tuple[Message, ...]
  steps: tuple[StepRecord, ...]


@dataclasses.dataclass(eq=False)
class Branch:
  """One open (or just ended) episode: its place in a tree and its token context.

  Attributes:
    tree: index of its tree (= its task) in the Forest.
    node: the last node of its context; its next policy node hangs below it.
    tokens: the full context, prompt included (what the engine is sent).
    episode: messages and step records so far.
    tag: the leaf tag it ends with (INIT initial rollout, BRANCH fork).
    prefix: policy tokens of the current step sampled before a token-position
      fork; the next sampled step is parsed as prefix + continuation.
    truncated: ended by a limit rather than an answer.
    last_policy: policy node of its latest step (-1 before the first).
    leaf: its leaf record once ended, else -1.
    data: scratch space of the strategy that grows it (e.g. ARPO's H_init).
    ident: (task id, task occurrence, creation index within the tree): with
      `turns`, the identity its requests are seeded from.
    turns: requests it has sent so far.
  """

  tree: int
  node: int
  tokens: list[int]
  episode: OpenEpisode
  tag: LeafTag = LeafTag.INIT
  prefix: list[int] = dataclasses.field(default_factory=list)
  truncated: bool = False
  last_policy: int = -1
  leaf: int = -1
  data: dict[str, Any] = dataclasses.field(default_factory=dict)
  ident: tuple[str, int, int] = ("", 0, 0)
  turns: int = 0

  def request_seed(self) -> int:
    """The seed of its next request: a function of (ident, turns) only."""
    return request_seed(*self.ident, self.turns)


class Forest:
  """The trees of one `AgentLoop.rollout` call and the branches growing them.

  Args:
    engine: any RolloutEngine.
    chat: the tokenizer's chat format.
    family: the task family (tools, verifier).
    tasks: one tree per task, in order.
    pool: runs the tool calls of a turn's steps concurrently.
    sampling: per-step sampling parameters.
    max_turns: assistant steps per episode (a strategy may reset it: PORTool sets its T_max).
    max_context_tokens: an episode whose context reaches this ends truncated.
    leaf_rewards: extra leaf channels of each ended episode (None: the outcome only).
  """

  def __init__(self, engine: RolloutEngine, chat: ChatFormat, family: Any, tasks: Sequence[Task],
               pool: concurrent.futures.Executor, *, sampling: SamplingParams, max_turns: int,
               max_context_tokens: int, leaf_rewards: LeafRewards | None = None):
    self.engine, self.chat, self.family, self.pool = engine, chat, family, pool
    self.leaf_rewards = leaf_rewards
    self.tasks = list(tasks)
    self.sampling, self.max_turns, self.max_context_tokens = sampling, max_turns, max_context_tokens
    self.trees: list[RolloutTree] = []
    # Per tree, aligned with its nodes: the episode state before the step a
    # policy node belongs to (None for prompt and env nodes).
    self._before: list[list[_EpisodeState | None]] = []
    self._executors: list[ToolExecutor] = []
    self._terminal: list[frozenset[str]] = []
    self._live: list[Branch] = []
    self._samples = collections.Counter()
    self.counts = collections.Counter()  # rollout statistics, see AgentLoop.RolloutStats
    # (task id, how many earlier tasks have that id): the tree's sampling identity.
    seen: collections.Counter = collections.Counter()
    # Tool replies are cut as in the evaluation harness (`run_episodes` given this tokenizer).
    cap = ToolOutputCap(family_max_tool_output_tokens(family), chat.encode)
    self._task_ident: list[tuple[str, int]] = []
    for task in self.tasks:
      self._task_ident.append((str(task.task_id), seen[str(task.task_id)]))
      seen[str(task.task_id)] += 1
      self.trees.append(RolloutTree.new(chat.prompt_tokens(task.messages),
                                        meta={"task_id": task.task_id}))
      self._before.append([None])
      tools = family.tools(task)
      self._executors.append(ToolExecutor(tools, output_cap=cap))
      self._terminal.append(frozenset(x.name for x in tools if x.terminal))

  # --------------------------------------------------------------------------
  # Creating branches
  # --------------------------------------------------------------------------

  def _new(self, t: int, node: int, tokens: list[int], state: _EpisodeState, tag: LeafTag,
           prefix: list[int], data: dict[str, Any] | None) -> Branch:
    ep = OpenEpisode(task=self.tasks[t], sample_index=self._samples[t],
                     executor=self._executors[t], terminal=self._terminal[t],
                     messages=list(state.messages), steps=list(state.steps))
    b = Branch(tree=t, node=node, tokens=tokens, episode=ep, tag=LeafTag(tag), prefix=prefix,
               data=dict(data or {}), ident=(*self._task_ident[t], self._samples[t]))
    self._samples[t] += 1
    self._live.append(b)
    if b.tag == LeafTag.BRANCH:
      self.counts["branches"] += 1
    return b

  def start(self, t: int, k: int = 1, tag: LeafTag = LeafTag.INIT) -> list[Branch]:
    """k fresh episodes at the prompt of tree t."""
    root = self.trees[t].nodes[0].tokens
    state = _EpisodeState(tuple(self.tasks[t].messages), ())
    return [self._new(t, 0, list(root), state, tag, [], None) for _ in range(k)]

  def fork(self, branch: Branch, copies: int, tag: LeafTag = LeafTag.BRANCH) -> list[Branch]:
    """`copies` new branches sharing `branch`'s last node (a node-boundary fork).

    Each copy continues the same context and episode state; their next steps
    become siblings of `branch`'s next step. Returns the copies only.
    """
    if branch not in self._live:
      raise ValueError("fork: the branch has ended or was discarded")
    ep = branch.episode
    state = _EpisodeState(tuple(ep.messages), tuple(ep.steps))
    return [self._new(branch.tree, branch.node, list(branch.tokens), state, tag,
                      list(branch.prefix), branch.data) for _ in range(copies)]

  def branch_at(self, t: int, node: int, pos: int, tag: LeafTag = LeafTag.BRANCH,
                data: dict[str, Any] | None = None) -> Branch:
    """A new episode that keeps tokens [0, pos) of policy node `node` and resamples from pos.

    pos > 0 splits the node (indices > node shift by one, see
    `RolloutTree.split_node`; open branches are remapped here). The branch's
    context is the path up to the cut, its episode state the one before the
    node's step, and its pending `prefix` the step's policy tokens above the cut.
    """
    tree = self.trees[t]
    if not 0 < node < len(tree.nodes) or tree.nodes[node].kind != NodeKind.POLICY:
      raise TreeError(f"branch_at: node {node} of tree {t} is not a policy node")
    if not 0 <= pos < len(tree.nodes[node].tokens):
      raise TreeError(f"branch_at: pos {pos} outside node {node} "
                      f"({len(tree.nodes[node].tokens)} tokens)")
    state = self._before[t][node]
    if pos > 0:
      self._split(t, node, pos)
      attach = node
    else:
      attach = tree.nodes[node].parent
    prefix: list[int] = []
    i = attach
    while tree.nodes[i].kind == NodeKind.POLICY:  # one step's policy nodes are a chain
      prefix = tree.nodes[i].tokens + prefix
      i = tree.nodes[i].parent
    return self._new(t, attach, tree.context(attach), state, tag, prefix, data)

  def branch_at_offset(self, t: int, leaf: int, offset: int, tag: LeafTag = LeafTag.BRANCH,
                       data: dict[str, Any] | None = None) -> Branch:
    """`branch_at` the token at `offset` of leaf `leaf`'s root-to-leaf sequence.

    Offsets do not move when nodes are split, so strategies pick points on a
    rollout first and branch at all of them afterwards.
    """
    for node, start in self.path_layout(t, leaf):
      n = len(self.trees[t].nodes[node].tokens)
      if start <= offset < start + n:
        return self.branch_at(t, node, offset - start, tag, data)
    raise TreeError(f"branch_at_offset: offset {offset} is past the end of leaf {leaf}")

  def _split(self, t: int, node: int, pos: int) -> None:
    self.trees[t].split_node(node, pos)
    self._before[t].insert(node + 1, self._before[t][node])
    for b in self._live:
      # A branch standing on the node holds its whole context, so it moves to the tail.
      if b.tree == t and b.node >= node:
        b.node += 1
      if b.tree == t and b.last_policy >= node:
        b.last_policy += 1

  def discard(self, branch: Branch) -> None:
    """Drops an open branch; nodes no leaf passes through are pruned by `finish`."""
    self._live.remove(branch)
    self.counts["discarded"] += 1

  # --------------------------------------------------------------------------
  # Growing
  # --------------------------------------------------------------------------

  def step(self, branches: Sequence[Branch]) -> tuple[list[Branch], list[Branch]]:
    """One turn of every branch: one batched generate, then parse, tools and glue.

    Returns:
      (still open, ended this turn); ended branches already carry their leaf
      (except dropped ones, which are in neither list).
    """
    for b in branches:
      if b not in self._live:
        raise ValueError("step: a branch has ended or was discarded")
    send = [b for b in branches if len(b.tokens) < self.max_context_tokens]
    requests = [GenerationRequest(tuple(b.tokens), self.sampling, b.request_seed(),
                                  task_id=b.ident[0]) for b in send]
    for b in send:
      b.turns += 1
    results = self.engine.generate(requests) if send else []
    by_branch = {id(b): r for b, r in zip(send, results)}
    self.counts["turns"] += 1
    self.counts["requests"] += len(send)
    live, texts, cut, empty = [], [], [], []
    for b in branches:
      res = by_branch.get(id(b))
      if res is None or not res.tokens:
        b.last_policy = -1
        empty.append(b)
        continue
      tree, ep = self.trees[b.tree], b.episode
      node = tree.add_node(b.node, NodeKind.POLICY, res.tokens, res.logprobs, res.entropies,
                           version=res.policy_version)
      self._before[b.tree].append(_EpisodeState(tuple(ep.messages), tuple(ep.steps)))
      b.node = b.last_policy = node
      b.tokens.extend(res.tokens)
      b.truncated = res.finish_reason == "context"
      self.counts["policy_tokens"] += len(res.tokens)
      self.counts["prefill_tokens"] += res.prefill_tokens
      texts.append(self.chat.decode(b.prefix + list(res.tokens)))
      b.prefix = []
      cut.append(res.finish_reason == "length")
      live.append(b)
    # Parse + run tools for every branch at once (tool calls block on I/O).
    list(self.pool.map(advance, [b.episode for b in live], [self.chat.content(x) for x in texts]))
    still_open, ended = [], []
    for b, text, was_cut in zip(live, texts, cut):
      ep, tree = b.episode, self.trees[b.tree]
      tree.nodes[b.node].rewards["format"] = ep.steps[-1].formatting_raw
      if was_cut:
        self.counts["length_cut_steps"] += 1
      if b.truncated or was_cut or (not ep.finished and len(ep.steps) >= self.max_turns):
        b.truncated = True
      if b.truncated or ep.finished:
        ended.append(b)
        continue
      n_tool = len(ep.steps[-1].results)
      glue = self.chat.glue_tokens(ep.messages[:-1 - n_tool], text,
                                   ep.messages[-n_tool:] if n_tool else [])
      if len(b.tokens) + len(glue) >= self.max_context_tokens:
        # No room for the replies and a next step: the episode ends on its policy node, so
        # no path ever runs past the window (an env node there would be trained on nothing).
        b.truncated = True
        ended.append(b)
        continue
      b.node = tree.add_node(b.node, NodeKind.ENV, glue)
      self._before[b.tree].append(None)
      b.tokens.extend(glue)
      self.counts["env_tokens"] += len(glue)
      still_open.append(b)
    for b, extra in zip(ended, list(self.pool.map(self._extra_rewards, ended))):
      self._end(b, extra)
    for b in empty:
      if self._end_empty(b):
        ended.append(b)
    return still_open, ended

  def run(self, branches: Sequence[Branch]) -> list[Branch]:
    """Steps `branches` until every one has ended; returns the ended ones."""
    out, open_ = [], list(branches)
    while open_:
      open_, ended = self.step(open_)
      out.extend(ended)
    return out

  def _extra_rewards(self, b: Branch) -> Mapping[str, float]:
    ep = b.episode
    return self.leaf_rewards(ep.task, ep.messages, b.truncated) if self.leaf_rewards else {}

  def _end(self, b: Branch, extra: Mapping[str, float] | None = None) -> None:
    ep = b.episode
    outcome = self.family.score(ep.task, ep.messages, b.truncated)
    extra = self._extra_rewards(b) if extra is None else extra
    b.leaf = self.trees[b.tree].add_leaf(b.node, {"outcome": outcome.reward, **extra},
                                         truncated=b.truncated, tag=b.tag)
    self._live.remove(b)
    self.counts["episodes"] += 1
    self.counts["truncated"] += int(b.truncated)

  def _end_empty(self, b: Branch) -> bool:
    """A branch that could not sample a token: a truncated leaf where it stands, or dropped."""
    self._live.remove(b)
    tree = self.trees[b.tree]
    taken = (any(n.parent == b.node for n in tree.nodes)
             or any(leaf.node == b.node for leaf in tree.leaves)
             or any(o.tree == b.tree and o.node == b.node for o in self._live))
    if taken:
      tree.meta["dropped_episodes"] = tree.meta.get("dropped_episodes", 0) + 1
      self.counts["dropped"] += 1
      return False
    self._live.append(b)  # _end removes it again
    b.truncated = True
    self._end(b)
    if b.node == 0:
      tree.meta["prompt_too_long"] = True
    return True

  # --------------------------------------------------------------------------
  # Queries and the end
  # --------------------------------------------------------------------------

  @property
  def live(self) -> list[Branch]:
    """Branches not yet ended or discarded."""
    return list(self._live)

  def path_layout(self, t: int, leaf: int) -> list[tuple[int, int]]:
    """(node, offset of its first token) along leaf `leaf`'s root-to-leaf sequence."""
    tree = self.trees[t]
    out, start = [], 0
    for node in tree.path(tree.leaves[leaf].node):
      out.append((node, start))
      start += len(tree.nodes[node].tokens)
    return out

  def policy_offsets(self, t: int, leaf: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Offsets of the policy tokens on leaf `leaf`'s sequence whose id is not in `exclude`."""
    tree, out = self.trees[t], []
    for node, start in self.path_layout(t, leaf):
      n = tree.nodes[node]
      if n.kind == NodeKind.POLICY:
        out.extend(start + i for i, tok in enumerate(n.tokens) if tok not in exclude)
    return out

  def take(self, trees: Sequence[int]) -> list[RolloutTree]:
    """Prunes the trees `trees` (indices) and returns those with leaves; they must take
    no further branches (APPO's trainer takes each mini-batch's trees this way)."""
    ids = set(int(t) for t in trees)
    if any(b.tree in ids for b in self._live):
      raise RuntimeError(f"take: trees {sorted(ids)} still have open branches")
    out = []
    for t in sorted(ids):
      tree = self.trees[t]
      removed = sum(i < 0 for i in tree.prune())
      if removed:
        tree.meta["pruned_nodes"] = tree.meta.get("pruned_nodes", 0) + removed
      if tree.leaves:
        out.append(tree)
    return out

  def finish(self) -> tuple[list[RolloutTree], list[str]]:
    """Prunes discarded trajectories and returns (trees with leaves, task ids without).

    A task without a leaf is one the strategy chose not to roll out (TRACE's
    m_i = 0); every other tree passes `check()`.
    """
    if self._live:
      raise RuntimeError(f"finish: {len(self._live)} branches are still open; a strategy must "
                         "run or discard every branch it starts")
    trees = self.take(range(len(self.trees)))
    skipped = [t.meta["task_id"] for t in self.trees if not t.leaves]
    return trees, skipped
