"""A fleet of rollout workers: one step's tasks split across engines, in-process or on Ray.

A worker is one engine (a JaxSampler) with its own AgentLoop. The fleet splits a call's
tasks into contiguous chunks, one per worker, so every branch of a tree runs on the
worker that holds its prefix in cache, and returns the trees in task order. Every
request carries a seed from (task id, occurrence, branch, turn) and the sampler draws
from (step key, request seed) alone, so with a split-invariant strategy the trees do
not depend on the number of workers (tests/rollout/batch_invariance_test.py): the
fleet reseeds every worker with the same step key.

A worker's engine is a JaxSampler (`WorkerSpec.engine="jax"`) or a VLLMEngine ("vllm": a
vLLM process of the worker's own, serving an HF folder the worker writes from the model it
is given). Both sit in a `pipeline.VersionedEngine` and load a version the same way
(`update_weights(Decoder)`); a vLLM worker's weights travel by vLLM's weight-transfer API
where the installed vLLM has it, else by its in-place reload (`VLLMEngine.weight_transfer`
says which; docs/rollout_fleet.md).

Two backends behind one interface (`make_fleet`):

  local: the workers live in this process and run one after the other.
  ray:   each worker is a Ray actor with `num_cpus`/`num_gpus` of Ray resources. A
         fleet is placed or refused: one the cluster's nodes cannot hold fails before any
         actor starts, naming the numbers (`check_ray_resources`), and a worker not
         running `timeout_s` after its start fails the start (never a silent wait). A
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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from tree_rl.rollout.agent_loop import AgentConfig, AgentLoop, RolloutStats
from tree_rl.rollout.dynamic_sampling import _weighted
from tree_rl.rollout.engines import ENGINES, EngineSpec, make_engine

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

  One local worker runs anything (the trainer's own engine). Otherwise the strategy must be
  split-invariant, the engine one a worker can build (JaxSampler or VLLMEngine), and the
  leaves are not scored by the trainer's judge.

  Args:
    backend, num_workers, strategy, engine: config.rollout's fields of those names.
    leaf_rewards: a reasoning judge scores the leaves (config.judge.kind is set).

  Raises:
    ValueError: an unknown backend or engine, num_workers < 1, or, for more than one local
      worker or any Ray fleet, a strategy not in SPLITTABLE_STRATEGIES or a judge.
  """
  if backend not in BACKENDS:
    raise ValueError(f"config.rollout.backend={backend!r} must be one of {BACKENDS}")
  if engine not in ENGINES:
    raise ValueError(f"config.rollout.engine={engine!r} must be one of {ENGINES}")
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
    engine: the worker's engine (`engines.make_engine`): a JaxSampler, or a VLLMEngine in a
      process of its own. A vLLM worker's empty `vllm_python` is `find_vllm_python()` where
      the worker runs, i.e. $TREE_RL_VLLM_PYTHON there.
  """

  tokenizer: str
  family: str
  agent: AgentConfig
  family_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  strategy: str = "flat"
  strategy_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  engine: EngineSpec = dataclasses.field(default_factory=EngineSpec)

  def __post_init__(self):
    """Raises TypeError unless `engine` is an EngineSpec."""
    if not isinstance(self.engine, EngineSpec):
      raise TypeError(f"WorkerSpec.engine={self.engine!r} must be an engines.EngineSpec")

  def build(self, model: nnx.Module) -> AgentLoop:
    """An AgentLoop over a new engine serving `model` (as policy version 0)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from tree_rl.envs import make_family  # noqa: PLC0415
    from tree_rl.rollout.chat import ChatFormat  # noqa: PLC0415
    from tree_rl.rollout.pipeline import VersionedEngine  # noqa: PLC0415
    from tree_rl.rollout.strategies import make_strategy  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
    chat = ChatFormat.from_tokenizer(tokenizer)
    engine = make_engine(self.engine, model, tokenizer, chat.eos_ids)
    return AgentLoop(VersionedEngine(engine), chat,
                     make_family(self.family, **dict(self.family_kwargs)), self.agent,
                     make_strategy(self.strategy, **dict(self.strategy_kwargs)))


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
    self.agent = spec.build(model)  # its engine stamps every sampled node with the version
    if weights is not None or version:
      self.load(weights, version)

  @property
  def version(self) -> int:
    return self.agent.engine.version

  def load(self, weights: Any, version: int) -> int:
    """Loads a policy version's weights (an `nnx.State` of host arrays; None: `model`'s
    own) as `version`; returns the version held."""
    if weights is not None:
      nnx.update(self.model, jax.tree.map(jax.numpy.asarray, weights))
    engine = self.agent.engine
    engine.load_now(int(version), lambda: engine.engine.update_weights(self.model))
    return self.version

  def held_version(self) -> int:
    return self.version

  def info(self) -> dict[str, str]:
    """{"engine": "jax" | "vllm", "weight_transfer": how new weights reach the engine}: a
    VLLMEngine's `weight_transfer` (vLLM's API backend, or "in_place"); "jax" for a
    JaxSampler, which reads this worker's model."""
    inner = self.agent.engine.engine
    vllm = hasattr(inner, "weight_transfer")
    return {"engine": "vllm" if vllm else "jax",
            "weight_transfer": inner.weight_transfer if vllm else "jax"}

  def close(self) -> None:
    """Stops the engine (a vLLM worker's process); idempotent."""
    self.agent.engine.close()

  def rollout(self, tasks: Sequence[Any], key_data: np.ndarray
              ) -> tuple[list, RolloutStats, dict[str, float]]:
    """(trees in task order, the call's RolloutStats, the strategy's last_metrics) of `tasks`
    sampled from the key whose `jax.random.key_data` is `key_data`."""
    self.agent.engine.reseed(jax.random.wrap_key_data(np.asarray(key_data)))
    trees = self.agent.rollout(list(tasks))
    return trees, self.agent.last_stats, dict(self.agent.strategy.last_metrics)


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
  `last_stats`, `strategy.last_metrics`). Call `reseed(key)` before a rollout and, after
  every update, `update_weights(model, version)` (loaded now) or `publish(model, version)`
  (loaded by the next `rollout`, in the thread that calls it: the asynchronous producer's).
  """

  def __init__(self, strategy_name: str, num_workers: int):
    self.num_workers = num_workers
    self.strategy = FleetStrategy(strategy_name)
    self.last_stats: RolloutStats | None = None
    self.version = 0
    self.held = [0] * num_workers  # each worker's version, as last reported
    self.counts = {"restarts": 0, "resends": 0}
    self.info: list[dict[str, str]] = []  # each worker's Worker.info(), set by _started
    self._key: jax.Array | None = None
    self._pending: tuple[nnx.Module, int] | None = None
    self._lock = threading.Lock()

  def publish(self, model: nnx.Module, version: int) -> None:
    """`model` becomes policy `version` at the start of the next `rollout` (newest wins)."""
    with self._lock:
      self._pending = (model, version)

  def reseed(self, key: jax.Array) -> None:
    """The key every worker samples the next rollout from."""
    self._key = key

  def rollout(self, tasks: Sequence[Any]) -> list:
    """The trees of `tasks` in task order (one per task the strategy did not skip), with a
    version `publish`ed since the last call loaded first.

    Raises:
      ValueError: no `reseed` before the first rollout.
      RuntimeError: (Ray) a worker lost its chunk more than `max_resends` times.
    """
    if self._key is None:
      raise ValueError("Fleet.rollout before reseed(key): the workers need the step's key")
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is not None:
      self.update_weights(*pending)
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
    """rollout/fleet/: restarts and resends (totals since the fleet started), the loaded
    policy_version and stale_workers (workers last seen holding another version: 0 after
    a sync). Asks no worker: the learner may call it while a rollout runs."""
    return {PREFIX + "restarts": float(self.counts["restarts"]),
            PREFIX + "resends": float(self.counts["resends"]),
            PREFIX + "policy_version": float(self.version),
            PREFIX + "stale_workers": float(sum(v != self.version for v in self.held))}

  def _started(self, info: list[dict[str, str]]) -> None:
    """Records and logs each worker's engine and weight-transfer path."""
    self.info = list(info)
    for i, w in enumerate(self.info):
      logging.info("rollout worker %d: %s engine, weights via %s", i, w["engine"],
                   w["weight_transfer"])

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
  """Workers in this process, run one after the other (one worker: the trainer's engine)."""

  def __init__(self, spec: WorkerSpec, model: nnx.Module, num_workers: int = 1):
    super().__init__(spec.strategy, num_workers)
    # Each worker its own copy of the model: loading one worker's weights must not move
    # another's before its turn.
    self.workers = []
    try:
      for _ in range(num_workers):
        self.workers.append(Worker(spec, nnx.clone(model)))
    except BaseException:
      self.close()  # the vLLM processes of the workers already started
      raise
    self._started([w.info() for w in self.workers])

  def _run(self, chunks, key_data):
    return [w.rollout(c, key_data) for w, c in zip(self.workers, chunks)]

  def update_weights(self, model, version):
    self._check_version(version)
    weights = nnx.state(model)
    self.held = [w.load(weights, version) for w in self.workers]
    self.version = version

  def versions(self):
    self.held = [w.held_version() for w in self.workers]
    return list(self.held)

  def close(self):
    """Stops every worker's engine (vLLM workers' processes)."""
    for w in self.workers:
      w.close()


def _amount(x: float, unit: str) -> str:
  """`x` of a Ray resource, e.g. "3 CPUs", "0.5 GPU"."""
  return f"{x:g} {unit}{'' if x == 1 or 0 < x < 1 else 's'}"


def ray_nodes() -> list[dict[str, float]]:
  """The resources (CPU, GPU, ...) of every live node of the Ray cluster this process is in."""
  import ray  # noqa: PLC0415

  return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def check_ray_resources(num_workers: int, num_cpus: float, num_gpus: float,
                        nodes: Sequence[Mapping[str, float]]) -> None:
  """Fails, naming the numbers and the settings to change, where the Ray cluster's nodes
  cannot place `num_workers` actors of `num_cpus` CPUs and `num_gpus` GPUs each.

  An actor takes its resources from one node, so a node of C CPUs and G GPUs holds
  min(C // num_cpus, G // num_gpus) workers; the fleet fits when the nodes together hold
  `num_workers`. This counts the nodes' whole resources (what the cluster has now: an
  autoscaling cluster must have scaled up first); resources other actors hold at the moment
  make the workers wait, which `RayFleet`'s start timeout bounds.

  Raises:
    RuntimeError: the nodes hold fewer than `num_workers` such workers; names the
      settings to change.
  """
  if num_cpus <= 0 and num_gpus <= 0:  # a worker asking for nothing fits anywhere
    return

  def fits(node: Mapping[str, float]) -> int:
    out = num_workers
    for want, have in ((num_cpus, node.get("CPU", 0.0)), (num_gpus, node.get("GPU", 0.0))):
      if want > 0:  # Ray counts resources in steps of 1e-4
        out = min(out, int(float(have) / want + 1e-6))
    return out

  placed = sum(fits(n) for n in nodes)
  if placed >= num_workers:
    return
  cpus = sum((float(n.get("CPU", 0.0)) for n in nodes), 0.0)
  gpus = sum((float(n.get("GPU", 0.0)) for n in nodes), 0.0)
  per_node = "; ".join(f"{_amount(float(n.get('CPU', 0.0)), 'CPU')}, "
                       f"{_amount(float(n.get('GPU', 0.0)), 'GPU')}" for n in nodes[:8])
  more = f"; ... ({len(nodes)} nodes)" if len(nodes) > 8 else ""
  fix = (f"set config.rollout.num_workers to at most {placed}, " if placed else "") + (
      "lower config.rollout.worker_num_cpus / config.rollout.worker_num_gpus, or add nodes to "
      "the Ray cluster ($RAY_ADDRESS)")
  raise RuntimeError(
      f"the Ray cluster cannot place the rollout fleet: config.rollout.num_workers="
      f"{num_workers} worker(s) x (config.rollout.worker_num_cpus={num_cpus:g} CPU, "
      f"config.rollout.worker_num_gpus={num_gpus:g} GPU each) ask for "
      f"{_amount(num_workers * num_cpus, 'CPU')} and {_amount(num_workers * num_gpus, 'GPU')} "
      f"in all, "
      f"but the cluster has {_amount(cpus, 'CPU')} and {_amount(gpus, 'GPU')} on "
      f"{len(nodes)} node(s) ({per_node or 'none'}{more}), which hold {placed} such "
      f"worker(s); {fix}")


class RayFleet(Fleet):
  """Each worker a Ray actor (`Worker` with `num_cpus`/`num_gpus`); ray must be initialised.

  Args:
    spec, model: as for `Worker` (the model goes to the object store once).
    num_workers: actors.
    num_cpus, num_gpus: Ray resources per actor.
    timeout_s: a chunk not back within this many seconds counts as lost: its actor is
      restarted and the chunk sent again. Also the bound on a worker's start (placed by
      Ray and its engine built): one not running by then fails the fleet's start.
    max_resends: resends of one chunk in one call before the step fails.

  Raises:
    RuntimeError: Ray is not initialised; the cluster's nodes cannot hold `num_workers`
      actors of these resources (before any starts, `check_ray_resources`); a worker is not
      running `timeout_s` after its start, or failed to start.
  """

  def __init__(self, spec: WorkerSpec, model: nnx.Module, num_workers: int, *,
               num_cpus: float = 1.0, num_gpus: float = 0.0, timeout_s: float = 600.0,
               max_resends: int = 3):
    import ray  # noqa: PLC0415

    super().__init__(spec.strategy, num_workers)
    if not ray.is_initialized():
      raise RuntimeError("RayFleet needs ray.init() first (the trainer calls it)")
    # Placed or refused: a worker Ray cannot place would wait forever, unannounced.
    check_ray_resources(num_workers, num_cpus, num_gpus, ray_nodes())
    self._ray, self.timeout_s, self.max_resends = ray, timeout_s, max_resends
    self.num_cpus, self.num_gpus = num_cpus, num_gpus
    self._actor_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(Worker)
    self._spec = ray.put(spec)
    self._model = ray.put(jax.device_get(model))
    self._weights = None  # the latest published version's object ref
    self.owns_ray = False  # close() shuts Ray down (run_fleet started it)
    self.actors = []
    self._running: set[int] = set()  # workers that answered at start-up
    try:
      self._warn_if_busy()
      self.actors = [self._start() for _ in range(num_workers)]
      self._wait_started()  # every actor placed and its engine built, within timeout_s
      self._started(ray.get([a.info.remote() for a in self.actors], timeout=timeout_s))
    except BaseException:
      self._kill_all()
      raise

  def _warn_if_busy(self) -> None:
    """Logs when the cluster's free resources cannot hold every worker now: they wait
    (up to timeout_s) for other actors to release theirs."""
    free = self._ray.available_resources()
    n = self.num_workers
    short = [(f"{_amount(n * want, unit)}", f"{_amount(float(free.get(key, 0.0)), unit)}")
             for want, key, unit in ((self.num_cpus, "CPU", "CPU"), (self.num_gpus, "GPU", "GPU"))
             if want > 0 and n * want > float(free.get(key, 0.0)) + 1e-6]
    if short:
      logging.warning("the rollout fleet asks for %s but the Ray cluster has %s free now (other "
                      "actors hold the rest): its workers wait for them, failing after "
                      "config.rollout.worker_timeout_s=%gs", " and ".join(s for s, _ in short),
                      " and ".join(f for _, f in short), self.timeout_s)

  def _wait_started(self) -> None:
    """Waits, at most `timeout_s`, for every actor to answer (placed and its engine built);
    fails naming the workers that are not running, or the error one of them died of."""
    ray = self._ray
    refs = {a.held_version.remote(): i for i, a in enumerate(self.actors)}
    ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s)
    for ref in ready:
      i = refs[ref]
      try:
        self.held[i] = ray.get(ref)
        self._running.add(i)
      except ray.exceptions.RayError as e:
        raise RuntimeError(f"rollout worker {i} of {self.num_workers} failed to start (building "
                           f"its engine): {e}") from e
    if late:
      free = ray.available_resources()
      raise RuntimeError(
          f"rollout worker(s) {sorted(refs[r] for r in late)} of {self.num_workers} not running "
          f"{self.timeout_s:g}s after their start (config.rollout.worker_timeout_s): Ray has not "
          f"placed them, or their engine takes longer to build. Each asks for "
          f"{_amount(self.num_cpus, 'CPU')} and {_amount(self.num_gpus, 'GPU')} "
          f"(config.rollout.worker_num_cpus / worker_num_gpus); the cluster has "
          f"{_amount(float(free.get('CPU', 0.0)), 'CPU')} and "
          f"{_amount(float(free.get('GPU', 0.0)), 'GPU')} free now. Free the cluster's resources "
          f"held by other actors, lower config.rollout.num_workers or the per-worker resources, "
          f"or raise config.rollout.worker_timeout_s")

  def _kill_all(self) -> None:
    """After a failed start: stops the engines of the workers that are running (a vLLM
    worker's process), then kills every actor (placed or not)."""
    try:
      self._ray.get([self.actors[i].close.remote() for i in sorted(self._running)], timeout=60)
    except Exception:  # noqa: BLE001  dead or silent: killed below all the same
      pass
    for a in self.actors:
      try:
        self._ray.kill(a, no_restart=True)
      except Exception:  # noqa: BLE001  already gone
        pass
    self.actors = []

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
        self.held[i] = self._ray.get(a.load.remote(self._weights, version),
                                     timeout=self.timeout_s)
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        self._restart(i)  # it starts on these weights
        self.held[i] = version

  def versions(self):
    """The policy version each actor holds (restarting any that is dead)."""
    out = []
    for i in range(len(self.actors)):
      try:
        out.append(self._ray.get(self.actors[i].held_version.remote(), timeout=self.timeout_s))
      except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
        self._restart(i)
        out.append(self._ray.get(self.actors[i].held_version.remote(), timeout=self.timeout_s))
    self.held = list(out)
    return out

  def close(self):
    # Ask each actor to stop its engine first (a vLLM worker's process would otherwise
    # only notice its socket closing), then kill it.
    try:
      self._ray.get([a.close.remote() for a in self.actors], timeout=60)
    except Exception:  # noqa: BLE001  dead or silent actors: killed below all the same
      pass
    for a in self.actors:
      self._ray.kill(a, no_restart=True)
    self.actors = []
    if self.owns_ray:
      self._ray.shutdown()


