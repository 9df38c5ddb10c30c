"""The agent loop: grows RolloutTrees from tasks with a RolloutEngine and the task's tools.

Every open episode of every tree advances together: one batched `engine.generate`
per turn over all open contexts (the engine reuses cached prefixes, so a
group's shared prompt, or a fork's shared prefix, is prefilled once). Each
sampled step becomes a policy node holding exactly the sampled tokens,
log-probs and entropies; its text is parsed and its calls run
(`tree_rl.envs.episode.advance`, the same step logic as the evaluation
harness); the tool replies and the chat template's glue become an env node.
Episodes end on a final answer or a successful terminal tool call, or are
truncated (flagged, never dropped) at the turn limit, when a step is cut by the
per-step token limit, or when the context window is full. The leaf records the
family's outcome reward (and the channels of an optional `leaf_rewards`
scorer, e.g. AWPO's judge score); each policy node records PORTool's
formatting score of its step. The turn mechanics and the forks live in
`tree_rl.rollout.branching`.

How the trees grow is the branching strategy's choice
(`tree_rl.rollout.strategies`): flat groups (GRPO/DAPO, the default: n =
`samples_per_task` independent episodes per prompt), PORTool's fork-factor
trees, APPO's and TreePO's token-position branches, ARPO's entropy-triggered
branches and TRACE's predicted root and prefix allocation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from tree_rl.envs.base import Task
from tree_rl.rollout.branching import Forest, LeafRewards
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout.engine import RolloutEngine, SamplingParams
from tree_rl.rollout.strategies import BranchingStrategy, FlatStrategy
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

  @classmethod
  def from_rollout(cls, rollout: Any) -> AgentConfig:
    """A run's agent loop from `config.rollout` (a RolloutSpec): its group size, turn cap (0:
    the family's), context and sampling."""
    return cls(samples_per_task=rollout.samples_per_task, max_turns=rollout.max_turns or None,
               max_context_tokens=rollout.max_context_tokens,
               sampling=SamplingParams.from_rollout(rollout))

  def __post_init__(self):
    if self.samples_per_task < 1:
      raise ValueError(f"samples_per_task={self.samples_per_task} must be >= 1")
    if self.max_turns is not None and self.max_turns < 1:
      raise ValueError(f"max_turns={self.max_turns} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RolloutStats:
  """Counts of one `rollout` call, for metrics."""

  num_episodes: int  # leaves
  num_truncated: int
  num_turns: int  # batched generate calls
  num_policy_tokens: int  # in the returned trees
  num_env_tokens: int  # sampled glue (pruned trajectories included)
  num_dropped: int  # episodes that could not sample a single token where no leaf could go
  num_branches: int = 0  # episodes started as forks (BRANCH)
  num_discarded: int = 0  # trajectories a strategy dropped (PORTool's DupAndSamp)
  num_length_cut_steps: int = 0  # steps cut by the per-step token limit
  num_requests: int = 0
  num_prefill_tokens: int = 0  # context tokens the engine ran (shared prefixes count once)
  num_sampled_tokens: int = 0  # policy tokens sampled, pruned trajectories included
  skipped_tasks: tuple[str, ...] = ()  # tasks the strategy gave no rollout (TRACE m_i = 0)


class AgentLoop:
  """Grows one RolloutTree per task.

  Args:
    engine: any RolloutEngine (JaxSampler, the vLLM engine, a mock).
    chat: the tokenizer's chat format.
    family: the task family (tools, turn limit, verifier).
    config: AgentConfig.
    strategy: how the trees grow; None is a flat group of `config.samples_per_task`.
    leaf_rewards: extra leaf reward channels of each ended episode, (task, messages,
      truncated) -> {channel: value} (AWPO's `ReasoningScorer`); None: the outcome only.
  """

  def __init__(self, engine: RolloutEngine, chat: ChatFormat, family: Any,
               config: AgentConfig = AgentConfig(), strategy: BranchingStrategy | None = None,
               leaf_rewards: LeafRewards | None = None):
    self.engine, self.chat, self.family, self.config = engine, chat, family, config
    self.strategy = strategy or FlatStrategy(n=config.samples_per_task)
    self.leaf_rewards = leaf_rewards
    self.last_stats: RolloutStats | None = None

  def rollout(self, tasks: Sequence[Task]) -> list[RolloutTree]:
    """The trees of `tasks`, in task order (one per task the strategy did not skip).

    Each tree's meta holds "task_id" (and the strategy's diagnostics);
    `last_stats` gets this call's counts.
    """
    with self.open_forest(tasks) as forest:
      self.strategy.grow(forest)
      return self.close_forest(forest)

  @contextlib.contextmanager
  def open_forest(self, tasks: Sequence[Task]) -> Iterator[Forest]:
    """An empty Forest over `tasks`, with the thread pool its tool calls run on, for a
    caller that grows the trees in phases (APPO's per-mini-batch branching:
    `strategy.initial`, then `strategy.branch` and `forest.take` per mini-batch);
    end with `close_forest`."""
    cfg = self.config
    with concurrent.futures.ThreadPoolExecutor(cfg.tool_workers) as pool:
      yield Forest(self.engine, self.chat, self.family, tasks, pool, sampling=cfg.sampling,
                   max_turns=cfg.max_turns or self.family.max_turns,
                   max_context_tokens=cfg.max_context_tokens, leaf_rewards=self.leaf_rewards)

  def close_forest(self, forest: Forest) -> list[RolloutTree]:
    """`forest.finish()`'s trees, tagged with the strategy; sets `last_stats`."""
    trees, skipped = forest.finish()
    for tree in trees:
      tree.meta["strategy"] = self.strategy.name
    c = forest.counts
    self.last_stats = RolloutStats(
        num_episodes=c["episodes"], num_truncated=c["truncated"], num_turns=c["turns"],
        num_policy_tokens=sum(len(n.tokens) for t in trees for n in t.nodes
                              if n.kind == NodeKind.POLICY),
        num_env_tokens=c["env_tokens"], num_dropped=c["dropped"], num_branches=c["branches"],
        num_discarded=c["discarded"], num_length_cut_steps=c["length_cut_steps"],
        num_requests=c["requests"], num_prefill_tokens=c["prefill_tokens"],
        num_sampled_tokens=c["policy_tokens"],
        skipped_tasks=tuple(skipped))
    return trees
