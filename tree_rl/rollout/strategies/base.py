"""The BranchingStrategy base class and the registry of strategies by name.

A strategy decides how one `AgentLoop.rollout` call grows its trees: how many
episodes start at each prompt, when and where they fork (between turns, or at a
token position inside a step) and when growth stops. It only drives a
`tree_rl.rollout.branching.Forest` (start / step / fork / branch_at / run);
the Forest owns the engine calls, the tools and the tree bookkeeping, so every
strategy gets the same endings, tags and `check()`-clean trees.

Every strategy subclasses `BranchingStrategy`, which says all that the trainer, the
checkpoint and the logs may ask of one, with defaults for what most strategies lack
(logs, learned state, branching between updates).

Strategies register under the name a config uses (`make_strategy("portool",
fork_factor=3)`); an unknown name fails with the list of valid ones.

Two of config.rollout's fields mean something only to some strategies
(`GENERIC_FIELDS`). Each strategy class declares the ones it reads in
`generic_fields`: field -> the strategy's own option for the same quantity ("" when
the agent loop reads the field itself). `strategy_options` fills those options from
the fields; `check_generic_fields` refuses a field set for a strategy that does not
read it, or set to one value while the strategy's option says another.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from tree_rl.rollout.branching import Forest


class BranchingStrategy(abc.ABC):
  """How the trees of one rollout call grow.

  Attributes:
    name: the registry name (set by `register`).
    generic_fields: the `GENERIC_FIELDS` it reads, each -> its own option for that
      quantity ("" when the agent loop reads the field itself).
  """

  name: ClassVar[str] = ""
  generic_fields: ClassVar[Mapping[str, str]]

  @abc.abstractmethod
  def grow(self, forest: Forest) -> None:
    """Grows every tree of `forest`; every branch started must end (or be discarded)."""

  @abc.abstractmethod
  def leaves_per_task(self) -> int | None:
    """Leaves each tree gets when nothing is dropped (the rollout budget), None if it varies."""

  @property
  def branches_between_updates(self) -> bool:
    """True when the trainer is to grow a step's trees in parts: `initial(forest)` before
    the step's updates, then `branch(forest, trees)` for each PPO mini-batch's trees with
    the policy after the previous mini-batch's update (APPO's per-mini-batch timing)."""
    return False

  @property
  def last_metrics(self) -> Mapping[str, float]:
    """Logs of the last rollout call, which the trainer writes each step (none here)."""
    return {}

  def state_dict(self) -> dict[str, Any] | None:
    """What the strategy learns during a run (TRACE's success predictor), saved with each
    checkpoint as {"meta": JSON, "arrays": arrays or None}; None: nothing is learned."""
    return None

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Loads what `state_dict` returned."""
    raise ValueError(f"strategy {self.name!r} learns no state, so it loads none")

  @classmethod
  def from_run(cls, rollout: Any, seed: int, run: RunContext | None = None
               ) -> BranchingStrategy:
    """The strategy a run's config asks for: `strategy_options(rollout, seed)`, plus what
    the run builds (`run`: APPO's advantage config and current-policy scorer, TRACE's
    predictor over the policy's vocabulary). Without `run`, only the config's options (a
    rollout worker's strategy)."""
    del run  # most strategies take nothing from the run
    return cls(**strategy_options(rollout, seed))


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What a training run gives its strategy beyond the config's options.

  Attributes:
    estimator: config.algo.estimator (APPO's strategy shares APPO's advantage config).
    estimator_config: that estimator's config object.
    scorer: builds the current policy's scorer (`model_scorer`); called only by a strategy
      that scores with the current policy.
    vocab_size: the policy's vocabulary (TRACE's value-head predictor embeds tokens).
  """

  estimator: str
  estimator_config: Any
  scorer: Callable[[], Any] | None = None
  vocab_size: int | None = None


STRATEGIES: dict[str, type] = {}

# config.rollout's fields whose meaning depends on the strategy: the episodes each prompt
# starts from (a group's size N) and the assistant turns an episode may take.
GENERIC_FIELDS = ("samples_per_task", "max_turns")


def register(name: str) -> Callable[[type], type]:
  """Class decorator: registers a strategy class under `name` and sets its `name`."""

  def wrap(cls: type) -> type:
    if name in STRATEGIES:
      raise ValueError(f"strategy {name!r} is already registered")
    if not issubclass(cls, BranchingStrategy):
      raise TypeError(f"strategy {name!r} must subclass BranchingStrategy")
    unknown = sorted(set(getattr(cls, "generic_fields", ())) - set(GENERIC_FIELDS))
    if not hasattr(cls, "generic_fields") or unknown:
      raise TypeError(f"strategy {name!r} must declare generic_fields, a mapping from some "
                      f"of {GENERIC_FIELDS} to its own options; got unknown {unknown}")
    cls.name = name
    STRATEGIES[name] = cls
    return cls

  return wrap


def strategy_for_run(rollout: Any, seed: int, run: RunContext | None = None
                     ) -> BranchingStrategy:
  """`rollout.strategy`'s class built by its `from_run`."""
  if rollout.strategy not in STRATEGIES:
    raise ValueError(f"unknown branching strategy {rollout.strategy!r}; valid: "
                     f"{sorted(STRATEGIES)}")
  return STRATEGIES[rollout.strategy].from_run(rollout, seed, run)


