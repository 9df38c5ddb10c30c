"""Console progress: the run's plan first, then each phase's lines with its own rate."""

import importlib
import json
import pathlib
import sys

import pytest

from tree_rl import metrics, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_progress_eta_comes_from_the_phase_own_rate(monkeypatch, capsys):
  now = [1000.0]
  monkeypatch.setattr(metrics.time, "time", lambda: now[0])
  shown = metrics.Progress("RL", 10, "steps", start=4)  # resumed after step 4
  now[0] += 30.0
  shown.update(5, "reward +0.5")  # 1 step in 30 s: 5 steps left, 150 s
  now[0] += 30.0
  shown.update(6)
  now[0] += 5.0
  quiet = metrics.Progress("eval sft", 32, "episodes ended", every_s=60.0)
  now[0] += 1.0
  quiet.update(1)   # the first always prints
  quiet.update(2)   # within a minute: not
  now[0] += 61.0
  quiet.update(20)  # a minute later: printed
  quiet.update(32)  # the last always prints
  lines = capsys.readouterr().err.splitlines()
  assert lines == ["[RL 5/10 steps] reward +0.5 | ETA 150s", "[RL 6/10 steps] | ETA 120s",
                   "[eval sft 1/32 episodes ended] | ETA 31s",
                   "[eval sft 20/32 episodes ended] | ETA 37s",
                   "[eval sft 32/32 episodes ended] | done in 62s"]


def test_a_long_unit_reports_from_inside_at_most_every_30_seconds(monkeypatch, capsys):
  """An RL step can take minutes on a CPU: notes from inside it (rollout done, mini-batch
  updated) print when 30 s passed since the last line of the phase, so a line comes at
  least once a minute."""
  now = [1000.0]
  monkeypatch.setattr(metrics.time, "time", lambda: now[0])
  shown = metrics.Progress("RL", 5, "steps")
  shown.note(1, "initial rollouts of 4 prompts done")  # nothing printed yet: printed
  now[0] += 10.0
  shown.note(1, "mini-batch 1/4 branched and updated")  # 10 s later: not
  now[0] += 25.0
  shown.note(1, "mini-batch 2/4 branched and updated")  # 35 s after the last line
  shown.update(1, "reward +0.1")  # a step's own line always prints
  now[0] += 5.0
  shown.note(2, "initial rollouts of 4 prompts done")  # 5 s after the step's line: not
  assert capsys.readouterr().err.splitlines() == [
      "[RL step 1/5] initial rollouts of 4 prompts done",
      "[RL step 1/5] mini-batch 2/4 branched and updated",
      "[RL 1/5 steps] reward +0.1 | ETA 140s"]


@pytest.mark.e2e
def test_a_run_prints_its_plan_progress_for_every_phase_and_a_paired_test(tmp_path, capsys):
  c = importlib.import_module("configs.apppo").get_config("runlocal")
  train.train_and_evaluate(c, str(tmp_path / "run"))
  captured = capsys.readouterr()
  err = captured.err
  # The summary pairs RL with the SFT policy on the same tasks (tree_rl.stats).
  assert "rl - sft on 2 tasks: " in captured.out and "exact McNemar p = " in captured.out
  comparison = json.loads((tmp_path / "run" / "eval_comparison.json").read_text())
  assert (comparison["a"], comparison["b"], comparison["tasks"]) == ("sft", "rl", 2)
  plan = err.index("tree_rl plan")
  assert "eval base: 2 tasks" in err and "SFT: 1 steps x 2 oracle tasks" in err
  assert "RL: 2 steps x 2 prompts, appo advantages, appo rollouts" in err
  for phase in ("[eval base ", "[SFT 1/1 steps] loss ", "[eval sft ", "[RL 1/2 steps] reward ",
                "[RL 2/2 steps] reward ", "[eval rl "):
    assert err.index(phase) > plan, phase
  assert "PyTorch was not found" not in err and "Waiting for previous save" not in err
