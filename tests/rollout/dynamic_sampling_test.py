"""DAPO's dynamic sampling (arXiv 2503.14476 §3.2) as a host loop: fake rollouts whose
groups are mixed or flat by construction, hand-counted rounds, prompts and logs; the
keep rule against `grpo.dapo_keep_mask`; `rollout_step`'s per-round bookkeeping."""

import dataclasses

import numpy as np
import pytest

from tree_rl.algos import grpo, registry
from tree_rl.rollout import dynamic_sampling as ds
from tree_rl.tree import Buckets, NodeKind, RolloutTree, pack

P = ds.PREFIX


def _fake(mixed_at):
  """A rollout over integer "tasks" (data offsets): the group of task i is the string
  "mix i" or "flat i"; every call is recorded as (round, tasks)."""
  calls = []

  def rollout(round_, tasks):
    calls.append((round_, list(tasks)))
    return [f"{'mix' if mixed_at(i) else 'flat'} {i}" for i in tasks]

  return rollout, calls


def _tasks(offset, n):
  return list(range(offset, offset + n))


def _keep(group):
  return group.startswith("mix")


def test_half_flat_step_is_refilled_from_the_next_prompts():
  # Data order 0..: even offsets mixed, odd flat. Round 0 (0-3) keeps 0, 2; round 1 rolls
  # the 2 missing (4, 5) and keeps 4; round 2 rolls 1 (6) and keeps it.
  rollout, calls = _fake(lambda i: i % 2 == 0)
  res = ds.resample_mixed(rollout, _tasks, target=4, keep=_keep, max_extra_rounds=5)
  assert calls == [(0, [0, 1, 2, 3]), (1, [4, 5]), (2, [6])]
  assert res.kept == ["mix 0", "mix 2", "mix 4", "mix 6"]
  assert len(res.rolled) == 7 and res.prompts == 7
  assert res.extra_rounds == 2 and not res.bound_hit
  assert res.metrics() == {P + "keep_frac": 4 / 7, P + "extra_rounds": 2.0,
                           P + "extra_prompts": 3.0, P + "bound_hit": 0.0, P + "groups": 4.0,
                           P + "update_skipped": 0.0}


def test_all_mixed_needs_no_extra_round():
  rollout, calls = _fake(lambda i: True)
  res = ds.resample_mixed(rollout, _tasks, target=3, keep=_keep, max_extra_rounds=2)
  assert calls == [(0, [0, 1, 2])] and res.prompts == 3 and res.extra_rounds == 0
  assert res.metrics()[P + "keep_frac"] == 1.0


def test_bound_hit_trains_on_what_there_is_and_warns(caplog):
  rollout, calls = _fake(lambda i: i == 1)  # one mixed group in the whole data order
  with caplog.at_level("WARNING"):
    res = ds.resample_mixed(rollout, _tasks, target=3, keep=_keep, max_extra_rounds=2)
  assert calls == [(0, [0, 1, 2]), (1, [3, 4]), (2, [5, 6])]
  assert res.kept == ["mix 1"] and res.bound_hit and res.prompts == 7
  m = res.metrics()
  assert m[P + "bound_hit"] == 1.0 and m[P + "groups"] == 1.0 and m[P + "update_skipped"] == 0.0
  assert "1 of 3 mixed groups after 2 extra rounds" in caplog.text


def test_no_mixed_group_at_all_skips_the_update():
  rollout, calls = _fake(lambda i: False)
  res = ds.resample_mixed(rollout, _tasks, target=2, keep=_keep, max_extra_rounds=1)
  assert calls == [(0, [0, 1]), (1, [2, 3])] and res.kept == []
  assert res.metrics()[P + "update_skipped"] == 1.0 and res.metrics()[P + "keep_frac"] == 0.0


def test_zero_extra_rounds_only_filters():
  rollout, calls = _fake(lambda i: i % 2 == 0)
  res = ds.resample_mixed(rollout, _tasks, target=4, keep=_keep, max_extra_rounds=0)
  assert calls == [(0, [0, 1, 2, 3])] and res.kept == ["mix 0", "mix 2"] and res.bound_hit


def test_a_skipped_task_counts_as_a_missing_group():
  # A strategy may return no group for a task (TRACE's m_i = 0): its prompt is consumed.
  def rollout(round_, tasks):
    return [f"mix {i}" for i in tasks if i != 1]

  res = ds.resample_mixed(rollout, _tasks, target=3, keep=_keep, max_extra_rounds=3)
  assert res.kept == ["mix 0", "mix 2", "mix 3"] and res.prompts == 4 and res.extra_rounds == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(target=0), "target=0"), (dict(max_extra_rounds=-1), "max_extra_rounds=-1")])
def test_bad_arguments_fail(kwargs, message):
  args = dict(rollout=_fake(lambda i: True)[0], tasks=_tasks, target=2, keep=_keep,
              max_extra_rounds=1) | kwargs
  with pytest.raises(ValueError, match=message):
    ds.resample_mixed(**args)


