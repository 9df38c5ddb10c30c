"""Several processes (hosts) training one device mesh.

`initialize(config.distributed)` joins the run's processes with
`jax.distributed.initialize`; it must run before anything touches a device (the
launcher calls it first, `train_and_evaluate` again at start-up, and it fails clearly
when the backend already started single-process). Each field left unset in the config
comes from JAX's own variable: $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES,
$JAX_PROCESS_ID. On CPU the processes' collectives run over gloo.

How the trainer divides the work (docs/sharding.md#several-hosts): every process rolls
out all of the step's prompts, identically (same weights, same per-request seeds), so
every process holds the same trees and takes the same branches (dynamic-sampling
rounds, packing buckets) with no exchange of trees between hosts; each process then
feeds only its own share of the packed trees to its devices
(`tree_rl.placement.Placement.place_batch`). Checkpoints are written by every process
(Orbax coordinates them); metrics, eval files and curves by process 0 only
(`is_primary`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent in JAX

from tree_rl.config_types import DistributedSpec

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


@dataclass(frozen=True)
class Cluster:
  """The resolved process group: coordinator "host:port", process count, this process."""

  coordinator_address: str
  num_processes: int
  process_id: int


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name, "")
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"${name}={raw!r} is not an integer") from None


def resolve(spec: DistributedSpec) -> Cluster | None:
  """The process group `spec` asks for, unset fields from the environment; None for one
  process.

  Raises:
    ValueError: a multi-process run lacks its coordinator address or a process id in
      [0, num_processes), or a $JAX_* variable is not an integer; names the field.
  """
  n = spec.num_processes or _env_int(ENV["num_processes"]) or 1
  if n < 1:
    raise ValueError(f"${ENV['num_processes']}={n} must be >= 1")
  if n == 1:
    return None
  address = spec.coordinator_address or os.environ.get(ENV["coordinator_address"], "")
  pid = spec.process_id if spec.process_id >= 0 else _env_int(ENV["process_id"])
  if not address:
    raise ValueError(f"{n} processes need config.distributed.coordinator_address (or "
                     f"${ENV['coordinator_address']}): process 0's host:port")
  if pid is None or not 0 <= pid < n:
    raise ValueError(f"config.distributed.process_id (or ${ENV['process_id']}) = {pid}: each "
                     f"of the {n} processes needs its index in [0, {n})")
  return Cluster(address, n, pid)


def initialize(spec: DistributedSpec) -> Cluster | None:
  """Joins the process group of `spec` (once; a second call checks it is the same).

  Returns the group, or None for a one-process run (nothing is done).

  Raises:
    ValueError: the group is misconfigured (`resolve`).
    RuntimeError: JAX's backend started before the group was joined (it would see only
      this process's devices), or the joined group is not the configured one.
  """
  cluster = resolve(spec)
  if cluster is None:
    return None
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (cluster.num_processes,
                                                      cluster.process_id):
      raise RuntimeError(f"jax.distributed already joined as process {jax.process_index()} of "
                         f"{jax.process_count()}, but the config asks for {cluster}")
    return cluster
  if xla_bridge.backends_are_initialized():
    raise RuntimeError(
        f"config.distributed asks for {cluster.num_processes} processes, but JAX's backend "
        f"already started in this process without jax.distributed.initialize: start the run "
        f"with launch/train.py, or call tree_rl.distributed.initialize(RunConfig.distributed) "
        f"before the first JAX device use")
  # CPU backends exchange collectives over gloo (no effect on GPU/TPU backends).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes,
                             cluster.process_id)
  return cluster


def is_primary() -> bool:
  """Whether this process writes the run's metrics, eval files and curves (process 0)."""
  return jax.process_index() == 0


def check_supported(rollout_engine: str, strategy: str, backend: str = "local",
                    max_staleness: int = 0) -> None:
  """Fails at start-up on what a multi-process run cannot do; nothing in one process.

  Args:
    rollout_engine, strategy, backend, max_staleness: config.rollout.engine, .strategy,
      .backend and .max_staleness.

  Raises:
    ValueError: max_staleness > 0, a Ray backend, an engine other than "jax", or the APPO
      strategy, over several processes; names the field and the setting that runs.
  """
  if jax.process_count() == 1:
    return
  if max_staleness:
    raise ValueError(f"config.rollout.max_staleness={max_staleness}: every process of a "
                     f"{jax.process_count()}-process run grows the whole step and keeps its "
                     f"share, so the trees must be identical everywhere, but an asynchronous "
                     f"producer loads new weights at times that differ between processes; "
                     f"set rollout.max_staleness=0")
  if backend != "local":
    raise ValueError(f"config.rollout.backend={backend!r}: every process of a "
                     f"{jax.process_count()}-process run rolls out the whole step itself, so "
                     f"each would start its own fleet; set rollout.backend='local'")
  if rollout_engine != "jax":
    raise ValueError(f"config.rollout.engine={rollout_engine!r}: a run over "
                     f"{jax.process_count()} processes rolls out with the JAX sampler on each "
                     f"process; set rollout.engine='jax'")
  if strategy == "appo":
    raise ValueError("config.rollout.strategy='appo' scores branch points with the mesh's "
                     "sharded policy, whose per-tree results are not gathered across "
                     f"{jax.process_count()} processes; run APPO in one process")
