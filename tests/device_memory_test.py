"""One GPU shared by the learner (JAX) and the vLLM generator: the config's two memory
shares, the launcher setting $XLA_PYTHON_CLIENT_MEM_FRACTION before JAX's backend starts,
and the start-up check when it is too late."""

import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from tree_rl import device_memory
from tree_rl.config_types import MEMORY_BUDGET, RunConfig
from tree_rl.device_memory import MEM_FRACTION_ENV, apply_learner_memory_fraction

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rollout(**kw):
  return RunConfig.from_config_dict({"rollout": kw}).rollout


def test_learner_share_defaults_by_engine():
  assert _rollout(engine="jax").learner_memory_share() is None  # JAX's own default
  assert _rollout(engine="vllm").learner_memory_share() == pytest.approx(MEMORY_BUDGET - 0.5)
  assert _rollout(engine="vllm", generator_memory_fraction=0.3).learner_memory_share() == (
      pytest.approx(0.65))
  assert _rollout(engine="vllm", generator_memory_fraction=0.3,
                  learner_memory_fraction=0.6).learner_memory_share() == 0.6
  # Without vLLM the learner may take more than the budget leaves beside a generator.
  assert _rollout(engine="jax", learner_memory_fraction=0.9).learner_memory_share() == 0.9


@pytest.mark.parametrize("kw, match", [
    (dict(generator_memory_fraction=0.0), r"generator_memory_fraction=0.0 must be in \(0, 1\)"),
    (dict(generator_memory_fraction=1.0), r"generator_memory_fraction=1.0 must be in \(0, 1\)"),
    (dict(learner_memory_fraction=-0.1), r"learner_memory_fraction=-0.1 must be in \(0, 1\)"),
    (dict(learner_memory_fraction=1.5), r"learner_memory_fraction=1.5 must be in \(0, 1\)"),
    # JAX's default 0.75 beside vLLM's 0.5 is the out-of-memory this check exists for.
    (dict(engine="vllm", learner_memory_fraction=0.75, generator_memory_fraction=0.5),
     r"learner_memory_fraction=0.75 \+ generator_memory_fraction=0.5 = 1.25 exceeds 0.95"),
    (dict(engine="vllm", generator_memory_fraction=0.96),
     r"generator_memory_fraction=0.96 leaves the learner nothing"),
])
def test_shares_that_cannot_fit_fail_naming_the_fields(kw, match):
  with pytest.raises(ValueError, match=match):
    _rollout(**kw)


def test_base_config_carries_the_memory_fields():
  sys.path.insert(0, str(ROOT))
  from configs.common import base_config  # noqa: PLC0415

  r = RunConfig.from_config_dict(base_config()).rollout
  assert (r.generator_memory_fraction, r.learner_memory_fraction) == (0.5, 0.0)


# The launcher, in a fresh interpreter: the environment JAX sees when its backend starts is
# recorded by a backend-initialisation hook; train_and_evaluate is replaced by a recorder.
_LAUNCH = r"""
import importlib.util, json, os, sys
from absl import flags
from jax._src import xla_bridge
seen = {}
xla_bridge.register_backend_initialization_hook(
    lambda backend: seen.setdefault("env_at_backend_start", os.environ.get(%(env)r)))
spec = importlib.util.spec_from_file_location("launch_train", %(launch)r)
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
flags.FLAGS(["train.py"] + sys.argv[1:])
from tree_rl import train
train.train_and_evaluate = lambda config, workdir, **kw: seen.setdefault(
    "backend_up_before_train", xla_bridge.backends_are_initialized())
assert not xla_bridge.backends_are_initialized()
launch.main([])
print(json.dumps(seen))
"""


@pytest.mark.parametrize("overrides, expected", [
    (["--config.rollout.engine=vllm", "--config.rollout.generator_memory_fraction=0.3"], "0.65"),
    (["--config.rollout.engine=vllm", "--config.rollout.learner_memory_fraction=0.4"], "0.4"),
    ([], "0.75"),  # engine "jax" without a share: the environment is left as it was
])
@pytest.mark.e2e
def test_launcher_sets_the_fraction_before_jax_starts(tmp_path, overrides, expected):
  code = _LAUNCH % {"env": MEM_FRACTION_ENV, "launch": str(ROOT / "launch/train.py")}
  env = dict(os.environ, **{MEM_FRACTION_ENV: "0.75", "JAX_PLATFORMS": "cpu"})
  out = subprocess.run(
      [sys.executable, "-c", code, "--config=configs/grpo.py:runlocal",
       f"--workdir={tmp_path}", *overrides],
      capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  seen = json.loads(out.stdout.strip().splitlines()[-1])
  assert seen == {"env_at_backend_start": expected, "backend_up_before_train": True}


@pytest.mark.e2e
def test_launcher_rejects_shares_that_cannot_fit_before_jax_starts(tmp_path):
  out = subprocess.run(
      [sys.executable, str(ROOT / "launch/train.py"), "--config=configs/grpo.py:runlocal",
       f"--workdir={tmp_path}", "--config.rollout.engine=vllm",
       "--config.rollout.learner_memory_fraction=0.75"],
      capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
      timeout=300)
  assert out.returncode != 0
  assert "learner_memory_fraction=0.75 + generator_memory_fraction=0.5" in out.stderr
  assert not (tmp_path / "config.json").exists()  # failed before the run started


def test_cpu_backend_already_up_only_logs(monkeypatch, caplog):
  jax.devices()  # the CPU backend is up
  monkeypatch.setenv(MEM_FRACTION_ENV, "0.2")
  assert apply_learner_memory_fraction(_rollout(engine="vllm")) == pytest.approx(0.45)
  assert os.environ[MEM_FRACTION_ENV] == "0.2"  # no effect on CPU: nothing to change
  with caplog.at_level(logging.WARNING):
    assert apply_learner_memory_fraction(_rollout(learner_memory_fraction=0.6)) == 0.6
  assert "config.rollout.learner_memory_fraction=0.6 has no effect on cpu" in caplog.text


def test_gpu_backend_up_with_another_share_fails(monkeypatch):
  # No GPU here: the running backend is reported as a GPU one, which is what the check reads.
  jax.devices()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.delenv(MEM_FRACTION_ENV, raising=False)  # JAX's default 0.75 was used
  with pytest.raises(RuntimeError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 before the "
                                         r"learner's share 0.45 .*generator_memory_fraction=0.5"):
    apply_learner_memory_fraction(_rollout(engine="vllm"))
  monkeypatch.setenv(MEM_FRACTION_ENV, "0.45")  # started with the configured share: fine
  assert apply_learner_memory_fraction(_rollout(engine="vllm")) == pytest.approx(0.45)
  with pytest.raises(RuntimeError, match=r"config.rollout.learner_memory_fraction=0.3 could"):
    apply_learner_memory_fraction(_rollout(engine="jax", learner_memory_fraction=0.3))


def test_before_the_backend_starts_the_share_is_set(monkeypatch):
  monkeypatch.setattr(device_memory.xla_bridge, "backends_are_initialized", lambda: False)
  monkeypatch.setenv(MEM_FRACTION_ENV, "0.75")
  assert apply_learner_memory_fraction(_rollout(engine="vllm",
                                                generator_memory_fraction=0.25)) == 0.7
  assert os.environ[MEM_FRACTION_ENV] == "0.7"
  monkeypatch.delenv(MEM_FRACTION_ENV)
  assert apply_learner_memory_fraction(_rollout(engine="jax")) is None
  assert MEM_FRACTION_ENV not in os.environ
