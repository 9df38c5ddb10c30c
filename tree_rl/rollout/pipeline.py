"""Rollouts ahead of the learner with bounded staleness (`config.rollout.max_staleness = S`).

S = 0 is the synchronous loop: the trees of step k are grown when the learner asks for
them, with the weights of update k - 1. With S > 0 a producer thread grows the trees of
later steps while the learner trains. Its admission rule: the trees of step j may start
once the learner has asked for step j - S, i.e. once update j - S - 1 is done and
published. Counted in trees (T per step, d updates done) that is

    trees accepted + trees in flight <= (S + d + 1) * T.

Weights. After every update the learner publishes the new policy version (`publish`:
a closure that loads it, and its number). A `VersionedEngine` loads the newest published
version at the start of its next `generate` call and stamps every result with the version
that sampled it, so one tree can span versions (an episode's later turns see newer
weights) and the agent loop records the version on each policy node (`Node.version`).
A node sampled by version v and trained by the learner at version u is u - v stale; the
rule above keeps that at most S (`staleness`).

Off-policy correction: the loss's ratio is pi_theta / pi_behaviour with the behaviour
log-probs recorded at sampling time, and it is clipped, so stale tokens enter with a
bounded importance weight (docs/async_rollouts.md#off-policy-correction). The trainer
refuses S > 0 where that does not hold (`check_async`).

Both modes run behind one interface, `RolloutPipeline.get(step)`; the producer's errors are
raised by the learner's next `get`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tree_rl.rollout.engine import GenerationRequest, GenerationResult
from tree_rl.tree.types import NodeKind

# A clip radius at or above this lets a stale token's ratio double before the clip binds:
# the off-policy correction is then, in practice, an unbounded importance weight.
MAX_ASYNC_CLIP_EPS = 1.0


class RolloutInterrupted(RuntimeError):
  """Raised inside a producer's generate call once the pipeline is closing."""


class VersionedEngine:
  """A RolloutEngine that holds one policy version at a time.

  `publish(version, load)` may be called from any thread: `load()` (which moves the new
  weights into the wrapped engine, and anything else the sampler side reads, such as the
  branch scorer's model) runs at the start of the next `generate`, under the engine's
  lock, so it never lands in the middle of a batch. Every result carries
  `policy_version`. `load_now` publishes and loads at once (the synchronous loop).
  Evaluation and the producer may share the engine: their `generate` calls take turns.

  Args:
    engine: the engine to wrap (JaxSampler, VLLMEngine, a mock).
    version: the version its current weights are.

  Attributes:
    version: the version loaded (what the next results are stamped with, unless a newer
      one is pending).
    published: the newest version published (the learner's).
  """

  def __init__(self, engine: Any, version: int = 0):
    self.engine = engine
    self.version = self.published = int(version)
    self._lock = threading.RLock()  # a load or an engine may publish from inside
    self._pending: tuple[int, Callable[[], None]] | None = None
    self._interrupted = False

  def publish(self, version: int, load: Callable[[], None]) -> None:
    """Version `version` is loaded by `load()` before the next generate (newest wins).

    Raises:
      ValueError: `version` does not exceed the published one.
    """
    with self._lock:
      if version <= self.published:
        raise ValueError(f"policy version {version} must exceed the published "
                         f"{self.published}")
      self._pending, self.published = (int(version), load), int(version)

  def load_now(self, version: int, load: Callable[[], None]) -> None:
    """`publish(version, load)`, then loads it at once (under the lock)."""
    self.publish(version, load)
    with self._lock:
      self._load_pending()

  def _load_pending(self) -> None:
    if self._pending is not None:
      version, load = self._pending
      load()
      self.version, self._pending = version, None

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """The wrapped engine's results, each stamped with the version that sampled it (a
    pending version is loaded first).

    Raises:
      RolloutInterrupted: after `interrupt`.
    """
    with self._lock:
      if self._interrupted:
        raise RolloutInterrupted("the rollout pipeline is closing")
      self._load_pending()
      results = self.engine.generate(requests)
      return [dataclasses.replace(r, policy_version=self.version) for r in results]

  def update_weights(self, params: Any) -> None:
    """The RolloutEngine protocol: `params` loaded now as the next version."""
    self.load_now(self.published + 1, lambda: self.engine.update_weights(params))

  def reseed(self, key: Any) -> None:
    """The wrapped engine's next sampling stream (between `generate` calls)."""
    with self._lock:
      self.engine.reseed(key)

  def interrupt(self) -> None:
    """Every later `generate` raises RolloutInterrupted (a closing pipeline's producer)."""
    self._interrupted = True

  def close(self) -> None:
    """Closes the wrapped engine, if it has a `close`."""
    if hasattr(self.engine, "close"):
      self.engine.close()


@dataclasses.dataclass
class Produced:
  """One step's rollout as the producer hands it over.

  Attributes:
    step: the training step it is for.
    rollout: what the step's produce function grew (the trainer's StepRollout; for APPO's
      per-minibatch branching, grown between the updates, the step's tasks).
    data_position: the data order's position after this step's prompts.
    method_state: the strategy's state right after growing this step (saved with the
      step's checkpoint, so a resume continues from exactly here), or None.
    seconds: wall time the rollout took.
  """

  step: int
  rollout: Any
  data_position: int
  method_state: Any = None
  seconds: float = 0.0


