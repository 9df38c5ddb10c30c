"""Rollout fleets: a step's trees, the policy versions and a lost worker, local and on Ray.

The oracle is one local worker (today's single engine): split across workers, in this
process or on Ray actors, a flat step's trees are the same token for token, because every
request samples from (step key, request seed) alone (batch_invariance_test.py).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from tree_rl.envs import make_family
from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.rollout import fleet as fleet_lib
from tree_rl.rollout.agent_loop import AgentConfig, RolloutStats
from tree_rl.rollout.dynamic_sampling import rollout_step
from tree_rl.rollout.engine import SamplingParams
from tree_rl.rollout.engines import EngineSpec
from tree_rl.tree.types import NodeKind

FAMILY = "search_qa"


@pytest.fixture(scope="module")
def spec_and_model():
  tokenizer = str(gguf_import.default_model_dir())
  from transformers import AutoTokenizer  # noqa: PLC0415

  vocab = len(AutoTokenizer.from_pretrained(tokenizer))
  model = Decoder(ModelConfig.tiny(vocab_size=vocab, num_hidden_layers=1), rngs=nnx.Rngs(0))
  spec = fleet_lib.WorkerSpec(
      tokenizer=tokenizer, family=FAMILY, strategy="flat", strategy_kwargs={"n": 2},
      agent=AgentConfig(samples_per_task=2, max_turns=2, max_context_tokens=512,
                        sampling=SamplingParams(max_new_tokens=8)),
      engine=EngineSpec(rows=8, slots=512))
  return spec, model


def _tasks(n=4):
  return make_family(FAMILY).generate("train", n, seed=0)


def _shape(trees):
  """[(task id, [(parent, kind, tokens)], [(leaf node, tag, truncated)])] per tree."""
  return [(t.meta["task_id"], [(n.parent, int(n.kind), tuple(n.tokens)) for n in t.nodes],
           [(lf.node, int(lf.tag), lf.truncated) for lf in t.leaves]) for t in trees]


def _step(fleet, tasks, key=7):
  """One step's rollout through `rollout_step`, reseeded like the trainer's round 0."""
  got = rollout_step(fleet, lambda i, n: tasks[i:i + n], len(tasks),
                     lambda r: fleet.reseed(jax.random.fold_in(jax.random.key(key), r)))
  return got


@pytest.fixture(scope="module")
def oracle(spec_and_model):
  spec, model = spec_and_model
  one = fleet_lib.make_fleet("local", spec, model, 1)
  got = _step(one, _tasks())
  return _shape(got.trees), got


def _perturbed(model, scale=0.5):
  """A copy of `model` with other weights (a later policy version)."""
  other = nnx.clone(model)
  nnx.update(other, jax.tree.map(lambda x: x + scale * jax.numpy.sign(x)
                                 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x,
                                 nnx.state(other)))
  return other


def test_split_tasks_keeps_trees_whole_and_in_order():
  assert fleet_lib.split_tasks("abcd", 2) == [[0, 1], [2, 3]]
  assert fleet_lib.split_tasks("ab", 4) == [[0], [1]]  # idle workers dropped
  assert sorted(i for c in fleet_lib.split_tasks("abcdefg", 3) for i in c) == list(range(7))
  # A task's repeats go to the worker of its first occurrence, in task order.
  assert fleet_lib.split_tasks("abca", 2) == [[0, 1, 3], [2]]


def test_a_repeated_task_samples_as_on_one_worker(spec_and_model):
  spec, model = spec_and_model
  t = _tasks(3)
  tasks = [t[0], t[1], t[2], t[0]]  # the data order wrapped within a step
  want = _shape(_step(fleet_lib.make_fleet("local", spec, model, 1), tasks).trees)
  assert want[0][1] != want[3][1]  # two occurrences, two different trees
  assert _shape(_step(fleet_lib.make_fleet("local", spec, model, 2), tasks).trees) == want


def test_merge_stats_sums_counts():
  a = RolloutStats(4, 1, 2, 10, 5, 0, skipped_tasks=("x",))
  b = RolloutStats(2, 0, 3, 7, 1, 1)
  m = fleet_lib.merge_stats([a, b])
  assert (m.num_episodes, m.num_truncated, m.num_turns, m.num_policy_tokens) == (6, 1, 5, 17)
  assert (m.num_dropped, m.skipped_tasks) == (1, ("x",))


@pytest.mark.parametrize("strategy,why", [("appo", "learner's current policy"),
                                          ("trace", "across all of a step's tasks"),
                                          ("portool", "one generator per call")])
def test_unsplittable_strategies_are_rejected(strategy, why):
  fleet_lib.check_fleet("local", 1, strategy)  # one local worker runs anything
  with pytest.raises(ValueError, match=why):
    fleet_lib.check_fleet("ray", 1, strategy)
  with pytest.raises(ValueError, match=why):
    fleet_lib.check_fleet("local", 2, strategy)
  with pytest.raises(ValueError, match="backend='dask'"):
    fleet_lib.check_fleet("dask", 1, "flat")
  with pytest.raises(ValueError, match="num_workers=0"):
    fleet_lib.check_fleet("ray", 0, "flat")
  fleet_lib.check_fleet("ray", 2, "flat", engine="vllm")  # vLLM workers (vllm_fleet_test.py)
  with pytest.raises(ValueError, match="engine='sglang'"):
    fleet_lib.check_fleet("ray", 2, "flat", engine="sglang")
  with pytest.raises(ValueError, match="judge"):
    fleet_lib.check_fleet("local", 2, "flat", leaf_rewards=True)


def test_two_local_workers_grow_the_trees_of_one(spec_and_model, oracle):
  spec, model = spec_and_model
  want, one = oracle
  assert len(want) == 4 and all(leaves for _, _, leaves in want)
  two = fleet_lib.make_fleet("local", spec, model, 2)
  got = _step(two, _tasks())
  assert _shape(got.trees) == want
  assert (got.episodes, got.policy_tokens) == (one.episodes, one.policy_tokens)
  # Not vacuous: another key grows other trees.
  assert _shape(_step(two, _tasks(), key=8).trees) != want


def test_local_versions_follow_every_sync(spec_and_model, oracle):
  spec, model = spec_and_model
  two = fleet_lib.make_fleet("local", spec, model, 2)
  assert two.versions() == [0, 0]
  two.update_weights(_perturbed(model), 1)
  assert two.versions() == [1, 1]
  assert _shape(_step(two, _tasks()).trees) != oracle[0]  # the new weights are what samples
  with pytest.raises(ValueError, match="version 1 must exceed"):
    two.update_weights(model, 1)


@pytest.mark.e2e
def test_ray_fleet_matches_one_local_worker_and_tracks_versions(ray_local, spec_and_model,
                                                               oracle):
  spec, model = spec_and_model
  fleet = fleet_lib.make_fleet("ray", spec, model, 2, num_cpus=1.0, timeout_s=120.0)
  try:
    assert fleet.versions() == [0, 0]
    got = _step(fleet, _tasks())
    assert _shape(got.trees) == oracle[0]
    assert got.episodes == oracle[1].episodes
    # Log-probs cross the object store intact (to float rounding of another process).
    for a, b in zip(got.trees, oracle[1].trees):
      lp = lambda t: np.concatenate([np.asarray(n.logprobs) for n in t.nodes
                                     if n.kind == NodeKind.POLICY])
      np.testing.assert_allclose(lp(a), lp(b), atol=1e-5)
    # After every sync each worker holds the trainer's version, and samples with it.
    local = fleet_lib.make_fleet("local", spec, model, 1)
    for version in (1, 2):
      new = _perturbed(model, 0.1 * version)
      fleet.update_weights(new, version)
      local.update_weights(new, version)
      assert fleet.versions() == [version, version]
    assert _shape(_step(fleet, _tasks()).trees) == _shape(_step(local, _tasks()).trees)
    assert fleet.metrics()[fleet_lib.PREFIX + "restarts"] == 0

    # A worker killed mid-step is restarted on the latest weights; its chunk is sent
    # again and the step keeps every tree.
    want = _shape(_step(local, _tasks()).trees)
    fleet.reseed(jax.random.fold_in(jax.random.key(7), 0))  # _step's round-0 key

    class KillOnFirstWait:
      """Ray, but worker 1 is killed once both chunks are in flight (the fleet's first wait)."""

      def __init__(self):
        self.killed = False

      def __getattr__(self, name):
        return getattr(ray_local, name)

      def wait(self, *args, **kwargs):
        if not self.killed:
          self.killed = True
          ray_local.kill(fleet.actors[1], no_restart=True)
        return ray_local.wait(*args, **kwargs)

    fleet._ray = KillOnFirstWait()
    got = fleet.rollout(_tasks())
    fleet._ray = ray_local
    assert _shape(got) == want
    m = fleet.metrics()
    assert m[fleet_lib.PREFIX + "restarts"] == 1 and m[fleet_lib.PREFIX + "resends"] == 1
    assert fleet.versions() == [2, 2]
  finally:
    fleet.close()


@pytest.mark.e2e
def test_a_silent_ray_worker_is_restarted_and_its_chunk_resent(ray_local, spec_and_model,
                                                              oracle):
  import time  # noqa: PLC0415

  spec, model = spec_and_model
  # Well above a chunk's time on a fresh actor (engine build, then a compile per decode
  # width the chunk passes through), also on a loaded 2-core CI machine: at 20 s the
  # replacement was once itself timed out there (2 restarts).
  timeout_s = 45.0

  class Silent(fleet_lib.Worker):
    """A worker that never answers a rollout (test-only: a hung sandbox or network)."""

    def rollout(self, tasks, key_data):
      time.sleep(3600)

  fleet = fleet_lib.make_fleet("ray", spec, model, 2, num_cpus=1.0, timeout_s=timeout_s)
  try:
    # Worker 1 becomes silent; the fleet's own restart starts a real Worker in its place.
    ray_local.kill(fleet.actors[1], no_restart=True)
    fleet.actors[1] = ray_local.remote(num_cpus=1.0)(Silent).remote(fleet._spec, fleet._model)
    start = time.monotonic()
    got = _step(fleet, _tasks())
    assert time.monotonic() - start >= timeout_s  # it waited for the silent worker
    assert _shape(got.trees) == oracle[0]  # every tree, the same as one local worker's
    m = fleet.metrics()
    assert m[fleet_lib.PREFIX + "restarts"] == 1 and m[fleet_lib.PREFIX + "resends"] == 1
    assert fleet.versions() == [0, 0]  # the restarted worker answers
  finally:
    fleet.close()


@pytest.mark.e2e
def test_runlocal_trains_two_steps_on_a_ray_fleet(ray_local, tmp_path):
  import importlib  # noqa: PLC0415
  import json  # noqa: PLC0415

  from tree_rl import train  # noqa: PLC0415

  c = importlib.import_module("configs.grpo").get_config("runlocal")
  c.rollout.backend, c.rollout.num_workers = "ray", 2
  c.rollout.worker_num_cpus, c.rollout.worker_timeout_s = 1.0, 300.0
  out = train.train_and_evaluate(c, str(tmp_path))
  assert out["steps"] == 2
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "reward/outcome_mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:  # every step's sync reached both workers; no worker was lost
    assert r["rollout/fleet/policy_version"] == r["step"]
    assert r["rollout/fleet/stale_workers"] == 0
    assert r["rollout/fleet/restarts"] == 0
    assert r["rollout/policy_tokens"] > 0 and np.isfinite(r["loss"])


def test_fleet_settings_are_validated_at_startup():
  import importlib  # noqa: PLC0415

  from tree_rl.config_types import RunConfig  # noqa: PLC0415

  c = importlib.import_module("configs.portool").get_config("runlocal")
  c.rollout.backend, c.rollout.num_workers = "ray", 2
  with pytest.raises(ValueError, match="strategy='portool' cannot be split"):
    RunConfig.from_config_dict(c)
  c = importlib.import_module("configs.grpo").get_config("runlocal")
  c.rollout.worker_num_gpus = 1.0
  with pytest.raises(ValueError, match="worker_num_gpus=1.0 applies to Ray workers only"):
    RunConfig.from_config_dict(c)
