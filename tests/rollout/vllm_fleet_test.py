"""A fleet of vLLM rollout workers: versions on every worker and node, the new weights used.

Two local workers (each a VLLMEngine process of its own) serve the tiny random Llama of
vllm_engine_test.py. A step's trees are sampled by version 0; a new version with other
weights is published; the next step's trees must be sampled by it: every worker reports
it, every policy node carries it, and the log-probs vLLM recorded for the sampled tokens
are the new model's (tree_rl's decoder as the oracle), not the old one's. The worker's
weight-transfer path (vLLM's weight-transfer API where the installed vLLM has it, else the
in-place reload) is reported by every worker.

Needs an interpreter with vLLM (`$TREE_RL_VLLM_PYTHON`, see
third_party/vllm_worker/README.md); without one these tests skip.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from tree_rl.envs import make_family
from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.rollout import fleet as fleet_lib
from tree_rl.rollout.agent_loop import AgentConfig
from tree_rl.rollout.engine import SamplingParams
from tree_rl.rollout.engines import EngineSpec
from tree_rl.tree.types import NodeKind
from tests.rollout import reference
from tests.vllm_support import vllm_python_or_skip

FAMILY = "search_qa"
# As vllm_engine_test.py: head_dim 64 (vLLM's CPU attention), SmolLM2's vocabulary.
CFG = ModelConfig.tiny(head_dim=64, hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=49152)
MAX_CONTEXT = 512
ATOL = 1e-4  # vLLM's float32 CPU kernels against XLA at the x3 scale (vllm_engine_test.py)
# Weight transfer paths a worker may report: our backend on vLLM's weight-transfer API, or
# the fallback reload.
TRANSFER_PATHS = ("tree_rl_safetensors", "in_place")


def _lively(seed):
  """Random weights scaled x3: at the init scale, greedy decoding repeats one token."""
  graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(seed)))
  return nnx.merge(graphdef, jax.tree.map(lambda x: 3.0 * x, state))


def _spec(python):
  return fleet_lib.WorkerSpec(
      tokenizer=str(gguf_import.default_model_dir()), family=FAMILY, strategy="flat",
      strategy_kwargs={"n": 2},
      agent=AgentConfig(samples_per_task=2, max_turns=2, max_context_tokens=MAX_CONTEXT,
                        sampling=SamplingParams(max_new_tokens=8)),
      # One core each on a 2-core machine; the smallest KV cache and block size vLLM's CPU
      # backend takes.
      engine=EngineSpec(kind="vllm", slots=MAX_CONTEXT, vllm_python=python,
                        vllm_kwargs={"kv_cache_gb": 0.25, "block_size": 32, "cpu_threads": 1}))


def _tasks(n=4):
  return make_family(FAMILY).generate("train", n, seed=0)


def _policy_nodes(trees):
  """(tree, node index, node) of every policy node."""
  return [(t, i, n) for t in trees for i, n in enumerate(t.nodes) if n.kind == NodeKind.POLICY]


def _logprob_gaps(trees, model):
  """Per policy node: max |recorded log-prob - `model`'s| over its tokens."""
  gaps = []
  for tree, i, node in _policy_nodes(trees):
    ctx = tree.context(node.parent)
    want, _ = reference.policy_logprobs(model, ctx, node.tokens, pad=MAX_CONTEXT)
    gaps.append(float(np.abs(np.asarray(node.logprobs) - want).max()))
  return np.asarray(gaps)


def _step(fleet, tasks, key):
  fleet.reseed(jax.random.key(key))
  return fleet.rollout(tasks)