class RolloutPipeline:
  """The trees of steps `first..last`, grown synchronously (S = 0) or ahead (S > 0).

  Args:
    produce: (step, data position) -> Produced, the step's whole rollout.
    first, last: the steps to produce.
    data_position: the data order's position before step `first`.
    max_staleness: S; with S > 0 (and first <= last) the producer thread starts here.

  Raises:
    ValueError: `max_staleness` is not an int >= 0.
  """

  def __init__(self, produce: Callable[[int, int], Produced], first: int, last: int,
               data_position: int, max_staleness: int = 0):
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) \
        or max_staleness < 0:
      raise ValueError(f"max_staleness={max_staleness!r} must be an int >= 0")
    self.produce, self.first, self.last = produce, first, last
    self.max_staleness = max_staleness
    self._position = int(data_position)
    self._cond = threading.Condition()
    self._requested = first - 1  # the last step the learner asked for
    self._ready: dict[int, Produced] = {}
    self._in_flight: int | None = None
    self._error: BaseException | None = None
    self._closed = False
    self._thread = None
    if max_staleness and first <= last:
      self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
      self._thread.start()

  def admitted(self, step: int) -> bool:
    """The admission rule: step `step` may start (call with the lock held)."""
    return step <= self.max_staleness + self._requested

  def get(self, step: int) -> Produced:
    """Step `step`'s rollout (blocks until it is grown); steps are asked for in order.

    Raises:
      ValueError: S > 0 and `step` is not the one after the last asked for.
      RuntimeError: the producer failed (its error chained as the cause).
    """
    if self._thread is None:  # synchronous: grown now, with the latest weights
      got = self.produce(step, self._position)
      self._position = got.data_position
      return got
    with self._cond:
      if step != self._requested + 1:
        raise ValueError(f"RolloutPipeline.get({step}) after step {self._requested}: "
                         f"steps are taken in order")
      self._requested = step
      self._cond.notify_all()
      self._cond.wait_for(lambda: step in self._ready or self._error is not None)
      if step in self._ready:
        return self._ready.pop(step)
      raise RuntimeError(f"the rollout producer failed before step {step} was grown"
                         ) from self._error

  def ahead(self) -> int:
    """Steps grown or being grown beyond the last one the learner asked for."""
    with self._cond:
      return len(self._ready) + (self._in_flight is not None)

  def _run(self) -> None:
    position = self._position
    try:
      for step in range(self.first, self.last + 1):
        with self._cond:
          self._cond.wait_for(lambda s=step: self._closed or self.admitted(s))
          if self._closed:
            return
          self._in_flight = step
        got = self.produce(step, position)
        position = got.data_position
        with self._cond:
          self._ready[step], self._in_flight = got, None
          self._cond.notify_all()
    except BaseException as e:  # noqa: BLE001  handed to the learner's next get()
      with self._cond:
        if not self._closed:
          self._error = e
        self._cond.notify_all()

  def close(self, interrupt: Iterable[Callable[[], None]] = (), timeout_s: float = 600.0
            ) -> None:
    """Stops the producer: no new step starts; `interrupt` callables stop a step in
    progress (e.g. `VersionedEngine.interrupt`); waits up to `timeout_s` for the thread."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    for fn in interrupt:
      fn()
    if self._thread is not None:
      self._thread.join(timeout_s)


def staleness(trained: Iterable[tuple[Iterable[Any], int]]) -> dict[str, float]:
  """rollout/staleness_max and _mean (weighted by policy tokens) of trees trained at known
  policy versions, `trained` = [(trees, the learner's version when it trained them)]: the
  learner's version minus each policy node's sampling version (nodes without one skipped;
  both 0 when no node has one)."""
  ages, weights = [], []
  for trees, version in trained:
    for tree in trees:
      for node in tree.nodes:
        if node.kind == NodeKind.POLICY and node.version is not None:
          ages.append(version - node.version)
          weights.append(len(node.tokens))
  if not ages:
    return {"rollout/staleness_max": 0.0, "rollout/staleness_mean": 0.0}
  return {"rollout/staleness_max": float(max(ages)),
          "rollout/staleness_mean": float(np.average(ages, weights=weights))}


def check_async(max_staleness: int, clip_eps_high: float | None, per_minibatch: bool
                ) -> None:
  """Fails, saying why, where S > 0 cannot be corrected or run.

  Args:
    max_staleness: S.
    clip_eps_high: the loss's upper clip radius (None: the estimator clips, as AWPO's
      batch radius does, arXiv 2512.19126 Eq. 29).
    per_minibatch: APPO branches each mini-batch with the policy after the previous
      mini-batch's update.

  Raises:
    ValueError: `max_staleness` is not an int >= 0; with S > 0, a clip radius of at least
      MAX_ASYNC_CLIP_EPS, or per-minibatch branching.

  Several learner processes are refused by `tree_rl.distributed.check_supported`.
  """
  if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) \
      or max_staleness < 0:
    raise ValueError(f"config.rollout.max_staleness={max_staleness!r} must be an int >= 0")
  if not max_staleness:
    return
  head = f"config.rollout.max_staleness={max_staleness}"
  if clip_eps_high is not None and clip_eps_high >= MAX_ASYNC_CLIP_EPS:
    raise ValueError(
        f"{head} trains on tokens sampled by older policies, corrected by the clipped ratio "
        f"against their behaviour log-probs; algo.loss.clip_eps_high={clip_eps_high} lets "
        f"that ratio reach {1 + clip_eps_high:g} before it binds, which is an unclipped "
        f"importance weight. Use a radius below {MAX_ASYNC_CLIP_EPS} or max_staleness=0")
  if per_minibatch:
    raise ValueError(
        f"{head}: APPO's per-minibatch branching samples each mini-batch's branches with "
        f"the policy after the previous mini-batch's update, which needs the current "
        f"policy, not one up to {max_staleness} updates old. Set rollout.strategy_kwargs."
        f"branch_timing='per_step' (or algo.num_minibatches=1), or max_staleness=0")

