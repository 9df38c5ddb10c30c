"""One RL step: its trees (`StepProducer`), then packed and updated in PPO mini-batches
(`rl_step`), each update compiled about once per packed shape (`ShapeFitter`).

A step's update takes one of two forms (`Learner.num_parts`):
- one call over the step's batch, with PPO's epochs and mini-batches inside the jitted
  update (`ppo.make_update_step`);
- one call per mini-batch, in tree order, each mini-batch packed on its own, so no tree is
  padded to the step's longest. This is how an estimator whose advantages are per
  mini-batch (APPO) trains with one epoch: the same updates as one call over the padded
  batch in that order (tests/algos/ppo_test.py).

With APPO's per-mini-batch branching (arXiv 2606.12384, §3.2 and App. I, Algorithm 1;
docs/methods/appo.md#branch-timing) the strategy grows the step in two phases: N initial
rollouts of every prompt under the step's starting policy, then, per mini-batch k, the
branches of its prompts under the policy after update k - 1, which the rollout is synced to
first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tree_rl import metrics as metrics_lib
from tree_rl.algos import ppo
from tree_rl.algos.trace import effective_ratio
from tree_rl.checkpoint import method_state
from tree_rl.models import Decoder
from tree_rl.models.attention import OVERFLOW_METRIC, AttentionFitter, raise_on_overflow
from tree_rl.rollout import dynamic_sampling
from tree_rl.rollout.pipeline import Produced
from tree_rl.tree.batch import Buckets, Packed

# Packed row lengths: multiples of 256 up to 8k tokens, then powers of two. A new
# length costs one compile of the update step (seconds on a CPU); padding a
# 2.1k-token tree to 4k would double its step. 256 also divides every row into
# whole vocabulary-projection chunks (LOGPROB_CHUNK) and attention blocks.
TOKEN_BUCKETS = tuple(range(256, 8192 + 1, 256)) + (16384, 32768, 65536)
LOGPROB_CHUNK = 256

# Node counts from 32: an APPO tree of the main job has 10-30 nodes, and a node bucket that
# flips between 16 and 32 at one token length costs a compile where the padding costs
# nothing measurable (node arrays are a few hundred numbers).
NODE_BUCKETS = (32, 64, 128, 256, 512, 1024)


def buckets(trees: int) -> Buckets:
  """The trainer's packing buckets for batches of `trees` trees."""
  return Buckets(tokens=TOKEN_BUCKETS, nodes=NODE_BUCKETS, trees=(trees,))


class ShapeFitter:
  """Fits a training step's static shapes to its batch, so that a run compiles each step
  about once per packed shape [B, L]:
  - the TrainState goes on the graph fitted to the batch's blockwise bound
    (`tree_rl.models.attention.AttentionFitter`: one graph, so one compile, per bound,
    and a shape's bound only grows);
  - the batch's static widths (`max_path_len`, `max_loss_tokens`) are raised to the
    largest seen at its shape.
  Neither changes a value: wider bounds and widths only add padding, and the step's
  outputs are bitwise those of the tight ones (tests/algos/ppo_test.py). An unbounded
  model (dense, Pallas on a GPU) keeps its graph."""

  def __init__(self, model: Decoder):
    self.fit = AttentionFitter(model)
    self.widths: dict[tuple[int, ...], tuple[int, int]] = {}

  def widen(self, batch):
    """`batch` with the largest static widths seen at its shape (and those recorded)."""
    shape = tuple(batch.tokens.shape)
    path, loss = self.widths.get(shape, (0, 0))
    path, loss = max(path, batch.max_path_len), max(loss, batch.max_loss_tokens)
    self.widths[shape] = (path, loss)
    if (path, loss) == (batch.max_path_len, batch.max_loss_tokens):
      return batch
    return batch.replace(max_path_len=path, max_loss_tokens=loss)

  def __call__(self, state: ppo.TrainState, batch, kv_blocks: int = 0) -> ppo.TrainState:
    """`state` on the graph fitted to `batch`'s bound (`kv_blocks`), or as is when unbounded."""
    if not self.fit.base.bounded:
      return state
    return state.replace(graphdef=self.fit.graphdef(batch, kv_blocks))

  @property
  def block(self) -> int | None:
    """The attention block `pack_sound` computes the bound at (None: an unbounded model)."""
    return self.fit.base.block if self.fit.base.bounded else None

  def wrap(self, step: Callable) -> Callable:
    """`step(state, batch, *args) -> (state, metrics)` as `run(state, packed, *args)` on a
    `tree.batch.Packed`: run on the graph fitted to the packed bound, with the batch's
    widths widened, its metrics read back to the host, where the attention backstop the
    step returned (`OVERFLOW_METRIC`, popped from the metrics) raises if the bound was too
    small. The step runs with JAX's transfer guard disallowing implicit transfers between
    host and device: the batch goes to the device and the metrics come back explicitly
    (`jax.device_put`, `jax.device_get`), so a stray host array or Python scalar that would
    be copied on every step fails at once. Copies between devices stay allowed: a sharded
    step replicates its small arguments (the key) over the mesh."""

    def run(state, packed: Packed, *args):
      batch = self.widen(packed.batch)
      with jax.transfer_guard_host_to_device("disallow"), \
          jax.transfer_guard_device_to_host("disallow"):
        state, metrics = step(self(state, batch, packed.kv_blocks), batch, *args)
        metrics = jax.device_get(metrics)
      pairs = int(metrics.pop(OVERFLOW_METRIC))
      if pairs:
        raise_on_overflow(pairs, batch.tokens.shape, self.fit.config(batch, packed.kv_blocks))
      return state, metrics

    return run


