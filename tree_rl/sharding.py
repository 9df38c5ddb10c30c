"""Mesh axes and logical-axis rules, declared once.

Model code names axes only (`logical_axes` metadata on every parameter:
"vocab", "embed", "q_heads", "kv_heads", "mlp", "layers", "norm", "lora");
these rules map each logical name to mesh axes. Training uses FSDP over
`fsdp` (weights sharded along their embed dimension) and tensor parallelism
over `tensor`; batches split over `data` and `fsdp`. The rollout variant
drops FSDP so the sampler reads whole weights without an all-gather per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or None: replicated along that dimension)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("lora", None),
    ("tree", ("data", "fsdp")),  # activations: trees of a batch
)


def rollout_rules(rules=LOGICAL_AXIS_RULES):
  """The same rules without FSDP (weights whole on every data shard)."""
  return tuple((name, None if axis == "fsdp" else axis) for name, axis in rules)


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh; -1 in one axis takes the remaining devices.

  The default puts every device on `fsdp`.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = dict(shape or {"data": 1, "fsdp": -1, "tensor": 1})
  bad = sorted(set(shape) - set(MESH_AXES))
  if bad:
    raise ValueError(f"unknown mesh axes {bad}; valid: {list(MESH_AXES)}")
  sizes = [shape.get(a, 1) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {shape}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices,"
                     f" have {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], rules=LOGICAL_AXIS_RULES) -> P:
  table = dict(rules)
  unknown = [a for a in axes if a is not None and a not in table]
  if unknown:
    raise ValueError(f"logical axes {unknown} have no rule; rules cover {sorted(table)}")
  out, used = [], set()
  for a in axes:
    axis = None if a is None else table[a]
    flat = axis if isinstance(axis, tuple) else (axis,)
    if axis is not None and used & set(flat):  # a mesh axis may shard one dimension only
      axis = None
    used |= {x for x in flat if x is not None}
    out.append(axis)
  return P(*out)


def _spec_for(var: nnx.Variable, mesh: Mesh, rules) -> P:
  axes = getattr(var, "logical_axes", None)
  value = var.get_value()
  if axes is None:
    return P()
  spec = list(logical_to_spec(axes, rules))
  # A dimension the mesh axis does not divide stays replicated (e.g. 3 kv heads on 2 devices).
  for i, axis in enumerate(spec):
    if axis is not None:
      size = math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
      if value.shape[i] % size:
        spec[i] = None
  return P(*spec)


def state_shardings(state, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
  """NamedSharding for every leaf of a pytree of nnx Variables and plain arrays.

  A Variable is placed by its `logical_axes` (optimizer moments keep their parameter's
  Variable and metadata, so they shard like it); a plain array (a step or optimizer
  counter) and a Variable without logical axes are replicated.
  """
  def one(x):
    return NamedSharding(mesh, _spec_for(x, mesh, rules) if isinstance(x, nnx.Variable) else P())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def partition_specs(model: nnx.Module, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> dict[str, str]:
  """`path -> str(PartitionSpec)` of every parameter (for the committed dump test)."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    out["/".join(map(str, path))] = str(tuple(_spec_for(var, mesh, rules)))
  return dict(sorted(out.items()))


def shard_model(model: nnx.Module, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> nnx.Module:
  """Places every parameter of `model` on `mesh` by its logical axes (in place)."""
  state = nnx.state(model)
  shardings = state_shardings(state, mesh, rules)
  nnx.update(model, jax.device_put(state, shardings))
  return model


def replicated_fraction(model: nnx.Module, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> float:
  """Fraction of parameter bytes that would be fully replicated under `rules`."""
  total = repl = 0
  for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    v = var.get_value()
    nbytes = int(np.prod(v.shape)) * v.dtype.itemsize
    total += nbytes
    axes = [a for e in _spec_for(var, mesh, rules) if e is not None
            for a in (e if isinstance(e, tuple) else (e,))]
    if math.prod(mesh.shape[a] for a in axes) == 1:  # on size-1 axes only: a full copy per device
      repl += nbytes
  return repl / max(total, 1)


def assert_params_sufficiently_sharded(model: nnx.Module, mesh: Mesh, rules=LOGICAL_AXIS_RULES,
                                       max_replicated: float = 0.1) -> None:
  """Fails when more than `max_replicated` of the parameter bytes are replicated
  on a mesh with more than one fsdp/tensor device (a rules or metadata bug)."""
  if mesh.shape["fsdp"] * mesh.shape["tensor"] == 1:
    return
  frac = replicated_fraction(model, mesh, rules)
  if frac > max_replicated:
    raise ValueError(
        f"{frac:.0%} of parameter bytes are replicated on mesh {dict(mesh.shape)}"
        f" (limit {max_replicated:.0%}): check LOGICAL_AXIS_RULES and the parameters'"
        " logical_axes")
