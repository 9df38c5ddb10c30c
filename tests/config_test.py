"""The typed config (`tree_rl.config_types`) against the configs users run (`configs/`)."""

import dataclasses
import importlib
import json
import pathlib

import pytest

from configs import common
from tree_rl.config_types import ModelSpec, RunConfig
from tree_rl.rollout.strategies import STRATEGIES, make_strategy
from tree_rl.rollout.strategies.base import (GENERIC_FIELDS, BranchingStrategy, register,
                                             strategy_options)


def test_defaults_are_written_once():
  # base_config is the typed defaults, so a RunConfig built from a partial dict runs the
  # model a real config runs (they once disagreed on remat and the attention).
  assert common.base_config().to_dict() == RunConfig.defaults()
  assert RunConfig.from_config_dict({}) == RunConfig.from_config_dict(common.base_config())
  spec = ModelSpec()
  assert (spec.remat, spec.attention) == (True, "blockwise")
  assert set(RunConfig.defaults()) == {f.name for f in dataclasses.fields(RunConfig) if f.init}


# A compatible estimator for each strategy (the config checks some pairs).
_ESTIMATOR = {"flat": "grpo", "portool": "portool", "appo": "appo", "arpo": "arpo",
              "trace": "tree_rpo", "random": "tree_grpo"}
_SET = {"samples_per_task": 3, "max_turns": 2}  # both differ from the defaults


@pytest.mark.parametrize("field", GENERIC_FIELDS)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_generic_rollout_field_changes_the_strategy_or_fails_at_start_up(name, field):
  assert set(_ESTIMATOR) == set(STRATEGIES)
  assert RunConfig.defaults()["rollout"][field] != _SET[field]
  c = common.base_config()
  c.rollout.strategy, c.algo.estimator = name, _ESTIMATOR[name]
  c.rollout[field] = _SET[field]
  option = STRATEGIES[name].generic_fields.get(field)
  if option is None or (name == "appo" and field == "samples_per_task"):
    # Not read (or, for APPO's N, not where it is set: its n_init is the estimator's).
    with pytest.raises(ValueError, match=rf"config\.rollout\.{field}=.*strategy '{name}'"):
      RunConfig.from_config_dict(c)
    return
  cfg = RunConfig.from_config_dict(c)
  if option:  # the strategy's own option takes the field's value
    strategy = make_strategy(name, **strategy_options(cfg.rollout, cfg.seed))
    assert getattr(strategy, option) == _SET[field]
  else:  # the agent loop's turn limit
    assert cfg.max_turns() == _SET[field]


def test_every_strategy_answers_the_trainer_one_way():
  # What the trainer, the checkpoint and the logs ask of a strategy is the base class's,
  # so none of them probes for attributes; a class that is not one cannot register.
  for name, cls in STRATEGIES.items():
    assert issubclass(cls, BranchingStrategy) and cls.name == name
    strategy = make_strategy(name)
    assert dict(strategy.last_metrics) == {}, name  # nothing rolled out yet
    assert strategy.branches_between_updates == (name == "appo"), name  # APPO's default
    state = strategy.state_dict()
    assert (state is None) == (name != "trace"), name  # only TRACE learns (its predictor)
    if state is None:
      with pytest.raises(ValueError, match=f"strategy '{name}' learns no state"):
        strategy.load_state_dict({"meta": {}, "arrays": None})
  assert not make_strategy("appo", branch_timing="per_step").branches_between_updates
  with pytest.raises(TypeError, match="'duck' must subclass BranchingStrategy"):
    register("duck")(type("Duck", (), {"generic_fields": {}}))
  assert "duck" not in STRATEGIES


def _scorer(trees):
  """A stand-in for the current policy's scorer (`model_scorer`)."""
  return []


