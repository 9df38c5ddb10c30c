"""The advantage-estimator registry and its output type.

Every estimator is a pure function `fn(batch, config, **inputs) -> Advantages`
registered under an `AdvEstimator` member together with its frozen config
dataclass (paper defaults) and the names of any extra per-token inputs it
needs (APPO: the current policy's log-probs and entropies). Config validation
reads this registry, so the Enum and the implementations cannot drift.

Output contract. The dense advantage `node_leaf[b, n, k]` (`Advantages.dense`) is the
advantage of the policy tokens of node n *as part of leaf k's root-to-leaf sequence*: 0
when n is not on k's path and on prompt/env nodes. A per-(node, leaf) value is what
makes the tree loss equal the flattened-leaf loss for every method: GRPO over the leaves
of a tree gives a shared prefix a different advantage in each sequence it belongs to, and
PORTool's Theorem 3.1 weight omega_2 depends on the sequence (|tau_j|). Most methods need
less: a value per leaf (GRPO and its relatives, AWPO) or per node (TreeRPO), and return
that ([B, K] or [B, N]); the loss expands it along each leaf's path. `token_scale` is a
positive per-token multiplier (APPO's 1 + b * A_fut); it is None for every other method,
meaning all ones, so cheap estimators never write an `[B, L]` array. `leaf_mask` says
which sequences are trained (APPO: the initial rollouts only).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from tree_rl.tree.batch import TreeBatch
from tree_rl.tree import derived
from tree_rl.tree.derived import TreeStructure
from tree_rl.tree.types import Array, Bool, Float


class AdvEstimator(str, enum.Enum):
  GRPO = "grpo"
  DR_GRPO = "dr_grpo"
  DAPO = "dapo"
  RLOO = "rloo"
  ARPO = "arpo"
  TREE_GRPO = "tree_grpo"
  TREE_RPO = "tree_rpo"
  PORTOOL = "portool"
  APPO = "appo"
  AWPO = "awpo"

  @classmethod
  def _missing_(cls, value):
    raise ValueError(
        f"unknown advantage estimator {value!r}; valid: {[m.value for m in cls]}"
    )


@flax.struct.dataclass
class Advantages:
  """An estimator's output, in the cheapest of three forms (exactly one is set):

  leaf_values [B, K]: one value per sequence, on every policy node of its path (GRPO and the
    other group baselines, AWPO); node_values [B, N]: one value per policy node, the same in
    every sequence through it (TreeRPO, ARPO hard); node_leaf [B, N, K]: the general form
    (PORTool, APPO). `dense()` expands any form to [B, N, K]; the loss does that itself, so
    an estimator whose value is per leaf costs O(K) and never touches the tree structure.
  """

  leaf_mask: Bool[Array, "B K"]
  node_leaf: Float[Array, "B N K"] | None = None
  leaf_values: Float[Array, "B K"] | None = None
  node_values: Float[Array, "B N"] | None = None
  token_scale: Float[Array, "B L"] | None = None  # None: all ones
  metrics: dict[str, Float[Array, ""]] = flax.struct.field(default_factory=dict)
  # Method-specific arrays the loss or the logs need (PORTool's trajectory and
  # fork parts for the two-term surrogate, AWPO's batch clip radius).
  extras: dict[str, Array] = flax.struct.field(default_factory=dict)

  def dense(self, st: TreeStructure | TreeBatch) -> Float[Array, "B N K"]:
    """node_leaf [B, N, K], whichever form the estimator returned: a leaf or node value on
    the policy nodes of each trained leaf's path, 0 elsewhere. `st`: the batch's structure
    (or the batch, whose structure is then derived)."""
    forms = [f for f in ("node_leaf", "leaf_values", "node_values")
             if getattr(self, f) is not None]
    if len(forms) != 1:
      raise ValueError(f"Advantages needs exactly one of node_leaf, leaf_values, node_values;"
                       f" got {forms or 'none'}")
    if self.node_leaf is not None:
      return self.node_leaf
    if isinstance(st, TreeBatch):
      st = derived.structure(st)
    values = (self.leaf_values[:, None, :] if self.leaf_values is not None
              else self.node_values[:, :, None])
    on = st.leaves_under & st.is_policy[:, :, None] & self.leaf_mask[:, None, :]
    return jnp.where(on, values, 0.0)

  def token_scale_or_ones(self, shape: tuple[int, int]) -> Float[Array, "B L"]:
    """`token_scale` as an array (ones when the method has none)."""
    return jnp.ones(shape) if self.token_scale is None else self.token_scale

  @staticmethod
  def from_leaf_values(
      leaf_valid: Bool[Array, "B K"],
      leaf_adv: Float[Array, "B K"],
      leaf_mask: Bool[Array, "B K"] | None = None,
      **kw,
  ) -> "Advantages":
    """Each leaf's advantage on every policy node of its path (0 on untrained leaves)."""
    mask = leaf_valid if leaf_mask is None else leaf_valid & leaf_mask
    return Advantages(leaf_values=jnp.where(mask, leaf_adv, 0.0), leaf_mask=mask, **kw)

  @staticmethod
  def from_node_values(
      leaf_valid: Bool[Array, "B K"],
      node_adv: Float[Array, "B N"],
      leaf_mask: Bool[Array, "B K"] | None = None,
      **kw,
  ) -> "Advantages":
    """One advantage per policy node, the same in every sequence through it."""
    mask = leaf_valid if leaf_mask is None else leaf_valid & leaf_mask
    return Advantages(node_values=node_adv, leaf_mask=mask, **kw)