@dataclasses.dataclass(frozen=True)
class Learner:
  """How a step's trees become updates.

  Attributes:
    update: `(state, packed, key) -> (state, host metrics)` (`ShapeFitter.wrap`).
    pack: `trees -> tree.batch.Packed` (the TreeBatch of the sound trees, or None, and the
      bad trees dropped, as (task id, why)).
    num_parts: 1: one update over the step's batch; k > 1: one update per mini-batch of the
      step's trees in tree order (k of them), with key `fold_in(key, part)`.
    branch_between: APPO's per-mini-batch branching (num_parts > 1): each mini-batch's
      branches are grown with the policy of the moment.
    trace_ratio: log TRACE's effective ratio (arXiv 2606.11119, Eq. 21) of the trained
      batches.
  """

  update: Callable[..., tuple[Any, dict[str, Any]]]
  pack: Callable[[Sequence[Any]], Packed]
  num_parts: int = 1
  branch_between: bool = False
  trace_ratio: bool = False


@dataclasses.dataclass
class StepResult:
  """What a step trained on and logged.

  Attributes:
    rollout: the step's StepRollout (every tree grown, those trained on, its logs).
    method_state: the strategy's learned state as of this step's rollout (`method_state`).
    trained: per update, (its trees, the learner's published policy version when it trained
      them); `pipeline.staleness` compares it with each node's sampling version.
    bad: the trees `pack` dropped, as (task id, why).
    metrics: the updates' metrics averaged over the mini-batches, or None without one.
  """

  rollout: dynamic_sampling.StepRollout
  method_state: Any
  trained: list[tuple[list, int]]
  bad: list[tuple[str, str]]
  metrics: dict[str, Any] | None


