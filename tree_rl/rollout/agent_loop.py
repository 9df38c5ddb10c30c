"""The agent loop: grows RolloutTrees from tasks with a RolloutEngine and the task's tools.

Every open episode of every tree advances together: one batched `engine.generate`
per turn over all open contexts (the engine reuses cached prefixes, so a
group's shared prompt is prefilled once). Each sampled step becomes a policy
node holding exactly the sampled tokens, log-probs and entropies; its text is
parsed and its calls run (`tree_rl.envs.episode.advance`, the same step logic
as the evaluation harness); the tool replies and the chat template's glue
become an env node. Episodes end on a final answer or a successful terminal
tool call, or are truncated (flagged, never dropped) at the turn limit or when
the context window is full. The leaf records the family's outcome reward; each
policy node records PORTool's formatting score of its step.

This module grows flat groups (n independent episodes under one prompt root,
GRPO/DAPO). Tree-shaped strategies fork open episodes between turns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

from tree_rl.envs.base import Task
from tree_rl.envs.episode import OpenEpisode, advance
from tree_rl.envs.executor import ToolExecutor
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import NodeKind


@dataclasses.dataclass(frozen=True)
class AgentConfig:
  """Attributes:
    samples_per_task: episodes per prompt (the group size n).
    max_turns: assistant steps per episode; None uses the family's.
    max_context_tokens: an episode whose context reaches this ends truncated.
    sampling: per-step sampling (its max_new_tokens caps one step).
    tool_workers: episodes whose tool calls run at the same time.
  """

  samples_per_task: int = 4
  max_turns: int | None = None
  max_context_tokens: int = 2048
  sampling: SamplingParams = SamplingParams(max_new_tokens=256)
  tool_workers: int = 16

  def __post_init__(self):
    if self.samples_per_task < 1:
      raise ValueError(f"samples_per_task={self.samples_per_task} must be >= 1")
    if self.max_turns is not None and self.max_turns < 1:
      raise ValueError(f"max_turns={self.max_turns} must be >= 1")


@dataclasses.dataclass
class _Branch:
  """One episode in progress: its tree position and its token context."""

  tree: int
  node: int
  tokens: list[int]
  episode: OpenEpisode
  truncated: bool = False


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """Counts of one `rollout` call, for metrics."""

  num_episodes: int
  num_truncated: int
  num_turns: int
  num_policy_tokens: int
  num_env_tokens: int
  num_dropped: int  # episodes that could not sample a single token (context full)


class AgentLoop:
  """Grows one RolloutTree per task.

  Args:
    engine: any RolloutEngine (JaxSampler, the vLLM engine, a mock).
    chat: the tokenizer's chat format.
    family: the task family (tools, turn limit, verifier).
    config: AgentConfig.
  """

  def __init__(self, engine: RolloutEngine, chat: ChatFormat, family: Any,
               config: AgentConfig = AgentConfig()):
    self.engine, self.chat, self.family, self.config = engine, chat, family, config
    self.last_stats: RolloutStats | None = None

  def rollout(self, tasks: Sequence[Task]) -> list[RolloutTree]:
    cfg = self.config
    max_turns = cfg.max_turns or self.family.max_turns
    trees, open_ = [], []
    for t, task in enumerate(tasks):
      prompt = self.chat.prompt_tokens(task.messages)
      trees.append(RolloutTree.new(prompt, meta={"task_id": task.task_id}))
      tools = self.family.tools(task)
      executor = ToolExecutor(tools)
      terminal = frozenset(x.name for x in tools if x.terminal)
      for s in range(cfg.samples_per_task):
        ep = OpenEpisode(task=task, sample_index=s, executor=executor, terminal=terminal,
                         messages=list(task.messages))
        open_.append(_Branch(tree=t, node=0, tokens=list(prompt), episode=ep))
    done: list[_Branch] = []
    turns = policy_tokens = env_tokens = dropped = 0
    with concurrent.futures.ThreadPoolExecutor(cfg.tool_workers) as pool:
      while open_:
        turns += 1
        results = self.engine.generate(
            [GenerationRequest(tuple(b.tokens), cfg.sampling) for b in open_])
        texts, live = [], []
        for b, res in zip(open_, results):
          tree = trees[b.tree]
          if not res.tokens:
            # Nothing sampled (the context is already full): the episode cannot
            # go on and has no step to end on. It is counted in the tree's meta
            # instead of becoming an empty node.
            tree.meta["dropped_episodes"] = tree.meta.get("dropped_episodes", 0) + 1
            dropped += 1
            continue
          live.append(b)
          b.node = tree.add_node(b.node, NodeKind.POLICY, res.tokens, res.logprobs,
                                 res.entropies)
          b.tokens.extend(res.tokens)
          policy_tokens += len(res.tokens)
          b.truncated = res.finish_reason == "context"
          texts.append(self.chat.decode(res.tokens))
        # Parse + run tools for every branch at once (tool calls block on I/O).
        list(pool.map(advance, [b.episode for b in live], [self._content(t) for t in texts]))
        still_open = []
        for b, text in zip(live, texts):
          ep, tree = b.episode, trees[b.tree]
          tree.nodes[b.node].rewards["format"] = ep.steps[-1].formatting_raw
          if ep.finished:
            done.append(b)
            continue
          if b.truncated or len(ep.steps) >= max_turns:
            b.truncated = True
            done.append(b)
            continue
          n_tool = len(ep.steps[-1].results)
          glue = self.chat.glue_tokens(ep.messages[:-1 - n_tool], text, ep.messages[-n_tool:]
                                       if n_tool else [])
          b.node = tree.add_node(b.node, NodeKind.ENV, glue)
          b.tokens.extend(glue)
          env_tokens += len(glue)
          if len(b.tokens) >= cfg.max_context_tokens:
            b.truncated = True
            done.append(b)
          else:
            still_open.append(b)
        open_ = still_open

    for b in done:
      ep = b.episode
      outcome = self.family.score(ep.task, ep.messages, b.truncated)
      trees[b.tree].add_leaf(b.node, {"outcome": outcome.reward}, truncated=b.truncated)
    self.last_stats = RolloutStats(
        num_episodes=len(done), num_truncated=sum(b.truncated for b in done), num_turns=turns,
        num_policy_tokens=policy_tokens, num_env_tokens=env_tokens, num_dropped=dropped)
    return trees

  def _content(self, text: str) -> str:
    """The assistant message content of a sampled step: without its end-of-turn marker."""
    end = self.chat.end_of_turn
    return text[:-len(end)] if end and text.endswith(end) else text
