"""Sharding rules: the tiny model's PartitionSpecs match the committed dump,
and the replication guard fires when the rules stop sharding weights."""

from __future__ import annotations

import json
import os

import pytest
from flax import nnx

from tree_rl import sharding
from tree_rl.models import Decoder, LoRAConfig, ModelConfig

DUMP = os.path.join(os.path.dirname(__file__), "assets", "sharding_tiny_fsdp4_tensor2.json")


def _model():
  return Decoder(ModelConfig.tiny("qwen3"), rngs=nnx.Rngs(0), lora=LoRAConfig(rank=4))


def test_partition_specs_match_committed_dump():
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  specs = sharding.partition_specs(_model(), mesh)
  if os.environ.get("TREE_RL_REGEN_ASSETS"):
    with open(DUMP, "w") as f:
      json.dump(specs, f, indent=1, sort_keys=True)
  with open(DUMP) as f:
    assert specs == json.load(f)


def test_replication_guard():
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  model = _model()
  sharding.assert_params_sufficiently_sharded(model, mesh)
  assert sharding.replicated_fraction(model, mesh) < 0.1
  no_fsdp = sharding.rollout_rules()
  with pytest.raises(ValueError, match="replicated"):
    sharding.assert_params_sufficiently_sharded(model, mesh, no_fsdp)


def test_bad_mesh_and_rules_fail_clearly():
  with pytest.raises(ValueError, match="unknown mesh axes.*model"):
    sharding.make_mesh({"model": 8})
  with pytest.raises(ValueError, match="needs 6 devices"):
    sharding.make_mesh({"data": 1, "fsdp": 3, "tensor": 2})
  with pytest.raises(ValueError, match="no rule"):
    sharding.logical_to_spec(("embed", "heads"))
