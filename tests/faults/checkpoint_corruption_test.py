"""A damaged checkpoint is never trusted: each step's files are verified against the digests
recorded when it was saved, a step that does not verify is rejected (named with its bad
files) and the newest older step that verifies is restored; garbage collection never
deletes the last verified step before a newer one has verified; when no step verifies the
error names each one and the fix. Unit-level on tiny pytrees, plus one `runlocal` resume.

Corruptions tried: one flipped bit and 64 flipped bytes in a data file, a truncated data
file, a deleted manifest (ours, Orbax's step metadata, an item's _METADATA, its OCDBT
manifest), a deleted `state/` directory, and a step whose read-back fails right after the
save. Each one falls back to the intact older step.
"""

import importlib
import json
import logging
import pathlib
import shutil
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tree_rl import checkpoint, train
from tree_rl.checkpoint import (DIGESTS_FILE, REJECTED_METRIC, CheckpointRejectedError,
                                RunCheckpointer)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
N = 4096


def _weights(step: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(step)
  return {"w": rng.standard_normal(N).astype(np.float32), "b": np.arange(3, dtype=np.int32) + step}


def _target() -> dict[str, np.ndarray]:
  return {"w": np.zeros(N, np.float32), "b": np.zeros(3, np.int32)}


def _saved(directory: pathlib.Path, steps=(0, 1), keep_last: int = 2) -> pathlib.Path:
  ckpt = RunCheckpointer(directory, keep_last=keep_last)
  for s in steps:
    ckpt.save(s, _weights(s), {"step": s}, extra={"p": np.full(2, s, np.float32)})
  ckpt.close()
  return directory


def _data_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The file holding the train state's array bytes (the largest one of `state/`)."""
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


def _raw_restore(directory: pathlib.Path, step: int):
  """What Orbax alone returns for `step`, without verification: the corruption is real."""
  manager = ocp.CheckpointManager(directory, item_handlers={
      "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
  try:
    abstract = {k: np.zeros_like(v) for k, v in checkpoint._leaf_dict(_target()).items()}
    return manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
  finally:
    manager.close()


def _restore_falls_back(directory: pathlib.Path, caplog, bad_file: str) -> RunCheckpointer:
  """Restores `directory` (step 1 damaged): step 0's arrays, step 1 named with `bad_file`."""
  ckpt = RunCheckpointer(directory)
  with caplog.at_level(logging.WARNING):
    state, meta = ckpt.restore(_target())
  assert meta == {"step": 0}
  np.testing.assert_array_equal(state["w"], _weights(0)["w"])
  np.testing.assert_array_equal(state["b"], _weights(0)["b"])
  np.testing.assert_array_equal(ckpt.restore_extra({"p": np.zeros(2, np.float32)})["p"],
                                np.zeros(2, np.float32))  # step 0's, not step 1's
  assert list(ckpt.rejected) == [1] and bad_file in ckpt.rejected[1], ckpt.rejected
  assert ckpt.fallback_metrics() == {REJECTED_METRIC: 1.0, "checkpoint/restored_step": 0.0}
  assert f"{directory}/1 rejected" in caplog.text and bad_file in caplog.text
  assert "falling back to step 0" in caplog.text
  # The damaged step is moved aside with its reason, so the run can save step 1 again.
  assert ckpt.latest_step() == 0
  assert bad_file in (directory / "rejected" / "1" / "tree_rl_rejected.txt").read_text()
  return ckpt


@pytest.mark.parametrize("flip", ["one bit", "64 bytes"])
def test_flipped_bits_in_a_data_file_fall_back_to_the_intact_older_step(tmp_path, caplog, flip):
  directory = _saved(tmp_path / "ck")
  data = _data_file(directory / "1")
  raw = bytearray(data.read_bytes())
  middle = len(raw) // 2
  if flip == "one bit":
    raw[middle] ^= 0x04
  else:
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
  data.write_bytes(bytes(raw))
  try:  # unverified, Orbax restores other weights (or fails): the damage reaches the arrays
    assert not np.array_equal(_raw_restore(directory, 1)["00001"], _weights(1)["w"])
  except Exception:  # noqa: BLE001, S110 (a failure to decode shows the damage as well)
    pass
  ckpt = _restore_falls_back(directory, caplog, data.relative_to(directory / "1").as_posix())
  assert "differ from what was saved (sha256)" in ckpt.rejected[1]
  ckpt.close()


def test_a_truncated_data_file_falls_back_to_the_intact_older_step(tmp_path, caplog):
  directory = _saved(tmp_path / "ck")
  data = _data_file(directory / "1")
  size = data.stat().st_size
  data.write_bytes(data.read_bytes()[:size // 2])
  ckpt = _restore_falls_back(directory, caplog, data.relative_to(directory / "1").as_posix())
  assert f"({size // 2} bytes, {size} saved)" in ckpt.rejected[1]
  assert "truncated" in ckpt.rejected[1]
  ckpt.close()


@pytest.mark.parametrize("manifest", [DIGESTS_FILE, "_CHECKPOINT_METADATA", "state/_METADATA",
                                      "state/manifest.ocdbt"])
def test_a_missing_manifest_falls_back_to_the_intact_older_step(tmp_path, caplog, manifest):
  """Ours (the digests) or Orbax's (the step's metadata, an item's tree metadata, its OCDBT
  manifest): each one gone is a rejected step."""
  directory = _saved(tmp_path / "ck")
  (directory / "1" / manifest).unlink()
  ckpt = _restore_falls_back(directory, caplog, manifest)
  ckpt.close()


def test_a_missing_state_dir_falls_back_to_the_intact_older_step(tmp_path, caplog):
  directory = _saved(tmp_path / "ck")
  shutil.rmtree(directory / "1" / "state")
  ckpt = _restore_falls_back(directory, caplog, "state/")
  assert "directory state/ is missing" in ckpt.rejected[1]
  assert "fresh --workdir" not in caplog.text  # not mistaken for another configuration
  ckpt.close()


def test_a_missing_manifest_on_a_step_killed_before_its_digests_is_rejected(tmp_path):
  """A kill after Orbax finished the step but before its digests were written: Orbax's
  step metadata carries the seal mark, so the step is known to be unverified and the
  resume redoes it from the step before."""
  directory = _saved(tmp_path / "ck", steps=(0,))
  ckpt = RunCheckpointer(directory)
  ckpt.manager.save(1, args=ocp.args.Composite(
      state=ocp.args.StandardSave(checkpoint._leaf_dict(_weights(1))),
      meta=ocp.args.JsonSave({"step": 1})),
      custom_metadata={checkpoint.SEAL_KEY: checkpoint.DIGEST_FORMAT})
  ckpt.close()  # no digests written: the kill
  ckpt = RunCheckpointer(directory)
  state, meta = ckpt.restore(_target())
  assert meta["step"] == 0 and "was killed before writing it" in ckpt.rejected[1]
  np.testing.assert_array_equal(state["w"], _weights(0)["w"])
  ckpt.save(1, _weights(1), {"step": 1})  # the resumed run saves step 1 again
  ckpt.close()


def test_a_step_saved_before_digests_existed_is_restored_with_a_warning(tmp_path, caplog):
  """Pre-digest checkpoints (no manifest, no seal mark) are trusted, with a warning that
  they are unverified; they must not be lost by upgrading tree_rl."""
  directory = _saved(tmp_path / "ck", steps=(0, 1))
  for s in (0, 1):
    (directory / str(s) / DIGESTS_FILE).unlink()
    meta_path = directory / str(s) / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["custom_metadata"] = {}
    meta_path.write_text(json.dumps(meta))
  ckpt = RunCheckpointer(directory)
  with caplog.at_level(logging.WARNING):
    state, meta = ckpt.restore(_target())
  assert meta["step"] == 1 and not ckpt.rejected
  np.testing.assert_array_equal(state["w"], _weights(1)["w"])
  assert "has no digest manifest" in caplog.text and "restored unverified" in caplog.text
  ckpt.close()


def test_a_pre_digest_step_that_cannot_be_read_falls_back(tmp_path, caplog):
  """Without digests a damaged step is only caught when Orbax fails to read it: then it is
  rejected like a verified one, never a traceback from inside Orbax."""
  directory = _saved(tmp_path / "ck", steps=(0, 1))
  for s in (0, 1):
    (directory / str(s) / DIGESTS_FILE).unlink()
    meta_path = directory / str(s) / "_CHECKPOINT_METADATA"
    meta_path.write_text(meta_path.read_text().replace(f'"{checkpoint.SEAL_KEY}"', '"x"'))
  shutil.rmtree(directory / "1" / "state")
  ckpt = RunCheckpointer(directory)
  with caplog.at_level(logging.WARNING):
    state, meta = ckpt.restore(_target())
  assert meta["step"] == 0 and "state/ directory is missing" in ckpt.rejected[1]
  np.testing.assert_array_equal(state["w"], _weights(0)["w"])
  ckpt.close()


def test_no_step_that_verifies_is_an_error_naming_each_step_and_the_fix(tmp_path):
  directory = _saved(tmp_path / "ck")
  _data_file(directory / "0").write_bytes(b"")
  shutil.rmtree(directory / "1" / "state")
  ckpt = RunCheckpointer(directory)
  with pytest.raises(CheckpointRejectedError) as e:
    ckpt.restore(_target())
  text = str(e.value)
  assert f"no checkpoint in {directory} verifies" in text
  assert "step 1: directory state/ is missing" in text
  assert "step 0: file(s) state/" in text and "changed size" in text
  assert "from a backup" in text and f"move {directory} away and relaunch" in text
  assert sorted(ckpt.manager.all_steps()) == [0, 1]  # nothing is moved when nothing verifies
  with pytest.raises(CheckpointRejectedError, match=r"checkpoint .*/1 does not verify .*"
                                                    r"Restore another step"):
    ckpt.restore(_target(), step=1)
  ckpt.close()


def test_a_read_only_checkpointer_falls_back_and_moves_nothing(tmp_path):
  """Another run's checkpoints (config.resume) or a live run read by restore_policy."""
  directory = _saved(tmp_path / "ck")
  _data_file(directory / "1").write_bytes(b"\0")
  ckpt = RunCheckpointer(directory, read_only=True)
  _, meta = ckpt.restore(_target())
  assert meta["step"] == 0 and list(ckpt.rejected) == [1]
  assert sorted(ckpt.manager.all_steps()) == [0, 1] and not (directory / "rejected").exists()
  ckpt.close()


def test_gc_never_deletes_the_last_verified_step_before_a_newer_one_verifies(tmp_path,
                                                                             monkeypatch):
  """keep_last=1: step 1's read-back is made to differ from what was written, so the save
  fails and step 0 (the last verified one) stays; the resume rejects step 1 and restores
  step 0. Only after a new step verifies is step 0 deleted."""
  directory = _saved(tmp_path / "ck", steps=(0,), keep_last=1)
  write = checkpoint.write_digests

  def bit_rot_after_writing(step_dir, step):  # the disk returns other bytes than written
    write(step_dir, step)
    data = _data_file(step_dir)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))

  ckpt = RunCheckpointer(directory, keep_last=1)
  monkeypatch.setattr(checkpoint, "write_digests", bit_rot_after_writing)
  with pytest.raises(OSError, match=r"checkpoint .*/1 does not read back as written: file\(s\) "
                                    r"state/.* differ .*older steps are kept"):
    ckpt.save(1, _weights(1), {"step": 1})
  monkeypatch.setattr(checkpoint, "write_digests", write)
  ckpt.close()
  assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [0, 1]

  ckpt = RunCheckpointer(directory, keep_last=1)
  state, meta = ckpt.restore(_target())
  assert meta["step"] == 0 and list(ckpt.rejected) == [1]
  np.testing.assert_array_equal(state["w"], _weights(0)["w"])
  ckpt.save(1, _weights(1), {"step": 1})  # verified: now step 0 may go
  assert ckpt.manager.all_steps() == [1]
  ckpt.close()
  ckpt = RunCheckpointer(directory, keep_last=1)
  state, meta = ckpt.restore(_target())
  assert meta["step"] == 1 and not ckpt.rejected
  ckpt.close()


def test_a_damaged_latest_step_does_not_cost_the_intact_older_one(tmp_path):
  """The probe's sequence: step 2 damaged, keep_last=2. Before, the resume trained on step 2
  and the next save deleted intact step 1. Now step 2 is rejected, step 1 restored, and the
  saves after it keep two verified steps."""
  directory = _saved(tmp_path / "ck", steps=(0, 1, 2))
  assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [1, 2]
  data = _data_file(directory / "2")
  data.write_bytes(data.read_bytes()[::-1])
  ckpt = RunCheckpointer(directory)
  _, meta = ckpt.restore(_target())
  assert meta["step"] == 1
  ckpt.save(2, _weights(2), {"step": 2})
  assert ckpt.manager.all_steps() == [1, 2]
  ckpt.save(3, _weights(3), {"step": 3})
  assert ckpt.manager.all_steps() == [2, 3]
  ckpt.close()
  assert (directory / "rejected" / "2").is_dir()  # the damaged copy, kept for inspection
  for s in (2, 3):
    assert checkpoint.verify_digests(directory / str(s)) is None


def _raw_steps(directory: pathlib.Path, steps) -> dict[int, dict[str, np.ndarray]]:
  ckpt = RunCheckpointer(directory, read_only=True)
  out = {s: {k: np.asarray(v) for k, v in ckpt.manager.restore(s)["state"].items()}
         for s in steps}
  ckpt.close()
  return out


@pytest.mark.e2e
def test_a_resumed_run_never_trains_on_altered_weights(tmp_path, monkeypatch):
  """runlocal, 1 step (checkpoints at steps 0 and 1): one flipped bit in step 1's data. The
  resumed run restores step 0's arrays exactly, logs the rejection as a metric, redoes
  step 1 and ends where the undamaged run ended, bit for bit."""
  c = importlib.import_module("configs.grpo").get_config("runlocal,steps=1")
  c.ckpt_every_steps, c.sft.steps, c.task.num_eval_tasks = 1, 0, 1
  train.train_and_evaluate(c, str(tmp_path))
  directory = tmp_path / "checkpoints"
  saved = _raw_steps(directory, (0, 1))
  data = _data_file(directory / "1")
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))

  restored = []
  restore = RunCheckpointer.restore

  def spy(self, target, step=None):
    out = restore(self, target, step)
    restored.append({k: np.asarray(v) for k, v in checkpoint._leaf_dict(out[0]).items()})
    return out

  monkeypatch.setattr(RunCheckpointer, "restore", spy)
  out = train.train_and_evaluate(c, str(tmp_path))
  assert out["steps"] == 1
  (got,) = restored
  assert sorted(got) == sorted(saved[0])
  for k in saved[0]:  # the restored arrays are step 0's, not the altered step 1's
    np.testing.assert_array_equal(got[k], saved[0][k], err_msg=k)
  final = _raw_steps(directory, (1,))[1]
  for k in saved[1]:  # step 1 redone from step 0 ends where the undamaged run did
    np.testing.assert_array_equal(final[k], saved[1][k], err_msg=k)
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {"step": 0, "phase": "checkpoint", REJECTED_METRIC: 1.0,
          "checkpoint/restored_step": 0.0} in rows
  assert [r["step"] for r in rows if r["phase"] == "rl"] == [1]
  assert checkpoint.verify_digests(directory / "1") is None  # step 1 saved anew, verified