def rl_step(learner: Learner, rollout: Any, state: ppo.TrainState, produced: Produced,
            key: jax.Array, timer: metrics_lib.PhaseTimer,
            note: Callable[[str], None] = lambda text: None) -> tuple[Any, StepResult]:
  """Trains step `produced.step` on its trees (see the module docstring).

  Args:
    learner: how the trees become updates.
    rollout: the run's `session.Rollout`; with `learner.branch_between` the step's trees
      are grown here, from `produced.rollout`'s tasks, syncing it before mini-batch k > 0.
    state: the TrainState before the step.
    produced: the step's rollout from the `RolloutPipeline`.
    key: the step's update key; mini-batch k of a split step updates with fold_in(key, k).
    timer: accumulates the rollout, pack and update times.
    note: gets progress texts.

  Returns:
    (the TrainState after the step's updates, its StepResult).

  Raises:
    ValueError: a packed batch overflowed the attention bound it was fitted to
      (`ShapeFitter.wrap`).
  """
  grow = learner.branch_between
  parts, trained, bad = [], [], []
  ratios = []
  with contextlib.ExitStack() as stack:
    if grow:
      tasks = produced.rollout
      forest = stack.enter_context(rollout.agent.open_forest(tasks))
      with timer("rollout"):
        rollout.strategy.initial(forest)
      note(f"initial rollouts of {len(tasks)} prompts done")
      items = tasks
    else:
      got = produced.rollout
      items = got.train
      if items:
        note(f"rollout of {len(got.trees)} trees done; updating")
    for k, part in enumerate(np.array_split(np.arange(len(items)), learner.num_parts)):
      ids = [int(i) for i in part]
      if grow:
        if k:
          rollout.sync(state)
        with timer("rollout"):
          rollout.strategy.branch(forest, ids)
        trees = forest.take(ids)
      else:
        trees = [items[i] for i in ids]
      trained.append((trees, rollout.engine.published))
      with timer("pack"):
        packed = learner.pack(trees)
      bad += packed.bad
      if packed.batch is not None:
        if learner.trace_ratio:
          ratios.append(float(effective_ratio(packed.batch)))
        with timer("update"):
          state, m = learner.update(state, packed, jax.random.fold_in(key, k)
                                    if learner.num_parts > 1 else key)
        parts.append(jax.device_get(m))
      if grow:
        note(f"mini-batch {k + 1}/{learner.num_parts} branched and updated")
    if grow:
      trees = rollout.agent.close_forest(forest)
  if grow:
    got = dynamic_sampling.StepRollout.single(trees, rollout.agent.last_stats, rollout.strategy,
                                              len(tasks))
    method = method_state(rollout.strategy)
  else:
    method = produced.method_state
  m = None
  if len(parts) == 1:
    m = parts[0]
  elif parts:
    m = {k: np.mean([p[k] for p in parts]) for k in parts[0]}
  if m is not None and ratios:
    m = {**m, "trace/effective_ratio": float(np.mean(ratios))}
  return state, StepResult(got, method, trained, bad, m)


@dataclasses.dataclass(frozen=True)
class StepProducer:
  """Grows step `step`'s trees from data position `pos` (`__call__`; in the producer thread
  when rollout.max_staleness > 0). Sampling depends only on (seed, step) and the
  dynamic-sampling round, so a resumed synchronous run samples the same trees.

  Attributes:
    rollout: the run's `session.Rollout`.
    tasks: the training tasks, taken in order from the data position (cyclically).
    prompts: prompts a step (config.prompts_per_step).
    key: the run's base key; step s samples with fold_in(key, s).
    grown_in_step: APPO's per-mini-batch branching: the step only takes its tasks here
      (reseeded), and `rl_step` grows them.
    mixed_channels: DAPO's dynamic sampling keeps the groups mixed on these channels
      (None: off); at most `extra_rounds` extra rounds a step.
  """

  rollout: Any
  tasks: Sequence[Any]
  prompts: int
  key: jax.Array
  grown_in_step: bool = False
  mixed_channels: Sequence[str] | None = None
  extra_rounds: int = 0

  def __call__(self, step: int, pos: int) -> Produced:
    tasks_at = lambda i, n: [self.tasks[(pos + i + j) % len(self.tasks)] for j in range(n)]
    step_key = jax.random.fold_in(self.key, step)
    reseed = lambda k: self.rollout.reseed(jax.random.fold_in(step_key, k) if k else step_key)
    if self.grown_in_step:
      reseed(0)
      return Produced(step, tasks_at(0, self.prompts), pos + self.prompts)
    t = time.perf_counter()
    got = dynamic_sampling.rollout_step(self.rollout.producer, tasks_at, self.prompts, reseed,
                                        self.mixed_channels, self.extra_rounds)
    return Produced(step, got, pos + got.prompts, method_state(self.rollout.strategy),
                    time.perf_counter() - t)