def test_a_strategy_builds_itself_from_the_run():
  # One constructor for the trainer and the workers (`from_run`): the config's options,
  # plus what the run builds for the strategies that need it.
  from tree_rl.algos import registry
  from tree_rl.rollout.strategies.base import RunContext, strategy_for_run
  for name in sorted(STRATEGIES):
    c = common.base_config()
    c.rollout.strategy, c.algo.estimator = name, _ESTIMATOR[name]
    cfg = RunConfig.from_config_dict(c)
    run = RunContext(cfg.algo.estimator, cfg.estimator_config(), vocab_size=64,
                     scorer=lambda: _scorer)
    strategy = strategy_for_run(cfg.rollout, cfg.seed, run)
    assert type(strategy) is STRATEGIES[name]
    if name == "appo":  # APPO's estimator config and the current policy's scorer
      assert strategy.config is run.estimator_config
      assert strategy.current_logprobs is _scorer
      worker = strategy_for_run(cfg.rollout, cfg.seed)  # no run: the behaviour log-probs
      assert worker.current_logprobs is None
    elif name == "trace":
      assert type(strategy.predictor).__name__ == "RunningMeanPredictor"
    else:
      assert strategy == make_strategy(name, **strategy_options(cfg.rollout, cfg.seed))
  c = common.base_config()
  c.rollout.strategy, c.algo.estimator = "appo", "grpo"  # APPO's branching, GRPO's advantages
  cfg = RunConfig.from_config_dict(c)
  strategy = strategy_for_run(cfg.rollout, cfg.seed, RunContext("grpo", cfg.estimator_config()))
  assert strategy.config == registry.make_config("appo")


def test_one_quantity_set_twice_differently_fails_and_alike_passes():
  c = common.base_config()
  c.rollout.samples_per_task, c.rollout.strategy_kwargs = 3, {"n": 5}
  with pytest.raises(ValueError, match=r"samples_per_task=3 but strategy 'flat'.s n=5"):
    RunConfig.from_config_dict(c)
  c.rollout.strategy_kwargs = {"n": 3}
  RunConfig.from_config_dict(c)
  # APPO's N is its estimator's n_init: samples_per_task may restate it, not contradict it.
  c = common.base_config()
  c.rollout.strategy, c.algo.estimator = "appo", "appo"
  c.rollout.samples_per_task, c.algo.estimator_kwargs = 2, {"n_init": 2, "budget": 4}
  RunConfig.from_config_dict(c)
  c.algo.estimator_kwargs = {"n_init": 4, "budget": 16}
  with pytest.raises(ValueError, match=r"samples_per_task=2 but strategy 'appo'.s n_init=4"):
    RunConfig.from_config_dict(c)


@pytest.mark.parametrize("name", ["apppo", "arpo", "awpo", "dapo", "grpo", "portool", "trace",
                                  "tree_grpo"])
@pytest.mark.parametrize("arg", [None, "runlocal", "preset=cpu"])
def test_every_shipped_config_builds(name, arg):
  module = importlib.import_module(f"configs.{name}")
  RunConfig.from_config_dict(module.get_config(arg))


TOOLWORLD_CONFIGS = ["apppo", "arpo", "dapo", "grpo", "portool", "tree_grpo"]


