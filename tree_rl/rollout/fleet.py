"""A fleet of rollout workers: one step's tasks split across engines, in-process or on Ray.

A worker is one engine (a JaxSampler) with its own AgentLoop. The fleet splits a call's
tasks into contiguous chunks, one per worker, so every branch of a tree runs on the
worker that holds its prefix in cache, and returns the trees in task order. Every
request carries a seed from (task id, occurrence, branch, turn) and the sampler draws
from (step key, request seed) alone, so with a split-invariant strategy the trees do
not depend on the number of workers (tests/rollout/batch_invariance_test.py): the
fleet reseeds every worker with the same step key.

Two backends behind one interface (`make_fleet`):

  local: the workers live in this process and run one after the other.
  ray:   each worker is a Ray actor with `num_cpus`/`num_gpus` of Ray resources. A
         policy version is published once (`ray.put` of its weights) and every actor
         loads it from the object store; each reports the version it holds. A worker
         that dies, or does not answer within `timeout_s`, is killed and started again
         on the latest weights, and its chunk is sent again with the same key, so the
         step loses no tree (`rollout/fleet/restarts`, `rollout/fleet/resends`).

Strategies whose choices depend on the whole step, or on state outside the worker, cannot
be split; `check_fleet` rejects them (see SPLITTABLE_STRATEGIES).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop, RolloutStats
from tree_rl.rollout.dynamic_sampling import _weighted

BACKENDS = ("local", "ray")
PREFIX = "rollout/fleet/"
# Strategies whose trees are a function of (step key, task, occurrence) alone: the flat
# group seeds every request from (task, occurrence, branch, turn).
SPLITTABLE_STRATEGIES = ("flat",)
_UNSPLITTABLE = {
    "appo": "APPO scores its branch points with the learner's current policy, which lives in "
            "the trainer process (and per-minibatch branching needs it between updates)",
    "trace": "TRACE allocates one rollout budget across all of a step's tasks with one "
             "success predictor",
    "portool": "PORTool draws its fork choices from one generator per call",
    "arpo": "ARPO draws its branch choices from one generator per call",
    "random": "the random strategy draws its branch points from one generator per call",
}


def check_fleet(backend: str, num_workers: int, strategy: str, engine: str = "jax",
                leaf_rewards: bool = False) -> None:
  """Fails with the reason when a fleet of `num_workers` on `backend` cannot run this rollout.

  One local worker runs anything (today's single engine). Otherwise the strategy must be
  split-invariant, and a Ray worker builds a JAX engine without the trainer's leaf scorer.
  """
  if backend not in BACKENDS:
    raise ValueError(f"config.rollout.backend={backend!r} must be one of {BACKENDS}")
  if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
    raise ValueError(f"config.rollout.num_workers={num_workers!r} must be an int >= 1")
  if backend == "local" and num_workers == 1:
    return
  where = f"rollout.backend={backend!r} with num_workers={num_workers}"
  if strategy not in SPLITTABLE_STRATEGIES:
    why = _UNSPLITTABLE.get(strategy, "its trees are not known to be independent of the split")
    raise ValueError(f"config.rollout.strategy={strategy!r} cannot be split across rollout "
                     f"workers ({where}): {why}. Use one of {SPLITTABLE_STRATEGIES}, or "
                     f"backend='local' with num_workers=1")
  if engine != "jax":
    raise ValueError(f"config.rollout.engine={engine!r}: a fleet ({where}) builds JaxSampler "
                     f"workers only; use engine='jax' or one local worker")
  if leaf_rewards:
    raise ValueError(f"the reasoning judge (config.judge.kind) scores leaves in the trainer "
                     f"process and is not sent to rollout workers ({where}); use one local "
                     f"worker with a judge")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  """What a worker builds its engine and AgentLoop from (picklable, sent to Ray actors).

  Attributes:
    tokenizer: the tokenizer's folder (chat format, eos ids, stop strings).
    family, family_kwargs: the task family, as `make_family(family, **family_kwargs)`.
    agent: the AgentLoop's config.
    strategy, strategy_kwargs: `make_strategy(strategy, **strategy_kwargs)`.
    rows, slots, seed: the JaxSampler's cache rows, slots per row and seed.
  """

  tokenizer: str
  family: str
  agent: AgentConfig
  family_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  strategy: str = "flat"
  strategy_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  rows: int = 16
  slots: int = 2048
  seed: int = 0

  def build(self, model: nnx.Module) -> AgentLoop:
    """An AgentLoop over a new JaxSampler serving `model`."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from tree_rl.envs import make_family  # noqa: PLC0415
    from tree_rl.rollout.chat import ChatFormat  # noqa: PLC0415
    from tree_rl.rollout.jax_sampler import JaxSampler  # noqa: PLC0415
    from tree_rl.rollout.strategies import make_strategy  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = JaxSampler(model, rows=self.rows, slots=self.slots, tokenizer=tokenizer,
                        eos_ids=chat.eos_ids, seed=self.seed)
    return AgentLoop(engine, chat, make_family(self.family, **dict(self.family_kwargs)),
                     self.agent, make_strategy(self.strategy, **dict(self.strategy_kwargs)))


class Worker:
  """One engine and its AgentLoop; the body of a local worker and of a Ray actor.

  Args:
    spec: how to build the engine and loop.
    model: the policy's Decoder (its graph and first weights).
    weights: a later policy's `nnx.State` to load now (a restarted worker), or None.
    version: the policy version `model` (or `weights`) is.
  """

  def __init__(self, spec: WorkerSpec, model: nnx.Module, weights: Any = None,
               version: int = 0):
    self.model = model
    self.agent = spec.build(model)
    self.version = version
    if weights is not None:
      self.load(weights, version)

  def load(self, weights: Any, version: int) -> int:
    """Loads a policy version's weights (an `nnx.State` of host arrays); returns the version."""
    nnx.update(self.model, jax.tree.map(jax.numpy.asarray, weights))
    self.agent.engine.update_weights(self.model)
    self.version = int(version)
    return self.version

  def held_version(self) -> int:
    return self.version

  def rollout(self, tasks: Sequence[Any], key_data: np.ndarray
              ) -> tuple[list, RolloutStats, dict[str, float]]:
    """(trees in task order, the call's RolloutStats, the strategy's last_metrics) of `tasks`
    sampled from the key whose `jax.random.key_data` is `key_data`."""
    self.agent.engine.reseed(jax.random.wrap_key_data(np.asarray(key_data)))
    trees = self.agent.rollout(list(tasks))
    return trees, self.agent.last_stats, dict(getattr(self.agent.strategy, "last_metrics", {}))


@dataclasses.dataclass
class FleetStrategy:
  """What the step's rollout reads of a strategy: its name and the merged `last_metrics`."""

  name: str
  last_metrics: dict = dataclasses.field(default_factory=dict)


def merge_stats(stats: Sequence[RolloutStats]) -> RolloutStats:
  """The field-wise sum of the workers' counts (skipped task ids concatenated)."""
  out = {}
  for f in dataclasses.fields(RolloutStats):
    vals = [getattr(s, f.name) for s in stats]
    out[f.name] = tuple(x for v in vals for x in v) if f.name == "skipped_tasks" else sum(vals)
  return RolloutStats(**out)


def split_tasks(task_ids: Sequence[str], num_workers: int) -> list[list[int]]:
  """Task indices per worker: contiguous runs of near-equal size (empty ones dropped), each
  in task order, with a task id's repeats moved to its first occurrence's worker.

  A task's whole tree stays on one worker, and so do its repeats: a tree's sampling
  identity counts the task's earlier occurrences in the call (`branching.Forest`), which a
  worker sees in the same order as one engine does.
  """
  bounds = np.linspace(0, len(task_ids), num_workers + 1).round().astype(int)
  first: dict[str, int] = {}
  chunks: list[list[int]] = [[] for _ in range(num_workers)]
  for w, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
    for i in range(a, b):
      chunks[first.setdefault(str(task_ids[i]), w)].append(i)
  return [c for c in chunks if c]


class Fleet(abc.ABC):
  """The rollout side of a step: `rollout(tasks)` like an AgentLoop, over several workers.

  Duck-types what `dynamic_sampling.rollout_step` reads of an AgentLoop (`rollout`,
  `last_stats`, `strategy.last_metrics`). Call `reseed(key)` before a rollout and
  `update_weights(model, version)` after every update.
  """

  def __init__(self, strategy_name: str, num_workers: int):
    self.num_workers = num_workers
    self.strategy = FleetStrategy(strategy_name)
    self.last_stats: RolloutStats | None = None
    self.version = 0
    self.counts = {"restarts": 0, "resends": 0}
    self._key: jax.Array | None = None

  def reseed(self, key: jax.Array) -> None:
    """The key every worker samples the next rollout from."""
    self._key = key

  def rollout(self, tasks: Sequence[Any]) -> list:
    """The trees of `tasks` in task order (one per task the strategy did not skip)."""
    if self._key is None:
      raise ValueError("Fleet.rollout before reseed(key): the workers need the step's key")
    ids = [str(t.task_id) for t in tasks]
    split = split_tasks(ids, self.num_workers)
    results = self._run([[tasks[i] for i in c] for c in split],
                        np.asarray(jax.random.key_data(self._key)))
    self.last_stats = merge_stats([s for _, s, _ in results])
    self.strategy.last_metrics = _weighted([(len(t), m) for t, _, m in results]) if results \
        else {}
    # Back in task order: a worker's trees follow its chunk's order, one per task it did
    # not skip, so each tree belongs to the next index of its chunk with its task id.
    placed = []
    for chunk, (trees, _, _) in zip(split, results):
      at = iter(chunk)
      for tree in trees:
        i = next(j for j in at if ids[j] == str(tree.meta["task_id"]))
        placed.append((i, tree))
    return [tree for _, tree in sorted(placed, key=lambda p: p[0])]

  def metrics(self) -> dict[str, float]:
    """rollout/fleet/: restarts and resends (totals since the fleet started), the published
    policy_version and stale_workers (workers holding another version: 0 after a sync)."""
    return {PREFIX + "restarts": float(self.counts["restarts"]),
            PREFIX + "resends": float(self.counts["resends"]),
            PREFIX + "policy_version": float(self.version),
            PREFIX + "stale_workers": float(sum(v != self.version for v in self.versions()))}

  def _check_version(self, version: int) -> None:
    if version <= self.version:
      raise ValueError(f"policy version {version} must exceed the fleet's {self.version}")

  @abc.abstractmethod
  def _run(self, chunks: list[list], key_data: np.ndarray) -> list:
    """Each chunk's `Worker.rollout` result, in chunk order."""

  @abc.abstractmethod
  def update_weights(self, model: nnx.Module, version: int) -> None:
    """Every worker loads `model`'s weights as policy `version` (> the current one)."""

  @abc.abstractmethod
  def versions(self) -> list[int]:
    """The policy version each worker holds."""

  def close(self) -> None:
    """Releases the workers (nothing to release in-process)."""


class LocalFleet(Fleet):
  """Workers in this process, run one after the other (one worker: today's single engine)."""

  def __init__(self, spec: WorkerSpec, model: nnx.Module, num_workers: int = 1):
    super().__init__(spec.strategy, num_workers)
    # Each worker its own copy of the model: loading one worker's weights must not move
    # another's before its turn.
    self.workers = [Worker(spec, nnx.clone(model)) for _ in range(num_workers)]

  def _run(self, chunks, key_data):
    return [w.rollout(c, key_data) for w, c in zip(self.workers, chunks)]

  def update_weights(self, model, version):
    self._check_version(version)
    weights = nnx.state(model)
    for w in self.workers:
      w.load(weights, version)
    self.version = version

  def versions(self):
    return [w.held_version() for w in self.workers]


class RayFleet(Fleet):
  """Each worker a Ray actor (`Worker` with `num_cpus`/`num_gpus`); ray must be initialised.

  Args:
    spec, model: as for `Worker` (the model goes to the object store once).
    num_workers: actors.
    num_cpus, num_gpus: Ray resources per actor.
    timeout_s: a chunk not back within this many seconds counts as lost: its actor is
      restarted and the chunk sent again.
    max_resends: resends of one chunk in one call before the step fails.
  """

  def __init__(self, spec: WorkerSpec, model: nnx.Module, num_workers: int, *,
               num_cpus: float = 1.0, num_gpus: float = 0.0, timeout_s: float = 600.0,
               max_resends: int = 3):
    import ray  # noqa: PLC0415

    super().__init__(spec.strategy, num_workers)
    if not ray.is_initialized():
      raise RuntimeError("RayFleet needs ray.init() first (the trainer calls it)")
    self._ray, self.timeout_s, self.max_resends = ray, timeout_s, max_resends
    self._actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(Worker)
    self._spec = ray.put(spec)
    self._model = ray.put(jax.device_get(model))
    self._weights = None  # the latest published version's object ref
    self.owns_ray = False  # close() shuts Ray down (run_fleet started it)
    self.actors = [self._start() for _ in range(num_workers)]
    self.versions()  # wait until every actor has built its engine

  def _start(self):
    return self._actor_cls.remote(self._spec, self._model, self._weights, self.version)

  def _restart(self, i: int) -> None:
    try:
      self._ray.kill(self.actors[i], no_restart=True)
    except Exception:  # noqa: BLE001  already gone
      pass
    self.actors[i] = self._start()
    self.counts["restarts"] += 1

  def _run(self, chunks, key_data):
    ray = self._ray
    results: list = [None] * len(chunks)
    resends = [0] * len(chunks)
    pending = {}

    def send(i):
      pending[self.actors[i].rollout.remote(chunks[i], key_data)] = (i, time.monotonic())

    for i in range(len(chunks)):
      send(i)
    while pending:
      oldest = min(t for _, t in pending.values())
      wait = max(0.0, oldest + self.timeout_s - time.monotonic())
      done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
      lost = []
      for ref in done:
        i, _ = pending.pop(ref)
        try:
          results[i] = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError):
          lost.append(i)
      now = time.monotonic()
      for ref, (i, t) in list(pending.items()):
        if now - t >= self.timeout_s:  # not answering: treat as dead
          del pending[ref]
          ray.cancel(ref, force=False)
          lost.append(i)
      for i in lost:
        if resends[i] == self.max_resends:
          raise RuntimeError(f"rollout worker {i} lost its chunk {self.max_resends + 1} times "
                             f"(dead or silent past {self.timeout_s}s)")
        self._restart(i)
        resends[i] += 1
        self.counts["resends"] += 1
        send(i)
    return results

  def update_weights(self, model, version):
    """Publishes `model`'s weights as `version`: one `ray.put`, every actor loads it."""
    self._check_version(version)
    self._weights = self._ray.put(jax.device_get(nnx.state(model)))
    self.version = version
    # A worker that died since the last call gets restarted on these weights by the next
    # rollout; a load that fails here restarts it now.
    for i, a in enumerate(self.actors):
      try:
        self._ray.get(a.load.remote(self._weights, version), timeout=self.timeout_s)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        self._restart(i)

  def versions(self):
    """The policy version each actor holds (restarting any that is dead)."""
    out = []
    for i in range(len(self.actors)):
      try:
        out.append(self._ray.get(self.actors[i].held_version.remote(), timeout=self.timeout_s))
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        self._restart(i)
        out.append(self._ray.get(self.actors[i].held_version.remote(), timeout=self.timeout_s))
    return out

  def close(self):
    for a in self.actors:
      self._ray.kill(a, no_restart=True)
    self.actors = []
    if self.owns_ray:
      self._ray.shutdown()