def check_vllm_gpus(num_gpus: float, memory_fraction: float) -> None:
  """Fails, saying why, where Ray actors of `num_gpus` GPUs cannot each hold a vLLM worker
  that takes `memory_fraction` of its GPU's memory.

  A VLLMEngine serves on one GPU (no tensor parallelism), so an actor gets at most one.
  Actors with a fraction of a GPU share it: each vLLM then takes `memory_fraction` of the
  whole device, so that must fit in the actor's share. 0 GPUs: vLLM on CPU.

  Raises:
    ValueError: `num_gpus` > 1, or a fractional `num_gpus` below `memory_fraction`.
  """
  if num_gpus > 1:
    raise ValueError(f"config.rollout.worker_num_gpus={num_gpus:g}: a vLLM rollout worker "
                     f"serves on one GPU (no tensor parallelism); use 1, a fraction, or 0 "
                     f"(CPU)")
  if 0 < num_gpus < 1 and memory_fraction > num_gpus:
    raise ValueError(f"config.rollout.worker_num_gpus={num_gpus:g} puts up to "
                     f"{int(1 // num_gpus)} vLLM workers on one GPU, but each takes "
                     f"generator_memory_fraction={memory_fraction:g} of it; lower the "
                     f"fraction to at most {num_gpus:g} or give each worker a whole GPU")