def _get(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config.to_dict() if hasattr(config, "to_dict") else config


def test_the_cpu_preset_gives_every_config_the_main_jobs_recipe_and_keeps_its_method():
  """`:preset=cpu`: tool-world configs take the README main job's whole setup at 2 prompts
  a step on PORTool's reward; other families its recipe alone; each keeps its method."""
  main = importlib.import_module("configs.apppo").get_config(
      "prompts=2,steps=5,reward=portool,timing=per_minibatch")
  toolworld, other = common.PRESETS["cpu"]["toolworld"], common.PRESETS["cpu"]["other"]
  assert set(other) < set(toolworld)
  for name in TOOLWORLD_CONFIGS + ["awpo", "trace"]:
    own = importlib.import_module(f"configs.{name}").get_config()
    config = importlib.import_module(f"configs.{name}").get_config("preset=cpu")
    fields = toolworld if config.task.family == "toolworld" else other
    for field, value in fields.items():
      expected = value if field in ("eval_base", "task.eval_seed") else _get(main, field)
      assert _get(config, field) == expected, (name, field)
    for field in ("algo.estimator", "algo.estimator_kwargs", "algo.loss", "rollout.strategy",
                  "rollout.samples_per_task", "task.family"):
      assert _get(config, field) == _get(own, field) or name == "apppo", (name, field)
    if config.task.family != "toolworld":  # its own task shape and memory setting
      assert (config.task.kwargs.to_dict(), config.model.remat) == ({}, own.model.remat)
  assert common.PRESETS["cpu"]["toolworld"]["eval_base"] and not main.eval_base
  # APPO's own arguments default to the preset's budget, reward and timing there.
  appo = importlib.import_module("configs.apppo").get_config("preset=cpu")
  assert appo.rollout.strategy_kwargs.branch_timing == "per_minibatch"
  assert (appo.prompts_per_step, appo.algo.num_minibatches) == (2, 2)
  assert "wrong_outcome" not in appo.task.kwargs


def test_a_configs_own_arguments_win_over_the_preset():
  get = lambda name, arg: importlib.import_module(f"configs.{name}").get_config(arg)
  assert get("grpo", "preset=cpu,steps=9").num_steps == 9
  assert get("grpo", "preset=cpu,group=8").rollout.samples_per_task == 8
  appo = get("apppo", "preset=cpu,prompts=4,reward=gated,timing=per_step")
  assert (appo.prompts_per_step, appo.algo.num_minibatches) == (4, 4)
  assert appo.task.kwargs.to_dict() == dict(tools_per_task=3, difficulties=(1,), max_turns=3,
                                            wrong_outcome=0.0, malformed_outcome=-1.0)
  assert appo.rollout.strategy_kwargs.branch_timing == "per_step"
  small = get("grpo", "preset=cpu,runlocal")  # runlocal shrinks the preset too
  assert (small.model.name, small.num_steps, small.sft.steps) == ("tiny", 2, 1)


@pytest.mark.parametrize("arg, message", [
    ("preset=gpu", r"preset='gpu' is not a preset; valid: \['cpu'\]"),
    ("preset=CPU", r"preset='CPU' is not a preset"),
    ("presets=cpu", r"'presets' is not known"),
])
def test_an_unknown_preset_fails_naming_it(arg, message):
  with pytest.raises(ValueError, match=message):
    importlib.import_module("configs.grpo").get_config(arg)


def test_preset_defaults_name_known_presets_and_arguments():
  assert common.parse_arg("preset=cpu", preset_defaults={"cpu": {"a": 2}}, a=1, preset="").a == 2
  for bad in ({"gpu": {"a": 2}}, {"cpu": {"b": 2}}):
    with pytest.raises(ValueError, match=r"preset_defaults\[.*presets are \['cpu'\]"):
      common.parse_arg("", preset_defaults=bad, a=1, preset="")


def test_override_sets_dotted_fields_and_names_a_bad_path():
  c = importlib.import_module("configs.trace").get_config()
  common.override(c, {"rollout.strategy_kwargs": {"budget": 6, "n_init": 2},
                      "algo.estimator_kwargs.gamma": 0.9, "model.lora_targets": ["q_proj"],
                      "seed": 3})
  assert c.rollout.strategy_kwargs.to_dict() == {"budget": 6, "n_init": 2}
  assert (c.algo.estimator_kwargs.gamma, c.model.lora_targets, c.seed) == (0.9, ("q_proj",), 3)
  for bad, message in [({"optim.lrr.x": 1}, "'optim.lrr' is not a section"),
                       ({"seed.x": 1}, "'seed' is not a section"), ({"a..b": 1}, "dotted")]:
    with pytest.raises(ValueError, match=message):
      common.override(c, bad)


def test_every_committed_run_config_still_builds():
  paths = sorted(pathlib.Path(__file__).parents[1].glob("results/**/config.json"))
  assert paths
  for path in paths:
    RunConfig.from_config_dict(json.loads(path.read_text()))


@pytest.mark.parametrize("name, kwargs, message", [
    ("flat", {"m": 3}, r"unknown option\(s\) \['m'\] for strategy 'flat'; valid: \['n'\]"),
    ("appo", {"current_logprobs": None}, r"unknown option\(s\) \['current_logprobs'\]"),
    ("portool", {"seed": 1}, r"unknown option\(s\) \['seed'\].*the seed is config.seed"),
    ("flat", {"n": 0}, r"strategy_kwargs \(strategy 'flat'\): FlatStrategy.n=0 must be >= 1"),
    ("arpo", {"budget": 1}, r"strategy 'arpo'.*initial_rollouts <= budget"),
])
def test_strategy_options_fail_when_the_config_is_read(name, kwargs, message):
  c = common.base_config()
  c.rollout.strategy, c.algo.estimator = name, _ESTIMATOR[name]
  c.rollout.strategy_kwargs = kwargs
  with pytest.raises(ValueError, match=message):
    RunConfig.from_config_dict(c)


@pytest.mark.parametrize("family, kwargs, message", [
    ("toolworld", {"tools": 3}, r"task.kwargs: unknown option\(s\) \['tools'\] for task family "
     r"'toolworld'; valid: \[.*'tools_per_task'"),
    ("math", {"sandbox_limit": {}}, r"\['sandbox_limit'\] for task family 'math'"),
    ("search_qa", {"hops": (2,), "seed": 1}, r"\['seed'\] for task family 'search_qa'"),
])
def test_task_options_fail_when_the_config_is_read(family, kwargs, message):
  c = common.base_config()
  c.task.family, c.task.kwargs = family, kwargs
  with pytest.raises(ValueError, match=message):
    RunConfig.from_config_dict(c)
  c.task.kwargs = {"tool_latency_s": 0.5}  # every family's own option
  assert RunConfig.from_config_dict(c).task.kwargs == {"tool_latency_s": 0.5}


def test_per_minibatch_branching_is_one_rule_checked_with_the_config():
  # The trainer branches each PPO mini-batch exactly when the config says so
  # (RunConfig.branches_per_minibatch), which is what the strategy it builds does; what
  # that order cannot run with fails when the config is read, before any model is built.
  apppo = importlib.import_module("configs.apppo")
  for timing, nmb, want in [("per_minibatch", 4, True), ("per_step", 4, False),
                            ("per_minibatch", 1, False)]:
    c = apppo.get_config(f"timing={timing}")
    c.algo.num_minibatches = nmb
    cfg = RunConfig.from_config_dict(c)
    strategy = make_strategy("appo", **cfg.rollout.strategy_kwargs)
    assert cfg.branches_per_minibatch() == want
    assert cfg.branches_per_minibatch() == (strategy.branches_between_updates and nmb > 1)
  for field, value, message in [
      ("rollout.dynamic_sampling", True, "dynamic_sampling drops a group"),
      ("algo.num_epochs", 2, "runs one PPO epoch; got config.algo.num_epochs=2"),
      ("prompts_per_step", 6, "prompts_per_step=6 does not split into algo.num_minibatches=4")]:
    c = apppo.get_config("timing=per_minibatch")
    section, _, name = field.rpartition(".")
    setattr(c[section] if section else c, name, value)
    with pytest.raises(ValueError, match=message):
      RunConfig.from_config_dict(c)
    c = apppo.get_config("timing=per_step")
    setattr(c[section] if section else c, name, value)
    if field != "rollout.dynamic_sampling":  # per step, each of these runs
      RunConfig.from_config_dict(c)


def test_rollout_task_ids_pick_the_rl_prompts_from_the_train_split():
  c = common.base_config()
  c.rollout.task_ids = [5, 2]  # a list, as JSON and the absl flags give it
  r = RunConfig.from_config_dict(c).rollout
  assert r.task_ids == (5, 2)
  assert r.rl_tasks(list("abcdefg")) == ["f", "c"]  # in the pool's order
  assert RunConfig.from_config_dict(common.base_config()).rollout.rl_tasks("abc") == list("abc")
  for ids, match in (((1, 1), r"repeats an index \(\[1\]\)"), ((-1,), "ints >= 0"),
                     ((True,), "ints >= 0"),
                     ((256,), r"index 256, but .*num_train_tasks=256")):
    c = common.base_config().to_dict()  # a plain dict, as config.json gives it back
    c["rollout"]["task_ids"] = list(ids)
    with pytest.raises(ValueError, match=rf"config\.rollout\.task_ids.*{match}"):
      RunConfig.from_config_dict(c)
