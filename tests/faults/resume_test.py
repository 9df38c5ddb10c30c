"""Resume loses and duplicates nothing in the log: after a crash between a step's log row
and its checkpoint, the resumed run redoes the step and metrics.jsonl still holds one row
per (phase, step); config.json is written atomically, and resuming with a different config
fails naming the changed keys unless it is allowed explicitly."""

import collections
import importlib
import json
import pathlib
import sys

import pytest

from tree_rl import train

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _rows(workdir):
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


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
