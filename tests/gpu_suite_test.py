"""`benchmarks/gpu_suite.py --dry-run`: every stage of the GPU suite runs on the CPU at tiny
sizes (the kernels in interpret mode) and writes its figures to the JSON file."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("env", "kernels", "attention", "tree_flat", "mfu", "decode", "grpo")


@pytest.mark.e2e
def test_the_gpu_suite_dry_run_passes_every_stage(tmp_path):
  out = tmp_path / "suite.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a GPU
  proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out",
                         str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert tuple(report["stages"]) == STAGES
  for name, stage in report["stages"].items():
    assert stage["status"] == "ok", (name, stage)
  figures = {k: v for s in report["stages"].values() for k, v in s["figures"].items()}
  for name in ("kernel_tests_passed", "attention_fwd_bwd_ms_pallas", "attention_dense_over_pallas",
               "speedup_over_token_saving_512", "update_step_useful_tflops_per_s",
               "decode_tokens_per_s", "grpo_3_steps_wall_s"):
    assert figures[name] > 0, name
  lines = proc.stdout.splitlines()
  assert "RATIO speedup_over_token_saving_512" in "\n".join(lines)
  assert "7 of 7 stages ok" in lines[-1]


@pytest.mark.e2e
def test_the_suite_refuses_a_cpu_without_dry_run():
  proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py"], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "not a GPU: use --dry-run" in proc.stderr
