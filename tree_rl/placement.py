"""Where the trainer's arrays live: the mesh from `config.mesh`, and the placement of
the TrainState, of every TreeBatch and of the rollout copy of the weights.

    placement = Placement.from_spec(cfg.mesh)
    placement.check_replication(model, cfg.mesh.max_replicated_fraction)
    state = placement.place_state(ppo.init_state(model, optimizer))
    update_step = placement.update_step(ppo_config, optimizer)  # jit with in/out shardings
    engine.update_weights(placement.rollout_model(state.model()))

Training layout (`tree_rl.sharding.LOGICAL_AXIS_RULES`): parameters, their optimizer
moments and the reference policy shard by their logical axes (FSDP over `fsdp` along the
embed dimension, tensor parallelism over `tensor`); counters are replicated; a TreeBatch
splits its trees (dimension 0 of every field, the "tree" rule) over `data` x `fsdp`, so
the number of trees per step is padded up to a multiple of that product (padding trees
have no tokens, leaves or loss). The rollout copy (the JAX sampler's weights) is gathered
to the mesh's first device: the sampler is single-device code, and a whole copy avoids
an all-gather per generated token. On a one-device mesh (the default) nothing is placed
and every step is jitted exactly as an unsharded run. The choices: docs/sharding.md.

Over several processes (`tree_rl.distributed`) the mesh spans every process's devices.
Each process holds the same host values (the same initial state from the seed, the same
packed trees: every process rolls out all prompts), and each moves only the slices its
own devices hold (`jax.make_array_from_callback`): a batch's trees [B, ...] arrive as
[B / processes, ...] per process. The rollout copy is gathered whole on every process
(each runs its own sampler).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from tree_rl import sharding
from tree_rl.algos import ppo, sft
from tree_rl.config_types import MeshSpec
from tree_rl.tree.batch import TreeBatch


def build_mesh(spec: MeshSpec, devices: Sequence | None = None) -> Mesh:
  """The (data, fsdp, tensor) mesh of `config.mesh`.

  Fixed sizes take the first data * fsdp * tensor devices; -1 takes the rest, which
  must split evenly.

  Args:
    spec: config.mesh.
    devices: the devices to build on (default: `jax.devices()`, every process's).

  Raises:
    ValueError: too few devices, or a -1 axis they do not split into; names the config
      and the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {a: getattr(spec, a) for a in sharding.MESH_AXES}
  known = math.prod(v for v in sizes.values() if v != -1)
  if -1 in sizes.values():
    if len(devices) % known:
      raise ValueError(f"config.mesh {sizes}: {len(devices)} devices do not split into "
                       f"{known} x (the rest)")
  elif known > len(devices):
    raise ValueError(f"config.mesh {sizes} needs {known} devices, have {len(devices)}")
  else:
    devices = devices[:known]
  return sharding.make_mesh(sizes, devices)


class Placement:
  """Shardings of the trainer's state and batches on one mesh (see the module docstring).

  Args:
    mesh: the (data, fsdp, tensor) mesh.
    rules: the logical-axis rules (`sharding.LOGICAL_AXIS_RULES`).

  Attributes:
    sharded: the mesh has more than one device (else nothing is placed).
    batch_sharding: a TreeBatch's sharding: dimension 0 (trees) over the "tree" rule's axes.
    tree_shards: how many ways a batch's trees split (the product of those axes' sizes).
  """

  def __init__(self, mesh: Mesh, rules=sharding.LOGICAL_AXIS_RULES):
    self.mesh, self.rules = mesh, rules
    self.sharded = mesh.size > 1
    # Trees of a batch split over these devices (the "tree" logical axis).
    self.batch_sharding = NamedSharding(mesh, sharding.logical_to_spec(("tree",), rules))
    tree_axes = self.batch_sharding.spec[0] or ()
    tree_axes = tree_axes if isinstance(tree_axes, tuple) else (tree_axes,)
    self.tree_shards = math.prod(mesh.shape[a] for a in tree_axes)

  @classmethod
  def from_spec(cls, spec: MeshSpec, devices: Sequence | None = None) -> "Placement":
    """The placement on `build_mesh(spec, devices)` (which raises on a mesh that cannot form)."""
    return cls(build_mesh(spec, devices))

  # ------------------------------------------------------------------ start-up

  def check_replication(self, model: nnx.Module, max_fraction: float) -> None:
    """Fails when more than `max_fraction` of the parameter bytes would be fully
    replicated on a mesh with more than one fsdp/tensor device.

    Raises:
      ValueError: naming config.mesh.max_replicated_fraction and the replicated share.
    """
    try:
      sharding.assert_params_sufficiently_sharded(model, self.mesh, self.rules, max_fraction)
    except ValueError as e:
      raise ValueError(f"config.mesh.max_replicated_fraction={max_fraction}: {e}") from None

  def trees_bucket(self, trees: int, num_minibatches: int = 1) -> int:
    """Trees per packed batch: `trees` rounded up so that every PPO minibatch splits
    evenly over the tree shards ([B] with B % (num_minibatches * tree_shards) == 0).
    On one device: `trees`, unchanged."""
    step = num_minibatches * self.tree_shards
    return trees if self.tree_shards == 1 else -(-trees // step) * step

  def tree_buckets(self, largest: int = 1 << 16) -> tuple[int, ...] | None:
    """Trees buckets for batches of any size that split over the tree shards (the APPO
    scorer's): None (the exact count) on one shard, else the shard count times powers of
    two up to `largest`."""
    if self.tree_shards == 1:
      return None
    return tuple(self.tree_shards << i for i in range(largest.bit_length())
                 if self.tree_shards << i <= largest)

  def geometry(self, trees_per_step: int, bucket: int) -> str:
    """One line for the log: trees per step -> per host -> per device."""
    hosts = jax.process_count()
    return (f"batch geometry: {trees_per_step} trees per step (packed to {bucket}) -> "
            f"{bucket // hosts} per host ({hosts} host(s)) -> {bucket // self.tree_shards} per "
            f"device on mesh {dict(self.mesh.shape)}")

  # ------------------------------------------------------------------ placement

  def state_shardings(self, state: ppo.TrainState) -> ppo.TrainState:
    """A TrainState of NamedShardings (same graphdef), by the logical-axis rules."""
    return sharding.state_shardings(state, self.mesh, self.rules)

  def put(self, tree: Any, shardings: Any) -> Any:
    """`tree` on `shardings` (a matching tree, or one sharding for every leaf). In one
    process: `jax.device_put`. Over several, every process holds the same host value and
    moves only the slices of its own devices; leaves already on their sharding stay."""
    if jax.process_count() == 1:
      return jax.device_put(tree, shardings)

    def put_leaf(x, s):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, s)  # already global: a reshard (a no-op when in place)
      host = np.asarray(x)  # this process's full copy
      # The explicit placement, which JAX's transfer guard counts as implicit (the trainer
      # runs its updates under one, `rl_step.ShapeFitter.wrap`).
      with jax.transfer_guard_host_to_device("allow"):
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, jax.sharding.Sharding):
      return treedef.unflatten([put_leaf(x, shardings) for x in leaves])
    # The sharding tree has a NamedSharding where `tree` has a Variable (its one child).
    return treedef.unflatten([put_leaf(x, s) for x, s in zip(leaves, jax.tree.leaves(shardings),
                                                              strict=True)])

  def place_state(self, state: ppo.TrainState) -> ppo.TrainState:
    """`state` on its shardings by the logical-axis rules (as is on one device)."""
    if not self.sharded:
      return state
    return self.put(state, self.state_shardings(state))

  def place_batch(self, batch: TreeBatch) -> TreeBatch:
    """The batch's trees split over the tree shards ([B, ...] -> [B / shards, ...] each).

    Raises:
      ValueError: B is not a multiple of `tree_shards` (pack with `trees_bucket`).
    """
    if not self.sharded:
      return batch
    b = batch.tokens.shape[0]
    if b % self.tree_shards:
      raise ValueError(f"a batch of {b} trees does not split over the mesh's data x fsdp = "
                       f"{self.tree_shards} devices; pack with Placement.trees_bucket")
    return self.put(batch, self.batch_sharding)

  def rollout_model(self, model: nnx.Module) -> nnx.Module:
    """The sampler's copy of `model`: gathered whole onto the mesh's first device (over
    several processes: onto this process's first mesh device, on every process)."""
    if not self.sharded:
      return model
    graphdef, state = nnx.split(model)
    if jax.process_count() == 1:
      first = SingleDeviceSharding(self.mesh.devices.flat[0])
      return nnx.merge(graphdef, jax.device_put(state, first))
    # An all-gather to every device, then each process keeps its first device's copy.
    whole = jax.jit(lambda s: s, out_shardings=NamedSharding(self.mesh, PartitionSpec()))(state)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.addressable_data(0), whole))

  # ------------------------------------------------------------------ jitted steps

  def _placed(self, make_jit: Callable[[Any, Any], Callable]) -> Callable:
    """`step(state, batch, *rest)` jitted with the state's and the batch's shardings as
    in/out shardings: one jit per graphdef (a blockwise model's graph is refitted per
    batch bound, and the sharding tree carries the graphdef)."""
    if not self.sharded:
      return make_jit(None, None)
    jitted: dict[Any, Callable] = {}

    def step(state, batch, *rest):
      shardings = self.state_shardings(state)
      if state.graphdef not in jitted:
        jitted[state.graphdef] = make_jit(shardings, self.batch_sharding)
      # A state built outside (optimizer re-init, restore) moves to its layout here;
      # already-placed arrays are not copied.
      return jitted[state.graphdef](self.put(state, shardings), self.place_batch(batch), *rest)

    return step

  def update_step(self, config: ppo.PPOConfig, optimizer: optax.GradientTransformation
                  ) -> Callable:
    """`ppo.jit_update_step` on this mesh: `(state, batch, rng) -> (state, metrics)`."""
    return self._placed(lambda s, b: ppo.jit_update_step(config, optimizer, s, b))

  def sft_step(self, optimizer: optax.GradientTransformation, logprob_chunk: int) -> Callable:
    """`sft.jit_sft_step` on this mesh: `(state, batch) -> (state, metrics)`."""
    return self._placed(lambda s, b: sft.jit_sft_step(optimizer, logprob_chunk, s, b))
