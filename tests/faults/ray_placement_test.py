"""A Ray rollout fleet is placed or refused: never a silent wait.

A fleet that asks for more than the cluster's nodes hold fails before any actor starts,
naming the workers x resources asked for, what the cluster has and the settings to change;
the trainer fails the same way at start-up. A worker that Ray cannot place now (the
resources are held by another actor) fails the fleet's start after `timeout_s`
(config.rollout.worker_timeout_s), naming the bound; one that dies building its engine
fails it at once.
"""

import importlib
import time

import pytest
from flax import nnx

from tree_rl.models import Decoder, ModelConfig
from tree_rl.rollout import fleet as fleet_lib
from tree_rl.rollout.agent_loop import AgentConfig


@pytest.fixture(scope="module")
def spec_and_model(tmp_path_factory):
  # No engine can be built from this spec (its tokenizer folder is empty): the fleets below
  # fail before one is, or because one is not.
  empty = tmp_path_factory.mktemp("no_tokenizer")
  spec = fleet_lib.WorkerSpec(tokenizer=str(empty), family="search_qa", agent=AgentConfig())
  model = Decoder(ModelConfig.tiny(vocab_size=64, num_hidden_layers=1), rngs=nnx.Rngs(0))
  return spec, model


def test_check_ray_resources_counts_workers_per_node():
  one = [{"CPU": 2.0}]
  fleet_lib.check_ray_resources(2, 1.0, 0.0, one)
  fleet_lib.check_ray_resources(4, 0.5, 0.0, one)
  fleet_lib.check_ray_resources(5, 0.0, 0.0, [])  # asking for nothing fits anywhere
  with pytest.raises(RuntimeError, match=r"num_workers=3 worker\(s\) x .*worker_num_cpus=1 CPU.* "
                                         r"ask for 3 CPUs and 0 GPUs in all, but the cluster has 2 "
                                         r"CPUs and 0 GPUs on 1 node.*num_workers to at most 2"):
    fleet_lib.check_ray_resources(3, 1.0, 0.0, one)
  # 4 CPUs in all, but an actor takes its CPUs from one node: nodes of 2, 1 and 1 CPUs hold
  # one 2-CPU worker, not two.
  with pytest.raises(RuntimeError, match=r"4 CPUs and 0 GPUs in all, but the cluster has 4 "
                                         r"CPUs .* 3 node.*hold 1 such worker"):
    fleet_lib.check_ray_resources(2, 2.0, 0.0, [{"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 1.0}])
  # GPUs: 2 GPUs hold 4 half-GPU workers, not 5; no GPU holds none.
  fleet_lib.check_ray_resources(4, 1.0, 0.5, [{"CPU": 8.0, "GPU": 2.0}])
  with pytest.raises(RuntimeError, match=r"2.5 GPUs in all, but the cluster has 8 CPUs and 2 "
                                         r"GPUs"):
    fleet_lib.check_ray_resources(5, 1.0, 0.5, [{"CPU": 8.0, "GPU": 2.0}])
  with pytest.raises(RuntimeError, match=r"hold 0 such worker\(s\); lower "
                                         r"config.rollout.worker_num_cpus"):
    fleet_lib.check_ray_resources(1, 1.0, 1.0, [{"CPU": 8.0}])


def test_a_fleet_larger_than_the_cluster_is_refused_at_once(ray_local, spec_and_model):
  spec, model = spec_and_model
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=r"num_workers=3 worker\(s\) .* ask for 3 CPUs and 0 "
                                         r"GPUs in all, but the cluster has 2 CPUs") as e:
    fleet_lib.make_fleet("ray", spec, model, 3, num_cpus=1.0, timeout_s=600.0)
  assert time.monotonic() - start < 60
  assert "config.rollout.num_workers to at most 2" in str(e.value)


def test_a_worker_ray_cannot_place_now_fails_after_the_timeout(ray_local, spec_and_model):
  spec, model = spec_and_model

  @ray_local.remote(num_cpus=2)
  class Hog:
    """Holds both of the cluster's CPUs."""

    def ping(self):
      return 1

  hog = Hog.remote()
  try:
    ray_local.get(hog.ping.remote(), timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout worker\(s\) \[0\] of 1 not running 3s after "
                                           r"their start \(config.rollout.worker_timeout_s\)"):
      fleet_lib.make_fleet("ray", spec, model, 1, num_cpus=1.0, timeout_s=3.0)
    assert time.monotonic() - start < 60
  finally:
    ray_local.kill(hog, no_restart=True)


def test_a_worker_that_fails_to_build_fails_the_start_at_once(ray_local, spec_and_model):
  spec, model = spec_and_model  # its tokenizer folder is empty: the actor dies
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=r"rollout worker 0 of 1 failed to start"):
    fleet_lib.make_fleet("ray", spec, model, 1, num_cpus=1.0, timeout_s=600.0)
  assert time.monotonic() - start < 300  # not the 600 s start bound


def test_the_trainer_refuses_a_fleet_the_cluster_cannot_place(ray_local, tmp_path):
  from tree_rl import train  # noqa: PLC0415

  c = importlib.import_module("configs.grpo").get_config("runlocal")
  c.rollout.backend, c.rollout.num_workers, c.rollout.worker_num_cpus = "ray", 3, 1.0
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=r"num_workers=3 worker\(s\) .* 3 CPUs and 0 GPUs in all, "
                                         r"but the cluster has 2 CPUs"):
    train.train_and_evaluate(c, str(tmp_path))
  took = time.monotonic() - start
  print(f"the trainer refused the fleet after {took:.1f}s")
  assert took < 60
