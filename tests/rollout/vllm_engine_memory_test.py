"""vLLM's share of the GPU: the trainer passes config.rollout.generator_memory_fraction to
`VLLMEngine`, which sends it to the worker, which gives it to `vllm.LLM` as
gpu_memory_utilization. Checked without starting vLLM: the worker's start-up is replaced
by a recorder of the config it would be sent, and `vllm` by a stand-in module."""

import pathlib
import sys
import types

import pytest
from flax import nnx

from tree_rl.rollout import engines
from tree_rl.config_types import RunConfig
from tree_rl.models import Decoder, ModelConfig
from tree_rl.rollout.chat import ChatFormat
from tree_rl.rollout import vllm_engine
from tree_rl.rollout.vllm_engine import WORKER_DIR, VLLMEngine


class _Chat(ChatFormat):
  """A chat format whose end-of-sequence ids need no real tokenizer."""

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (2,)


class _Recorded:
  """What `VLLMEngine._start` was given; stands in for the worker process."""

  def __init__(self, config):
    self.config = config

  def shutdown(self) -> None:
    self.config = None


@pytest.fixture
def sent(monkeypatch):
  box = {}

  def start(self, python, config, env, log_file, timeout):
    del python, env, log_file, timeout
    box["config"] = dict(config)
    # What a real worker reports at start-up.
    self.info = {"weight_transfer": "in_place", "vllm_version": "fake", "pid": 0}
    return _Recorded(config)

  monkeypatch.setattr(VLLMEngine, "_start", start)
  return box


@pytest.fixture
def hf_folder(tmp_path) -> pathlib.Path:
  (tmp_path / "config.json").write_text("{}")
  return tmp_path


def test_engine_sends_the_utilization_to_the_worker(sent, hf_folder):
  VLLMEngine(hf_folder, python=sys.executable, gpu_memory_utilization=0.3)
  assert sent["config"]["gpu_memory_utilization"] == 0.3


@pytest.mark.parametrize("bad", [0.0, -0.2, 1.2])
def test_engine_rejects_a_utilization_outside_the_unit_interval(sent, hf_folder, bad):
  with pytest.raises(ValueError, match=rf"gpu_memory_utilization={bad} must be in \(0, 1\]"):
    VLLMEngine(hf_folder, python=sys.executable, gpu_memory_utilization=bad)
  assert "config" not in sent  # nothing started


def test_trainer_builds_the_engine_with_the_configured_share(sent, monkeypatch, tmp_path):
  from tree_rl.models import hf_io

  folder = tmp_path / "policy"
  folder.mkdir()
  (folder / "config.json").write_text("{}")
  monkeypatch.setattr(hf_io, "save_hf", lambda model, out, tokenizer_from: folder)
  cfg = RunConfig.from_config_dict({"rollout": dict(engine="vllm", max_context_tokens=1024,
                                                    generator_memory_fraction=0.35)})
  model = Decoder(ModelConfig.tiny(vocab_size=256, num_hidden_layers=1), rngs=nnx.Rngs(0))
  tokenizer = types.SimpleNamespace(name_or_path="tok")
  engine = engines.make_engine(engines.EngineSpec.from_run(cfg, sys.executable), model,
                               tokenizer, _Chat(tokenizer, "<|im_end|>").eos_ids,
                               folder=tmp_path / "vllm_policy")
  assert isinstance(engine, vllm_engine.VLLMEngine)
  assert sent["config"]["gpu_memory_utilization"] == 0.35
  assert sent["config"]["max_model_len"] == min(1024, model.config.max_position_embeddings)


def test_worker_passes_the_utilization_to_vllm(monkeypatch):
  got = {}
  fake = types.ModuleType("vllm")
  fake.LLM = lambda **kwargs: got.update(kwargs) or "llm"
  monkeypatch.setitem(sys.modules, "vllm", fake)
  monkeypatch.syspath_prepend(str(WORKER_DIR))
  from tree_rl_vllm_worker import server

  config = dict(model_dir="/m", max_model_len=64, gpu_memory_utilization=0.35,
                enforce_eager=True, in_process_engine=False)
  assert server._build(config) == ("llm", "in_place")  # a fake vllm has no transfer API
  assert got["gpu_memory_utilization"] == 0.35
