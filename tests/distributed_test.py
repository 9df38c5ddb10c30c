"""Training over several processes: 2 processes x 4 fake CPU devices, joined by
`jax.distributed.initialize`, end a runlocal run with the parameters of the one-process
8-device run, write one set of metrics, and leave a checkpoint that a one-process run
restores. Plus the process-group resolution and its errors."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tree_rl import distributed, metrics, train
from tree_rl.checkpoint import RunCheckpointer
from tree_rl.config_types import DistributedSpec, RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OVERRIDES = {"sft.steps": 1, "task.num_eval_tasks": 1, "mesh.fsdp": 4, "mesh.tensor": 2}


def _grpo():
  c = importlib.import_module("configs.grpo").get_config("runlocal")
  for key, value in OVERRIDES.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


def _flat(tree) -> dict[str, jax.Array]:
  return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(tree)}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(workdir: pathlib.Path, port: int) -> list[subprocess.Popen]:
  """Two launcher processes of 4 CPU devices each; process ids from $JAX_PROCESS_ID, the
  coordinator and the count from config flags (both ways of setting the group)."""
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()] + [
      f"--config.distributed.coordinator_address=127.0.0.1:{port}",
      "--config.distributed.num_processes=2", f"--workdir={workdir}", "--jax_platform=cpu"]
  procs = []
  for pid in range(2):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PROCESS_ID=str(pid))
    log = open(workdir.parent / f"process{pid}.log", "w")  # noqa: SIM115 (closed with the run)
    procs.append(subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "train.py"),
         "--config=" + str(ROOT / "configs" / "grpo.py") + ":runlocal", *flags],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


@pytest.mark.e2e
def test_two_processes_train_like_one_and_their_checkpoint_restores(tmp_path):
  (tmp_path / "multi").mkdir()
  procs = _spawn(tmp_path / "multi" / "run", _free_port())
  try:
    for pid, p in enumerate(procs):
      rc = p.wait(timeout=600)
      log = (tmp_path / "multi" / f"process{pid}.log").read_text()
      assert rc == 0, f"process {pid} exited {rc}:\n{log[-4000:]}"
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  # Then (not meanwhile: three trainers at once outgrow a small machine's memory) the
  # one-process run on 8 devices.
  one = train.train_and_evaluate(_grpo(), str(tmp_path / "one"))
  run = tmp_path / "multi" / "run"
  assert one["steps"] == 2 and any(r.get("sft/l2_grads", 0.0) > 0 for r in one["history"])
  # Process 0 alone wrote the metrics: one row per row of the one-process run.
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [r["step"] for r in one["history"]]
  assert (run / "eval_rl.json").is_file() and (run / "curves.png").is_file()
  # The 2-process run's last checkpoint, restored in this one-process run on its mesh.
  ckpt = RunCheckpointer(run / "checkpoints")
  try:
    assert ckpt.latest_step() == 2
    state, meta = ckpt.restore(one["state"])
  finally:
    ckpt.close()
  assert meta["step"] == 2 and meta["sft_done"]
  for part in ("params", "frozen"):  # LoRA adapters and the base weights
    a, b = _flat(getattr(one["state"], part)), _flat(getattr(state, part))
    assert a.keys() == b.keys() and a
    for k in a:
      assert len(b[k].sharding.device_set) == 8  # restored onto this run's mesh
      np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), atol=1e-5, rtol=0,
                                 err_msg=f"{part}/{k}")


def test_process_group_from_config_or_environment(monkeypatch):
  for var in distributed.ENV.values():
    monkeypatch.delenv(var, raising=False)
  assert distributed.resolve(DistributedSpec()) is None  # one process: no initialize
  assert distributed.initialize(DistributedSpec(num_processes=1)) is None
  assert distributed.resolve(DistributedSpec("h:1", 2, 1)) == distributed.Cluster("h:1", 2, 1)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h0:99")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert distributed.resolve(DistributedSpec()) == distributed.Cluster("h0:99", 4, 3)
  # The config wins over the environment, field by field.
  assert distributed.resolve(DistributedSpec(process_id=0)) == distributed.Cluster("h0:99", 4, 0)
  monkeypatch.delenv("JAX_PROCESS_ID")
  with pytest.raises(ValueError, match=r"process_id \(or \$JAX_PROCESS_ID\) = None"):
    distributed.resolve(DistributedSpec())
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  with pytest.raises(ValueError, match="4 processes need config.distributed.coordinator_address"):
    distributed.resolve(DistributedSpec(process_id=1))
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='two' is not an integer"):
    distributed.resolve(DistributedSpec())


@pytest.mark.parametrize("values, message", [
    (dict(num_processes=-2), r"config.distributed.num_processes=-2 must be >= 1"),
    (dict(num_processes=2, process_id=2),
     r"config.distributed.process_id=2 must be in \[0, num_processes=2\)"),
    (dict(nodes=2), r"config.distributed: unknown key\(s\) \['nodes'\]"),
])
def test_bad_distributed_config_is_named(values, message):
  c = _grpo()
  for key, value in values.items():
    c.distributed[key] = value
  with pytest.raises(ValueError, match=message):
    RunConfig.from_config_dict(c)


def test_train_after_the_backend_started_alone_fails_clearly(tmp_path, monkeypatch):
  for var in distributed.ENV.values():
    monkeypatch.delenv(var, raising=False)
  jax.devices()  # this pytest process's backend: one process
  c = _grpo()
  c.distributed.update(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
  with pytest.raises(RuntimeError, match="already started in this process without "
                                         "jax.distributed.initialize"):
    train.train_and_evaluate(c, str(tmp_path))


@pytest.mark.e2e
def test_only_the_primary_process_writes_metrics(tmp_path):
  quiet = metrics.MetricWriter(tmp_path / "other", primary=False)
  quiet.write(1, {"loss": 0.5})
  metrics.Progress("RL", 2, "steps", primary=False).update(1, "x")
  quiet.close()
  assert quiet.history == [{"step": 1, "phase": "rl", "loss": 0.5}]
  assert not (tmp_path / "other").exists()
  main = metrics.MetricWriter(tmp_path / "main")
  main.write(1, {"loss": 0.5})
  main.close()
  assert json.loads((tmp_path / "main" / "metrics.jsonl").read_text()) == {
      "step": 1, "phase": "rl", "loss": 0.5}
