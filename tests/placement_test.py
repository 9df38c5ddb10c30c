"""Training on a device mesh (8 fake CPU devices): a sharded runlocal run ends with the
parameters of the one-device run, its parameters carry the committed PartitionSpecs,
and bad meshes fail at start-up with the config field named."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tree_rl import placement, sharding, train
from tree_rl.config_types import MeshSpec
from tree_rl.models import Decoder, LoRAConfig, ModelConfig
from tree_rl.rollout.strategies import model_scorer
from tree_rl.tree.batch import Buckets
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import NodeKind

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPECS = ROOT / "tests" / "assets" / "sharding_runlocal_grpo_fsdp4_tensor2.json"


def _grpo(**mesh):
  c = importlib.import_module("configs.grpo").get_config("runlocal")
  c.sft.steps = 1  # a supervised step: real gradients whatever the random policy's rewards
  c.task.num_eval_tasks = 1
  c.mesh.update(mesh)
  return c


def _flat(tree) -> dict[str, jax.Array]:
  return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(tree)}


@pytest.mark.e2e
def test_sharded_training_equals_unsharded(tmp_path):
  one = train.train_and_evaluate(_grpo(), str(tmp_path / "one"))
  mesh = train.train_and_evaluate(_grpo(fsdp=4, tensor=2), str(tmp_path / "mesh"))
  assert one["steps"] == mesh["steps"] == 2
  assert any(r.get("sft/l2_grads", 0.0) > 0 for r in one["history"])  # the weights moved
  for part in ("params", "frozen"):  # LoRA adapters and the base weights
    a, b = _flat(getattr(one["state"], part)), _flat(getattr(mesh["state"], part))
    assert a.keys() == b.keys() and a
    for k in a:
      np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), atol=1e-5, rtol=0,
                                 err_msg=f"{part}/{k}")
  # Every weight of the mesh run is laid out as the committed table says; the
  # one-device run's are on one device.
  specs = {f"{part}/{k}": str(tuple(v.sharding.spec))
           for part in ("params", "frozen")
           for k, v in _flat(getattr(mesh["state"], part)).items()}
  if os.environ.get("TREE_RL_REGEN_ASSETS"):
    SPECS.write_text(json.dumps(specs, indent=1, sort_keys=True) + "\n")
  assert specs == json.loads(SPECS.read_text())
  assert any("fsdp" in s for s in specs.values()) and any("tensor" in s for s in specs.values())
  assert all(len(v.devices()) == 8 for v in _flat(mesh["state"].frozen).values())
  assert all(len(v.devices()) == 1 for v in _flat(one["state"].frozen).values())


def test_replication_guard_rejects_a_replicated_model_at_startup(tmp_path):
  with pytest.raises(ValueError, match=r"max_replicated_fraction=0.0: .*replicated on mesh"):
    train.train_and_evaluate(_grpo(fsdp=4, tensor=2, max_replicated_fraction=0.0),
                             str(tmp_path))
  model = Decoder(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4))
  fsdp8 = placement.build_mesh(MeshSpec(fsdp=-1))
  placement.Placement(fsdp8).check_replication(model, 0.1)  # the training rules shard it
  with pytest.raises(ValueError, match="max_replicated_fraction=0.1: .*replicated"):
    placement.Placement(fsdp8, sharding.rollout_rules()).check_replication(model, 0.1)


@pytest.mark.parametrize("mesh, message", [
    (dict(model=2), r"config.mesh: unknown key\(s\) \['model'\]"),
    (dict(fsdp=-1, tensor=-1), "at most one axis may be -1"),
    (dict(fsdp=0), r"config.mesh.fsdp=0 must be >= 1 or -1"),
    (dict(fsdp=16), "needs 16 devices, have 8"),
    (dict(fsdp=3, data=-1), "8 devices do not split into 3"),
])
def test_bad_mesh_fails_at_startup(tmp_path, mesh, message):
  with pytest.raises(ValueError, match=message):
    train.train_and_evaluate(_grpo(**mesh), str(tmp_path))


def test_batch_geometry_pads_trees_to_the_tree_shards():
  p = placement.Placement(placement.build_mesh(MeshSpec(data=2, fsdp=2, tensor=2)))
  assert p.tree_shards == 4
  assert [p.trees_bucket(n) for n in (1, 4, 5)] == [4, 4, 8]
  assert p.trees_bucket(6, num_minibatches=2) == 8  # each minibatch of 4 splits over 4
  assert "6 trees per step (packed to 8) -> 8 per host (1 host(s)) -> 2 per device" in (
      p.geometry(6, 8))
  one = placement.Placement(placement.build_mesh(MeshSpec()))
  assert not one.sharded and one.trees_bucket(3, num_minibatches=3) == 3  # as unsharded
  assert p.tree_buckets(64) == (4, 8, 16, 32, 64) and one.tree_buckets() is None


def test_appo_scorer_on_the_mesh_scores_like_one_device():
  # 3 trees (padded to the mesh's 4 tree shards) scored with FSDP x tensor weights.
  rng = np.random.default_rng(0)
  trees = []
  for branches in (1, 3, 2):
    tree = RolloutTree.new([int(x) for x in rng.integers(3, 250, 9)])
    for _ in range(branches):
      node = tree.add_node(0, NodeKind.POLICY, [int(x) for x in rng.integers(3, 250, 5)],
                           logprobs=[-1.0] * 5)
      tree.add_leaf(node, {"outcome": 1.0})
    trees.append(tree)
  config = ModelConfig.tiny(vocab_size=256)
  p = placement.Placement(placement.build_mesh(MeshSpec(data=2, fsdp=2, tensor=2)))
  sharded = sharding.shard_model(Decoder(config, rngs=nnx.Rngs(0)), p.mesh)
  assert len(sharded.embed.get_value().sharding.device_set) == 8
  got = model_scorer(sharded, Buckets(trees=p.tree_buckets()), p.place_batch)(trees)
  want = model_scorer(Decoder(config, rngs=nnx.Rngs(0)))(trees)
  for tree, g, w in zip(trees, got, want):
    for i, node in enumerate(tree.nodes):
      assert len(g.logprobs[i]) == len(node.tokens)
      np.testing.assert_allclose(g.logprobs[i], w.logprobs[i], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(g.entropies[i], w.entropies[i], rtol=1e-5, atol=1e-5)
