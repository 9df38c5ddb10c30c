"""JAX's share of GPU memory when the learner and the vLLM generator share one GPU.

JAX preallocates `$XLA_PYTHON_CLIENT_MEM_FRACTION` of each GPU (default 0.75) when its
backend initialises, and reads the variable only then; vLLM then asks for its own
`gpu_memory_utilization` of the same device. `config.rollout.learner_memory_fraction`
and `generator_memory_fraction` (validated in `tree_rl.config_types.RolloutSpec`) set
the two shares. `apply_learner_memory_fraction` puts the learner's share into the
environment before the backend starts (launch/train.py calls it before anything touches
a device, `train_and_evaluate` again at start-up), and fails when a GPU backend already
runs with another share. On CPU the variable has no effect.
"""

from __future__ import annotations

import os

import jax
from absl import logging
from jax._src import xla_bridge  # backends_are_initialized: no public equivalent in JAX

from tree_rl.config_types import MEMORY_BUDGET, RolloutSpec

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_MEM_FRACTION = 0.75  # what JAX preallocates when the variable is unset
_NO_EFFECT_PLATFORMS = ("cpu", "tpu")  # the variable sizes only the GPU allocator


def _env_fraction() -> float:
  """The share JAX reads from the environment (its default when unset)."""
  raw = os.environ.get(MEM_FRACTION_ENV)
  if raw is None:
    return JAX_DEFAULT_MEM_FRACTION
  try:
    return float(raw)
  except ValueError:
    raise ValueError(f"${MEM_FRACTION_ENV}={raw!r} is not a number") from None


def apply_learner_memory_fraction(rollout: RolloutSpec) -> float | None:
  """Sets `$XLA_PYTHON_CLIENT_MEM_FRACTION` to the run's learner share; returns the share.

  Before JAX's backend initialises, the variable is set (a different value already in
  the environment is replaced, with a warning). After, the running backend is checked:
  on CPU (and TPU) the share has no effect, which is logged; on a GPU whose
  allocator was sized from another share this raises, because JAX cannot resize it.
  Returns None (and changes nothing) when the config leaves JAX's default.

  Raises:
    RuntimeError: a GPU backend already initialised with a different share.
  """
  share = rollout.learner_memory_share()
  if share is None:
    return None
  what = (f"config.rollout.learner_memory_fraction={share:g}" if rollout.learner_memory_fraction
          else f"the learner's share {share:g} (config.rollout.learner_memory_fraction=0: "
               f"{MEMORY_BUDGET:g} - generator_memory_fraction="
               f"{rollout.generator_memory_fraction:g})")
  if not xla_bridge.backends_are_initialized():
    current = os.environ.get(MEM_FRACTION_ENV)
    if current is not None and current != f"{share:g}":
      logging.warning("$%s=%s replaced by %s", MEM_FRACTION_ENV, current, what)
    os.environ[MEM_FRACTION_ENV] = f"{share:g}"
    return share
  platform = jax.default_backend()  # the backend is up: asking for it starts nothing
  if platform in _NO_EFFECT_PLATFORMS:
    # Said loudly only when the user set the share; the derived one is the vLLM default.
    log = logging.warning if rollout.learner_memory_fraction else logging.info
    log("%s has no effect on %s (the variable sizes JAX's GPU allocator only)", what, platform)
    return share
  used = _env_fraction()
  if abs(used - share) > 1e-6:
    raise RuntimeError(
        f"JAX's {platform} backend was initialised with {MEM_FRACTION_ENV}={used:g} before "
        f"{what} could apply: JAX reads it once, when the backend starts. Start "
        f"the run with launch/train.py, or set ${MEM_FRACTION_ENV}={share:g} (or call "
        f"tree_rl.device_memory.apply_learner_memory_fraction) before the first JAX device use")
  return share
