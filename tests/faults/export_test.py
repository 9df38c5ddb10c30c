"""HF export never destroys: a non-empty folder that is not an earlier export is refused
untouched (`launch/export_hf.py --out=<the run's workdir>` and `hf_io.save_hf` alike); an
earlier export is replaced whole, with no temporary folder left behind."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from tree_rl.models import Decoder, ModelConfig, hf_io

ROOT = pathlib.Path(__file__).resolve().parents[2]
CFG = ModelConfig.tiny()


def _listing(root: pathlib.Path) -> dict[str, bytes]:
  """Every file under `root` (relative path -> content) and every folder (-> b"<dir>")."""
  out = {}
  for path in sorted(root.rglob("*")):
    out[str(path.relative_to(root))] = b"<dir>" if path.is_dir() else path.read_bytes()
  return out


def _run_workdir(root: pathlib.Path) -> pathlib.Path:
  """A folder laid out like a training run's workdir (what export must never wipe)."""
  run = root / "run"
  (run / "checkpoints" / "2" / "state").mkdir(parents=True)
  (run / "checkpoints" / "2" / "state" / "00000").write_bytes(b"\x00\x01leaf")
  (run / "checkpoints" / "2" / "_CHECKPOINT_METADATA").write_text("{}")
  (run / "config.json").write_text(json.dumps({"seed": 0}))
  (run / "metrics.jsonl").write_text('{"step": 1}\n')
  return run


def _model(seed: int) -> Decoder:
  return Decoder(CFG, rngs=nnx.Rngs(seed))


def test_save_hf_refuses_a_run_workdir_and_a_foreign_folder(tmp_path):
  run = _run_workdir(tmp_path)
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  (other / "model.safetensors").write_bytes(b"not ours")
  before = _listing(tmp_path)
  with pytest.raises(FileExistsError, match=f"{run}.*not an earlier tree_rl export.*checkpoints"):
    hf_io.save_hf(_model(0), run)
  with pytest.raises(FileExistsError, match=f"{other}.*model.safetensors, notes.txt"):
    hf_io.save_hf(_model(0), other)
  # Nothing deleted or changed, and no temporary sibling left behind.
  assert _listing(tmp_path) == before
  # A plain file is refused too.
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileExistsError, match="not a folder"):
    hf_io.save_hf(_model(0), tmp_path / "file")
  assert (tmp_path / "file").read_text() == "x"


@pytest.mark.e2e
def test_export_hf_script_refuses_the_runs_own_workdir(tmp_path):
  run = _run_workdir(tmp_path)
  before = _listing(tmp_path)
  proc = subprocess.run([sys.executable, str(ROOT / "launch/export_hf.py"), f"--workdir={run}",
                         f"--out={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "refusing to export to" in proc.stderr and "checkpoints" in proc.stderr, proc.stderr
  assert _listing(tmp_path) == before


def test_an_earlier_export_is_replaced_whole(tmp_path):
  out = tmp_path / "hf"
  assert hf_io.save_hf(_model(0), out) == str(out)
  marker = json.loads((out / hf_io.EXPORT_MARKER).read_text())
  assert marker["format"] == hf_io.EXPORT_FORMAT
  assert set(marker["files"]) == set(os.listdir(out)) - {hf_io.EXPORT_MARKER}
  first = hf_io.read_safetensors(out)
  hf_io.save_hf(_model(1), out)
  second = hf_io.read_safetensors(out)
  want = hf_io.hf_tensors(_model(1))
  assert set(second) == set(want)
  for name in want:
    np.testing.assert_array_equal(second[name], want[name])
  assert not np.array_equal(first["model.embed_tokens.weight"],
                            second["model.embed_tokens.weight"])
  # Only the export remains: no .export-* temporary or old folder beside it.
  assert sorted(os.listdir(tmp_path)) == ["hf"]
  # It loads back as the new model.
  np.testing.assert_array_equal(np.asarray(hf_io.load_hf(out).embed.get_value()),
                                want["model.embed_tokens.weight"])


def test_an_empty_folder_is_written_and_an_added_file_blocks_replacement(tmp_path):
  out = tmp_path / "hf"
  out.mkdir()
  hf_io.save_hf(_model(0), out)  # an empty folder is fair game
  (out / "checkpoints").mkdir()  # someone put their own things into the export
  (out / "checkpoints" / "keep").write_text("keep")
  before = _listing(tmp_path)
  with pytest.raises(FileExistsError, match="files the export did not write: checkpoints"):
    hf_io.save_hf(_model(1), out)
  assert _listing(tmp_path) == before


def test_a_failed_export_leaves_the_earlier_one(tmp_path, monkeypatch):
  out = tmp_path / "hf"
  hf_io.save_hf(_model(0), out)
  before = _listing(tmp_path)

  def broken(model):
    raise RuntimeError("disk full")

  monkeypatch.setattr(hf_io, "hf_tensors", broken)
  with pytest.raises(RuntimeError, match="disk full"):
    hf_io.save_hf(_model(1), out)
  assert _listing(tmp_path) == before


def test_replacement_without_an_atomic_exchange_still_leaves_one_export(tmp_path, monkeypatch):
  # Where renameat2's exchange is missing, the old export is renamed aside, then removed.
  monkeypatch.setattr(hf_io, "_swap", lambda new, old: False)
  out = tmp_path / "hf"
  hf_io.save_hf(_model(0), out)
  hf_io.save_hf(_model(1), out)
  np.testing.assert_array_equal(hf_io.read_safetensors(out)["model.norm.weight"],
                                hf_io.hf_tensors(_model(1))["model.norm.weight"])
  assert sorted(os.listdir(tmp_path)) == ["hf"]