def make_fleet(backend: str, spec: WorkerSpec, model: nnx.Module, num_workers: int = 1,
               **ray_kwargs) -> Fleet:
  """A LocalFleet or a RayFleet (`ray_kwargs`: RayFleet's num_cpus, num_gpus, timeout_s)."""
  check_fleet(backend, num_workers, spec.strategy)
  if backend == "local":
    if ray_kwargs:
      raise ValueError(f"backend='local' takes no Ray options, got {sorted(ray_kwargs)}")
    return LocalFleet(spec, model, num_workers)
  return RayFleet(spec, model, num_workers, **ray_kwargs)


def run_fleet(cfg: Any, model: nnx.Module, tokenizer: Any, agent: AgentConfig) -> Fleet | None:
  """The trainer's fleet for a RunConfig: None for one local worker (the trainer's own
  engine and AgentLoop are that worker), else a fleet of `cfg.rollout.num_workers`. With
  backend='ray' and no Ray yet, starts one (`ray.init()`: $RAY_ADDRESS's cluster if set,
  else a local one), which `close()` shuts down."""
  r = cfg.rollout
  if r.backend == "local" and r.num_workers == 1:
    return None
  kw = dict(r.strategy_kwargs)
  kw.setdefault("n", r.samples_per_task)  # as the trainer's own flat strategy
  spec = WorkerSpec(tokenizer=tokenizer.name_or_path, family=cfg.task.family,
                    family_kwargs=dict(cfg.task.kwargs), agent=agent, strategy=r.strategy,
                    strategy_kwargs=kw, rows=r.cache_rows, slots=r.max_context_tokens,
                    seed=cfg.seed)
  if r.backend == "local":
    return make_fleet("local", spec, model, r.num_workers)
  import ray  # noqa: PLC0415

  owns_ray = not ray.is_initialized()
  if owns_ray:
    ray.init(include_dashboard=False, log_to_driver=False)
  fleet = make_fleet("ray", spec, model, r.num_workers, num_cpus=float(r.worker_num_cpus),
                     num_gpus=float(r.worker_num_gpus), timeout_s=float(r.worker_timeout_s))
  fleet.owns_ray = owns_ray
  return fleet
