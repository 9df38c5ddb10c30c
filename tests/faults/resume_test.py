"""Resume loses and duplicates nothing in the log: after a crash between a step's log row
and its checkpoint, the resumed run redoes the step and metrics.jsonl still holds one row
per (phase, step); config.json is written atomically, and resuming with a different config
fails naming the changed keys unless it is allowed explicitly."""

import collections
import importlib
import json
import pathlib
import sys

import numpy as np
import pytest

from tree_rl import train
from tree_rl.checkpoint import RunCheckpointer
from tree_rl.metrics import MetricWriter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _rows(workdir):
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_a_crash_before_the_checkpoint_leaves_one_row_per_step(tmp_path, monkeypatch):
  c = importlib.import_module("configs.grpo").get_config("runlocal,steps=3")
  c.ckpt_every_steps = 2
  save = train.save_run

  def crash_at_3(ckpt, step, *args):
    if step == 3:
      raise KeyboardInterrupt("killed after step 3 was logged, before its checkpoint")
    save(ckpt, step, *args)

  monkeypatch.setattr(train, "save_run", crash_at_3)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(c, str(tmp_path))
  assert [r["step"] for r in _rows(tmp_path) if r["phase"] == "rl"] == [1, 2, 3]
  monkeypatch.setattr(train, "save_run", save)
  out = train.train_and_evaluate(c, str(tmp_path))
  assert out["steps"] == 3
  rows = _rows(tmp_path)
  count = collections.Counter((r["phase"], r["step"]) for r in rows)
  assert max(count.values()) == 1, count
  assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2, 3]
  assert {r["phase"] for r in rows} >= {"rl", "eval:base", "eval:rl"}
  if c.sft.steps:
    assert [r["step"] for r in rows if r["phase"] == "sft"] == list(range(c.sft.steps))
  assert not list(tmp_path.glob("*.tmp"))

  c.optim.lr = 1e-3  # another experiment in the same workdir
  c.num_steps = 4  # running longer is allowed
  with pytest.raises(ValueError, match=r"another config \(optim\.lr: .* -> 0\.001\).*"
                                       r"allow_config_change"):
    train.train_and_evaluate(c, str(tmp_path))
  out = train.train_and_evaluate(c, str(tmp_path), allow_config_change=True)
  assert out["steps"] == 4
  assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 1e-3
  assert [r["step"] for r in _rows(tmp_path) if r["phase"] == "rl"] == [1, 2, 3, 4]


def test_a_torn_last_metrics_row_is_dropped_on_resume(tmp_path):
  """A kill in the middle of a write leaves half a line; the resumed run drops it (its step
  is redone) and keeps every complete row."""
  rows = [{"step": 1, "phase": "rl", "loss": 0.5}, {"step": 2, "phase": "rl", "loss": 0.25}]
  text = "".join(json.dumps(r) + "\n" for r in rows)
  (tmp_path / "metrics.jsonl").write_text(text + '{"step": 3, "phase": "rl", "lo')
  writer = MetricWriter(tmp_path)
  assert writer.keep_only(lambda row: True) == 0
  writer.write(3, {"loss": 0.125})
  writer.close()
  assert _rows(tmp_path) == rows + [{"step": 3, "phase": "rl", "loss": 0.125}]


def test_a_garbage_metrics_row_is_skipped_naming_the_file_and_line(tmp_path, caplog):
  """A damaged line in the middle of metrics.jsonl is skipped with a warning that names
  the file and the line; every other row is kept."""
  rows = [{"step": 1, "phase": "rl", "loss": 0.5}, {"step": 2, "phase": "rl", "loss": 0.25}]
  (tmp_path / "metrics.jsonl").write_text(
      json.dumps(rows[0]) + "\n\x00\x07garbage{\n[1, 2]\n" + json.dumps(rows[1]) + "\n")
  writer = MetricWriter(tmp_path)
  with caplog.at_level("WARNING"):
    assert writer.keep_only(lambda row: True) == 0
  writer.close()
  assert _rows(tmp_path) == rows
  text = caplog.text
  assert "metrics.jsonl line 2 is not JSON" in text and "line 3 is not a row object" in text


def test_a_truncated_config_json_fails_naming_the_file_and_the_fix(tmp_path):
  from tree_rl.checkpoint import write_run_config  # noqa: PLC0415

  write_run_config(tmp_path, {"optim": {"lr": 1e-3}}, resuming=False)
  path = tmp_path / "config.json"
  path.write_text(path.read_text()[:7])  # cut mid-write by something outside tree_rl
  with pytest.raises(ValueError, match=r"config.json is not valid JSON .* resume with "
                                       r"--allow_config_change"):
    write_run_config(tmp_path, {"optim": {"lr": 1e-3}}, resuming=True)
  write_run_config(tmp_path, {"optim": {"lr": 1e-3}}, resuming=True, allow_change=True)
  assert json.loads(path.read_text()) == {"optim": {"lr": 1e-3}}


def test_a_saved_checkpoint_step_is_never_silently_kept_over(tmp_path):
  """Orbax does not overwrite a step; saving one again is an error, not a silent no-op."""
  ckpt = RunCheckpointer(tmp_path)
  ckpt.save(0, {"w": np.ones(2, np.float32)}, {"step": 0})
  with pytest.raises(ValueError, match="exists already"):
    ckpt.save(0, {"w": np.zeros(2, np.float32)}, {"step": 0})
  state, meta = ckpt.restore({"w": np.zeros(2, np.float32)})
  ckpt.close()
  np.testing.assert_array_equal(state["w"], np.ones(2, np.float32))
