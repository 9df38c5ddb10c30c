"""Branching strategies at one fixed policy: the rollout side of a method's mechanism claim,
counted per prompt (`measure_rollouts`; docs/notebooks.md#mechanisms).

A strategy's claim about its trees (more informative groups per token than flat groups,
more reward spread among siblings at its branch points) is a claim about sampling, and is
measured without training: one policy (a run directory's latest checkpoint), one set of
training prompts, and each strategy's config growing one tree per prompt, `repeats` times
on fresh sampling streams, batched as a training step's rollout is. Every tree is counted by
`tree_stats`, with one definition of a group for every strategy:

  a *group* is a fork, a node with two or more children: the alternatives an estimator
  compares (a flat group's episodes at the prompt, PORTool's and TreeRPO's sibling
  subtrees, APPO's and TreePO's branches at a token); it is *informative* when its
  children's mean leaf outcomes are not all equal, so that it carries an advantage.

A flat group of n episodes is one fork at the prompt, informative exactly when GRPO's group
has reward spread.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import NodeKind

OUTCOME = "outcome"
SPREAD_TOL = 1e-9  # mean outcomes closer than this are equal


def tree_stats(tree: RolloutTree, channel: str = OUTCOME) -> dict[str, Any]:
  """One tree's counts (see the module docstring).

  Returns:
    {"leaves", "outcomes" (per leaf), "informative" (1.0 when the leaves' outcomes are
    not all equal, else 0.0), "forks", "informative_forks", "sibling_spread" (the mean
    over forks of max - min of the children's mean outcome; NaN without a fork),
    "branch_forks", "informative_branch_forks", "branch_spread" (the same over the forks
    below the prompt: branch points, where a flat group has none), "policy_tokens" (the
    tokens the learner trains on)}. A leaf whose outcome is not finite (a bad tree's)
    makes every outcome count NaN.
  """
  kids = tree.children()
  below: list[list[float]] = [[] for _ in tree.nodes]  # each node's leaf outcomes
  for leaf in tree.leaves:
    for i in tree.path(leaf.node):
      below[i].append(float(leaf.rewards[channel]))
  outcomes = [float(leaf.rewards[channel]) for leaf in tree.leaves]
  spreads, inner = [], []  # per fork; whether it is below the prompt (a branch point)
  for node in range(len(tree.nodes)):
    reached = [c for c in kids[node] if below[c]]  # children a leaf hangs under
    if len(reached) >= 2:
      means = [float(np.mean(below[c])) for c in reached]
      spreads.append(max(means) - min(means))
      inner.append(tree.nodes[node].parent != -1)
  policy_tokens = sum(len(n.tokens) for n in tree.nodes if n.kind == NodeKind.POLICY)
  nan = float("nan")
  out = {"leaves": len(outcomes), "outcomes": outcomes, "forks": len(spreads),
         "branch_forks": int(sum(inner)), "policy_tokens": int(policy_tokens)}
  if outcomes and not np.isfinite(outcomes).all():
    return {**out, **dict.fromkeys(("informative", "informative_forks",
                                    "informative_branch_forks", "sibling_spread",
                                    "branch_spread"), nan)}
  branch = [s for s, i in zip(spreads, inner) if i]
  return {**out,
          "informative": float(bool(outcomes) and max(outcomes) - min(outcomes) > SPREAD_TOL),
          "informative_forks": float(sum(s > SPREAD_TOL for s in spreads)),
          "informative_branch_forks": float(sum(s > SPREAD_TOL for s in branch)),
          "sibling_spread": float(np.mean(spreads)) if spreads else nan,
          "branch_spread": float(np.mean(branch)) if branch else nan}


def _as_json(value: Any) -> str:
  """`value` as JSON, so that a tuple equals the list a config.json read back holds."""
  return json.dumps(value, sort_keys=True)


def measure_rollouts(model: str | pathlib.Path, config: Any, *, repeats: int = 1,
                     seed: int = 0) -> dict[str, Any]:
  """Grows `config`'s trees of its RL prompts with the policy of run directory `model`.

  The policy is `model`'s latest checkpoint (`checkpoint.restore_policy`); everything that
  samples comes from `config` (a `configs/*.py` ConfigDict, or a dict): its strategy and
  options, its estimator's config where the strategy shares it (APPO), its rollout's
  sampling and limits, and its prompts, `rollout.rl_tasks` of its train split. The two
  must draw the same train split. A strategy that scores with the
  current policy (APPO) scores with this policy, which also samples: at a fixed policy
  APPO's Omega is 1 and its Branching Score falls back to entropy, as in the first PPO
  mini-batch of every training step (docs/methods/appo.md#first-minibatch-fallback).

  Sampling is the embedded JaxSampler's, in this process. Each repeat reseeds the engine
  with fold_in(key(seed), repeat) and grows every prompt's tree in one batched call, timed.
  Trees are counted on the family's outcome reward (a configured judge is not run).

  Returns:
    {"model", "strategy", "estimator", "task_ids" (the prompts, as train indices), "calls":
    [{"repeat", "seconds", "sampled_tokens" (policy tokens sampled, pruned ones included),
    "prefill_tokens", "trees": [{"task_id", "task_index", **tree_stats}]}]}.

  Raises:
    ValueError: repeats < 1; a config with another engine, several rollout workers or
      DAPO's dynamic sampling (which changes what a step keeps, not how a tree grows); or
      `config`'s train split (task family, options, size, seed) differs from the run's
      (named).
    FileNotFoundError: `model` is not a run directory with a checkpoint.
  """
  import jax  # noqa: PLC0415  (the module's counting helpers need no JAX)

  from tree_rl.checkpoint import restore_policy  # noqa: PLC0415
  from tree_rl.config_types import RunConfig  # noqa: PLC0415
  from tree_rl.envs import make_family  # noqa: PLC0415
  from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop  # noqa: PLC0415
  from tree_rl.rollout.chat import ChatFormat  # noqa: PLC0415
  from tree_rl.rollout.engines import EngineSpec, make_engine  # noqa: PLC0415
  from tree_rl.rollout.strategies import model_scorer  # noqa: PLC0415
  from tree_rl.rollout.strategies.base import RunContext, strategy_for_run  # noqa: PLC0415

  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be >= 1")
  cfg = RunConfig.from_config_dict(config.to_dict() if hasattr(config, "to_dict") else config)
  if cfg.rollout.engine != "jax" or cfg.rollout.num_workers > 1:
    raise ValueError(f"measure_rollouts samples with one embedded JAX sampler; the config sets "
                     f"rollout.engine={cfg.rollout.engine!r}, rollout.num_workers="
                     f"{cfg.rollout.num_workers}")
  if cfg.rollout.dynamic_sampling:
    raise ValueError("measure_rollouts grows each prompt's tree once: drop "
                     "rollout.dynamic_sampling (DAPO's filter redraws whole groups)")
  policy, tokenizer, run = restore_policy(model)
  differ = [f"task.{f}" for f in ("family", "kwargs", "num_train_tasks", "seed")
            if _as_json(getattr(cfg.task, f)) != _as_json(getattr(run.task, f))]
  if differ:
    raise ValueError(f"config's {', '.join(differ)} differ from {model}'s: its train split "
                     f"would not be the tasks the policy was trained on")
  r = cfg.rollout
  family = make_family(cfg.task.family, **cfg.task.kwargs)
  train = family.generate("train", cfg.task.num_train_tasks, cfg.task.seed)
  tasks = r.rl_tasks(train)
  index = {t.task_id: i for i, t in enumerate(train)}
  chat = ChatFormat.from_tokenizer(tokenizer)
  engine = make_engine(EngineSpec.from_run(cfg), policy, tokenizer, chat.eos_ids)
  strategy = strategy_for_run(r, cfg.seed, RunContext(
      cfg.algo.estimator, cfg.estimator_config(), vocab_size=policy.config.vocab_size,
      scorer=lambda: model_scorer(policy)))
  agent = AgentLoop(engine, chat, family, AgentConfig.from_rollout(r), strategy=strategy)
  calls = []
  for repeat in range(repeats):
    engine.reseed(jax.random.fold_in(jax.random.key(seed), repeat))
    started = time.perf_counter()
    trees = agent.rollout(tasks)
    seconds = time.perf_counter() - started
    got = agent.last_stats
    calls.append({
        "repeat": repeat, "seconds": round(seconds, 3),
        "sampled_tokens": int(got.num_sampled_tokens),
        "prefill_tokens": int(got.num_prefill_tokens),
        "trees": [{"task_id": t.meta["task_id"], "task_index": index[t.meta["task_id"]],
                   **tree_stats(t)} for t in trees]})
  return {"model": str(model), "strategy": r.strategy, "estimator": cfg.algo.estimator,
          "task_ids": [index[t.task_id] for t in tasks], "calls": calls}


def per_prompt(result: Mapping[str, Any], metric: str) -> dict[tuple[int, int], float]:
  """{(repeat, task index): the tree's `metric`} of a `measure_rollouts` result; metric
  "informative_forks_per_1k" is informative forks per 1,000 of the tree's policy tokens."""
  out = {}
  for call in result["calls"]:
    for t in call["trees"]:
      if metric == "informative_forks_per_1k":
        value = 1000.0 * t["informative_forks"] / t["policy_tokens"] if t["policy_tokens"] \
            else float("nan")
      else:
        value = float(t[metric])
      out[(int(call["repeat"]), int(t["task_index"]))] = value
  return out