@pytest.mark.vllm
@pytest.mark.e2e
def test_local_vllm_workers_load_a_published_version():
  python = vllm_python_or_skip()
  old, new = _lively(0), _lively(1)
  tasks = _tasks(2)  # one per worker
  fleet = fleet_lib.make_fleet("local", _spec(python), old, 2)
  try:
    paths = {w["weight_transfer"] for w in fleet.info}
    assert [w["engine"] for w in fleet.info] == ["vllm", "vllm"]
    assert len(paths) == 1 and paths <= set(TRANSFER_PATHS), fleet.info
    assert fleet.versions() == [0, 0]

    before = _step(fleet, tasks, 1)
    assert [t.meta["task_id"] for t in before] == [t.task_id for t in tasks]
    assert {n.version for _, _, n in _policy_nodes(before)} == {0}
    assert _logprob_gaps(before, old).max() < ATOL

    fleet.publish(new, 1)  # loaded by the next rollout, on every worker
    after = _step(fleet, tasks, 2)
    assert fleet.versions() == [1, 1]
    assert fleet.metrics()["rollout/fleet/stale_workers"] == 0.0
    assert {n.version for _, _, n in _policy_nodes(after)} == {1}
    # Sampled by the new weights: their log-probs are the new model's, not the old one's.
    assert _logprob_gaps(after, new).max() < ATOL
    assert _logprob_gaps(after, old).max() > 1e-2
    for w in fleet.workers:  # each engine took one push, by the path it reported
      assert w.agent.engine.engine.stats["weight_updates"] == 1
      assert w.agent.engine.engine.weight_transfer in paths
  finally:
    fleet.close()
  for w in fleet.workers:  # the vLLM processes are gone
    assert w.agent.engine.engine._worker.proc.poll() is not None


@pytest.mark.vllm
@pytest.mark.e2e
def test_a_ray_vllm_worker_with_the_in_place_fallback():
  """One Ray actor holding a VLLMEngine that is told to use the fallback path (the in-place
  reload), loading a version synchronously (`update_weights`)."""
  python = vllm_python_or_skip()
  ray = pytest.importorskip("ray")
  old, new = _lively(0), _lively(1)
  tasks = _tasks(2)
  spec = _spec(python)
  spec = dataclasses.replace(spec, engine=dataclasses.replace(
      spec.engine, vllm_kwargs={**spec.engine.vllm_kwargs, "weight_transfer": "in_place"}))
  ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
  try:
    fleet = fleet_lib.make_fleet("ray", spec, old, 1, num_cpus=1.0, num_gpus=0.0)
    try:
      assert fleet.info == [{"engine": "vllm", "weight_transfer": "in_place"}]
      before = _step(fleet, tasks, 1)
      assert {n.version for _, _, n in _policy_nodes(before)} == {0}
      assert _logprob_gaps(before, old).max() < ATOL
      fleet.update_weights(new, 3)
      assert fleet.versions() == [3]
      after = _step(fleet, tasks, 2)
      assert {n.version for _, _, n in _policy_nodes(after)} == {3}
      assert _logprob_gaps(after, new).max() < ATOL
      assert _logprob_gaps(after, old).max() > 1e-2
    finally:
      fleet.close()
  finally:
    ray.shutdown()


def test_vllm_worker_settings_are_checked():
  spec = dict(tokenizer="t", family=FAMILY, agent=AgentConfig())
  with pytest.raises(ValueError, match="engine='sglang'"):
    fleet_lib.WorkerSpec(**spec, engine=EngineSpec(kind="sglang"))
  with pytest.raises(ValueError, match="seed"):
    fleet_lib.WorkerSpec(**spec, engine=EngineSpec(kind="vllm", vllm_kwargs={"seed": 3}))
  with pytest.raises(ValueError, match="only a vLLM worker"):
    fleet_lib.WorkerSpec(**spec, engine=EngineSpec(vllm_kwargs={"kv_cache_gb": 1}))
  with pytest.raises(TypeError, match="EngineSpec"):  # beartype's check in tests, else ours
    fleet_lib.WorkerSpec(**spec, engine="vllm")
  with pytest.raises(ValueError, match="one GPU"):
    fleet_lib.check_vllm_gpus(2.0, 0.5)
  with pytest.raises(ValueError, match="at most 0.25"):
    fleet_lib.check_vllm_gpus(0.25, 0.5)
  fleet_lib.check_vllm_gpus(0.0, 0.9)  # CPU
  fleet_lib.check_vllm_gpus(0.5, 0.4)  # two workers on one GPU, 0.4 of it each