def check_choice(owner: str, name: str, value, valid) -> None:
  """Config validation: `owner.name` must be one of `valid` (listed in the error)."""
  if value not in valid:
    raise ValueError(f"{owner}.{name}={value!r} is not valid; choose one of {list(valid)}")


def check_reward_channels(owner: str, channels) -> None:
  """`owner.reward_channels`, the leaf reward channels an estimator sums into its outcome
  reward R, must be a non-empty tuple of names (a tuple: configs are static, hashed jit
  arguments)."""
  if not (isinstance(channels, tuple) and channels
          and all(isinstance(c, str) and c for c in channels)):
    raise ValueError(f"{owner}.reward_channels must be a non-empty tuple of leaf reward "
                     f"channel names, got {channels!r}")


@dataclasses.dataclass(frozen=True)
class Registered:
  name: AdvEstimator
  fn: Callable[..., Advantages]
  config_cls: type
  inputs: tuple[str, ...]  # extra keyword inputs, e.g. ("logp", "entropy")


_REGISTRY: dict[AdvEstimator, Registered] = {}


def register(name: AdvEstimator, config_cls: type, inputs: tuple[str, ...] = ()):
  """Decorator: registers `fn(batch, config, **inputs) -> Advantages`.

  Every estimator's config names the leaf reward channels its outcome reward R sums, in a
  field `reward_channels` (dynamic sampling and the logs read R through it).
  """
  if "reward_channels" not in {f.name for f in dataclasses.fields(config_cls)}:
    raise TypeError(f"{config_cls.__name__} (estimator {name!s}) has no reward_channels field")

  def deco(fn):
    if name in _REGISTRY:
      raise ValueError(f"advantage estimator {name.value!r} registered twice")
    _REGISTRY[name] = Registered(AdvEstimator(name), fn, config_cls, tuple(inputs))
    return fn

  return deco


def get(name: AdvEstimator | str) -> Registered:
  key = AdvEstimator(name)
  if key not in _REGISTRY:
    raise ValueError(
        f"advantage estimator {key.value!r} has no implementation; registered:"
        f" {sorted(k.value for k in _REGISTRY)}"
    )
  return _REGISTRY[key]


def registered() -> list[AdvEstimator]:
  return sorted(_REGISTRY, key=lambda k: list(AdvEstimator).index(k))


def make_config(name: AdvEstimator | str, **overrides: Any):
  """The estimator's config with paper defaults, overridden by `overrides`.

  Unknown keys fail listing the valid ones. A list becomes a tuple (configs are static,
  hashable jit arguments, and a config.json round trip turns their tuples into lists).
  """
  overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
  entry = get(name)
  fields = {f.name for f in dataclasses.fields(entry.config_cls)}
  bad = sorted(set(overrides) - fields)
  if bad:
    raise ValueError(
        f"unknown option(s) {bad} for estimator {entry.name.value!r}; valid: {sorted(fields)}"
    )
  return entry.config_cls(**overrides)


@functools.partial(jax.jit, static_argnames=("name", "config"))
def _compute(batch, name, config, inputs):
  return get(name).fn(batch, config, **inputs)


def compute_advantages(
    name: AdvEstimator | str, batch: TreeBatch, config: Any = None, **inputs: Array
) -> Advantages:
  """Runs a registered estimator under jit (one compile per shape and config)."""
  entry = get(name)
  config = entry.config_cls() if config is None else config
  if not isinstance(config, entry.config_cls):
    raise TypeError(
        f"estimator {entry.name.value!r} takes a {entry.config_cls.__name__}, got"
        f" {type(config).__name__}"
    )
  missing = sorted(set(entry.inputs) - set(inputs))
  extra = sorted(set(inputs) - set(entry.inputs))
  if missing or extra:
    raise ValueError(
        f"estimator {entry.name.value!r} takes inputs {list(entry.inputs)};"
        f" missing {missing}, unexpected {extra}"
    )
  return _compute(batch, entry.name, config, inputs)