def make_strategy(name: str, **kwargs: Any) -> BranchingStrategy:
  """The strategy registered as `name`, built with `kwargs` (its documented knobs)."""
  if name not in STRATEGIES:
    raise ValueError(f"unknown branching strategy {name!r}; valid: {sorted(STRATEGIES)}")
  return STRATEGIES[name](**kwargs)


def _init_fields(cls: type) -> set[str]:
  return {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(
      cls) else set()


def strategy_options(rollout: Any, seed: int) -> dict[str, Any]:
  """The options `make_strategy(rollout.strategy, ...)` gets from a config's rollout section:
  `strategy_kwargs`, then each generic field the strategy reads filling the option it names
  (unless strategy_kwargs sets it), then the run's seed for a strategy that takes one.
  Objects built at run time (a scorer, a predictor) are the trainer's to add."""
  cls = STRATEGIES[rollout.strategy]
  kw = dict(rollout.strategy_kwargs)
  fields = _init_fields(cls)
  for field, option in cls.generic_fields.items():
    if option in fields:
      kw.setdefault(option, getattr(rollout, field))
  if "seed" in fields:
    kw.setdefault("seed", seed)
  return kw


# Options only the trainer fills, with objects it builds at run time; a config cannot set them.
RUNTIME_OPTIONS = {"appo": ("config", "current_logprobs"), "random": ("reference",)}
# Config options the trainer turns into objects: the name stays a string in the config.
BUILT_OPTIONS = {"trace": ("predictor", "predictor_kwargs")}


def check_strategy_options(rollout: Any, seed: int) -> None:
  """Builds `rollout.strategy` from `strategy_options` once, so a bad option fails when the
  config is read (naming config.rollout.strategy_kwargs), not after the model is built."""
  name = rollout.strategy
  cls = STRATEGIES[name]
  kw = dict(rollout.strategy_kwargs)
  runtime, built = RUNTIME_OPTIONS.get(name, ()), BUILT_OPTIONS.get(name, ())
  valid = sorted(_init_fields(cls) - set(runtime) - {"seed"})
  bad = sorted(set(kw) - set(valid) - set(built))
  if bad:
    raise ValueError(f"config.rollout.strategy_kwargs: unknown option(s) {bad} for strategy "
                     f"{name!r}; valid: {sorted(set(valid) | set(built))} (the seed is "
                     f"config.seed)")
  options = {k: v for k, v in strategy_options(rollout, seed).items() if k not in built}
  try:
    make_strategy(name, **options)
  except (ValueError, TypeError) as e:
    raise ValueError(f"config.rollout.strategy_kwargs (strategy {name!r}): {e}") from None


def check_generic_fields(strategy: str, values: Mapping[str, Any], defaults: Mapping[str, Any],
                         options: Mapping[str, Any]) -> None:
  """Fails, naming the field and the strategy, when one of `GENERIC_FIELDS` is set (`values`
  differs from `defaults`) but `strategy` does not read it, or when the strategy's own option
  for it is set in `options` to another value (one quantity, two settings)."""
  cls = STRATEGIES[strategy]
  for field in GENERIC_FIELDS:
    value = values[field]
    if value == defaults[field]:
      continue
    if field not in cls.generic_fields:
      reads = sorted(cls.generic_fields) or "none"
      raise ValueError(
          f"config.rollout.{field}={value!r} is not read by strategy {strategy!r} (of "
          f"{list(GENERIC_FIELDS)} it reads {reads}); remove it, or set what the strategy "
          f"reads instead (config.rollout.strategy_kwargs: {cls.__name__}'s options)")
    option = cls.generic_fields[field]
    if option and option in options and options[option] != value:
      raise ValueError(
          f"config.rollout.{field}={value!r} but strategy {strategy!r}'s {option}="
          f"{options[option]!r}: they are one quantity; set one of them, or both alike")