def test_more_groups_than_tasks_fail():
  with pytest.raises(ValueError, match="at most one group per task"):
    ds.resample_mixed(lambda r, tasks: ["mix"] * (len(tasks) + 1), _tasks, 2, _keep, 1)


# ----------------------------------------------------------------------------
# The keep rule
# ----------------------------------------------------------------------------


def _group(*rewards):
  tree = RolloutTree.new([1, 2])
  for r in rewards:
    tree.add_leaf(tree.add_node(0, NodeKind.POLICY, [3, 4], logprobs=[-1.0, -1.0]), r)
  return tree


def test_is_mixed_is_dapo_keep_mask_on_the_host():
  groups = [_group({"outcome": 1.0}, {"outcome": 1.0}),  # all right: dropped
            _group({"outcome": 0.0}, {"outcome": 1.0}),
            _group({"outcome": -1.0}),  # one leaf: nothing to compare
            _group({"outcome": 0.0, "bonus": 1.0}, {"outcome": 1.0, "bonus": 0.0}),  # sums tie
            _group({"outcome": 0.5}, {"outcome": 0.5 + 1e-7}),  # within STD_FLOOR
            _group({"outcome": 0.0}, {"outcome": 0.0, "bonus": 2.0})]  # absent channel is 0
  for channels, want in [(("outcome",), [False, True, False, True, False, False]),
                         (("outcome", "bonus"), [False, True, False, False, False, True])]:
    got = [ds.is_mixed(g, channels) for g in groups]
    assert got == want
    batch = pack(groups, Buckets.exact(), reward_channels=("outcome", "bonus"))
    mask = grpo.dapo_keep_mask(batch, grpo.DAPOConfig(reward_channels=channels))
    np.testing.assert_array_equal(np.asarray(mask), want)
  assert not ds.is_mixed(RolloutTree.new([1, 2]), ("outcome",))  # no leaf


def test_every_estimator_names_its_outcome_reward_channels_one_way():
  for name in registry.registered():
    config = registry.make_config(name)
    assert config.reward_channels == ("outcome",), name
    with pytest.raises((ValueError, TypeError), match="reward_channels"):
      registry.make_config(name, reward_channels=())
  awpo = registry.make_config("awpo")  # the judge's channel is not an outcome
  assert awpo.reasoning_channel not in awpo.reward_channels
  # A config without the field cannot be registered.
  with pytest.raises(TypeError, match="NoChannels .* has no reward_channels"):
    registry.register(registry.AdvEstimator.GRPO,
                      dataclasses.make_dataclass("NoChannels", [("x", int)]))


# ----------------------------------------------------------------------------
# One step with an agent
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Stats:
  num_episodes: int
  num_truncated: int
  num_policy_tokens: int


class _Strategy:
  last_metrics: dict = {}


class _Agent:
  """Rolls out task i as a two-leaf group, mixed iff i is even; per call: 2 episodes per
  task, one truncated, 5 policy tokens per task; the strategy logs x = the call's size."""

  def __init__(self):
    self.strategy, self.calls = _Strategy(), []

  def rollout(self, tasks):
    self.calls.append(list(tasks))
    self.last_stats = _Stats(2 * len(tasks), len(tasks), 5 * len(tasks))
    self.strategy.last_metrics = {"s/x": float(len(tasks))}
    return [_group({"outcome": 0.0}, {"outcome": float(i % 2 == 0)}) for i in tasks]


def test_rollout_step_sums_the_rounds_and_reseeds_each():
  agent, seeds = _Agent(), []
  got = ds.rollout_step(agent, lambda i, n: _tasks(10 + i, n), 2, seeds.append, ("outcome",),
                        max_extra_rounds=3)
  # Offsets 10 (mixed), 11 (flat); then 12 (mixed).
  assert agent.calls == [[10, 11], [12]] and seeds == [0, 1]
  assert len(got.trees) == 3 and len(got.train) == 2 and got.prompts == 3
  m = got.metrics()
  assert m["rollout/truncated_frac"] == 3 / 6 and m["rollout/policy_tokens"] == 15.0
  assert m["s/x"] == pytest.approx((2 * 2 + 1 * 1) / 3)  # weighted by each round's trees
  assert m[P + "extra_rounds"] == 1.0 and m[P + "keep_frac"] == 2 / 3


def test_rollout_step_without_dynamic_sampling_trains_every_tree():
  agent, seeds = _Agent(), []
  got = ds.rollout_step(agent, _tasks, 2, seeds.append)
  assert agent.calls == [[0, 1]] and seeds == [0] and got.train == got.trees
  assert got.prompts == 2 and got.sampling is None
  assert not any(k.startswith(P) for k in got.metrics()) and got.metrics()["s/x"] == 2.0