def make_fleet(backend: str, spec: WorkerSpec, model: nnx.Module, num_workers: int = 1,
               **ray_kwargs) -> Fleet:
  """A LocalFleet or a RayFleet of `num_workers` workers built from `spec`, serving `model`.

  Args:
    backend: "local" or "ray" (Ray must be initialised).
    spec: what each worker builds.
    model: the policy (version 0).
    num_workers: workers.
    **ray_kwargs: RayFleet's num_cpus, num_gpus, timeout_s, max_resends (Ray only).

  Raises:
    ValueError: `check_fleet` refuses the fleet; Ray options with backend='local'; a vLLM
      worker's GPU share (`check_vllm_gpus`).
    RuntimeError: the Ray fleet cannot start (see `RayFleet`).
  """
  check_fleet(backend, num_workers, spec.strategy, spec.engine.kind)
  if backend == "local":
    if ray_kwargs:
      raise ValueError(f"backend='local' takes no Ray options, got {sorted(ray_kwargs)}")
    return LocalFleet(spec, model, num_workers)
  if spec.engine.kind == "vllm":
    check_vllm_gpus(float(ray_kwargs.get("num_gpus", 0.0)), spec.engine.gpu_memory_utilization)
  return RayFleet(spec, model, num_workers, **ray_kwargs)


def run_fleet(cfg: Any, model: nnx.Module, tokenizer: Any, agent: AgentConfig,
              vllm_kwargs: Mapping[str, Any] | None = None) -> Fleet | None:
  """The trainer's fleet for a RunConfig: None for one local worker (the trainer's own
  engine and AgentLoop are that worker), else a fleet of `cfg.rollout.num_workers`. With
  backend='ray' and no Ray yet, starts one (`ray.init()`: $RAY_ADDRESS's cluster if set,
  else a local one), which `close()` shuts down.

  With rollout.engine='vllm' every worker runs a VLLMEngine with the trainer's settings
  (rollout.vllm_python, model.dtype, rollout.generator_memory_fraction, the seed) and
  `vllm_kwargs` (further VLLMEngine arguments, e.g. log_file).

  Raises:
    ValueError: `vllm_kwargs` without rollout.engine='vllm', or what `make_fleet` refuses.
    RuntimeError: the Ray fleet cannot start (see `RayFleet`); Ray is shut down again if
      this call started it.
  """
  r = cfg.rollout
  if r.backend == "local" and r.num_workers == 1:
    return None
  from tree_rl.rollout.strategies.base import strategy_options  # noqa: PLC0415

  kw = strategy_options(r, cfg.seed)  # as the trainer's own strategy
  vllm = r.engine == "vllm"
  if vllm_kwargs and not vllm:
    raise ValueError(f"run_fleet: vllm_kwargs={dict(vllm_kwargs)} with "
                     f"config.rollout.engine={r.engine!r}")
  spec = WorkerSpec(tokenizer=tokenizer.name_or_path, family=cfg.task.family,
                    family_kwargs=dict(cfg.task.kwargs), agent=agent, strategy=r.strategy,
                    strategy_kwargs=kw, engine=EngineSpec.from_run(cfg, **(vllm_kwargs or {})))
  if r.backend == "local":
    return make_fleet("local", spec, model, r.num_workers)
  if vllm:  # before starting Ray
    check_vllm_gpus(float(r.worker_num_gpus), r.generator_memory_fraction)
  import ray  # noqa: PLC0415

  owns_ray = not ray.is_initialized()
  if owns_ray:
    ray.init(include_dashboard=False, log_to_driver=False)
  try:
    fleet = make_fleet("ray", spec, model, r.num_workers, num_cpus=float(r.worker_num_cpus),
                       num_gpus=float(r.worker_num_gpus), timeout_s=float(r.worker_timeout_s))
  except BaseException:
    if owns_ray:
      ray.shutdown()
    raise
  fleet.owns_ray = owns_ray
  return fleet
