"""Weights in and out of Hugging Face safetensors folders.

The mapping is a table from HF names to (tree_rl parameter, transform):
per-layer HF tensors stack into tree_rl's `[layers, ...]` parameters and HF's
`[out, in]` projection weights transpose into `[in, out]` kernels. Export
runs the table backwards, merging LoRA into the base kernels first, and
writes a folder that `transformers` and vLLM load (safetensors, config.json,
generation_config.json and the tokenizer files of the source model) plus a marker
file (`tree_rl_export.json`) by which a later export knows the folder is its own to
replace: export never deletes a folder it did not write (`save_hf`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from tree_rl.models.attention import AttentionConfig
from tree_rl.models.config import LoRAConfig, ModelConfig
from tree_rl.models.decoder import Decoder

# tree_rl layer parameter -> (HF name under model.layers.{i}., is a projection kernel)
LAYER_TABLE = {
    "input_norm": ("input_layernorm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_safetensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a folder: `model.safetensors` or a sharded index."""
  index = os.path.join(folder, "model.safetensors.index.json")
  single = os.path.join(folder, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(single):
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {folder}")
  out = {}
  for name in files:
    out.update(load_file(os.path.join(folder, name)))
  return out


def _take(tensors: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
  if name not in tensors:
    raise KeyError(f"missing tensor {name!r} in the checkpoint")
  x = tensors.pop(name)
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
  return np.asarray(x, np.float32)


def load_hf(
    folder: str | os.PathLike,
    *,
    dtype: str = "float32",
    lora: LoRAConfig | None = None,
    attention_config: AttentionConfig = AttentionConfig(),
    remat: bool = False,
    seed: int = 0,
) -> Decoder:
  """A Decoder with the weights of an HF folder (LoRA adapters freshly initialised)."""
  config = ModelConfig.from_hf_folder(folder, dtype)
  tensors = read_safetensors(folder)
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(seed), lora=None,
                                         attention_config=attention_config, remat=remat))
  c = config
  embed = _take(tensors, "model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
  model.embed.set_value(jnp.asarray(embed))
  for pname in model.layer_names:
    hf_name, is_kernel = LAYER_TABLE[pname]
    shape = getattr(model, pname).get_value().shape[1:]
    hf_shape = shape[::-1] if is_kernel else shape
    per_layer = [_take(tensors, f"model.layers.{i}.{hf_name}", hf_shape)
                 for i in range(c.num_hidden_layers)]
    stacked = np.stack([x.T if is_kernel else x for x in per_layer])
    getattr(model, pname).set_value(jnp.asarray(stacked))
  model.final_norm.set_value(jnp.asarray(_take(tensors, "model.norm.weight", (c.hidden_size,))))
  if c.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)  # some tied checkpoints store the copy
  else:
    head = _take(tensors, "lm_head.weight", (c.vocab_size, c.hidden_size))
    model.lm_head.set_value(jnp.asarray(head.T))
  left = sorted(k for k in tensors if not k.endswith(_IGNORED_SUFFIXES))
  if left:
    raise ValueError(f"unexpected tensors in {folder} for {c.architecture}: {left[:8]}"
                     f"{' ...' if len(left) > 8 else ''}")
  if lora is None:
    return model
  # LoRA adapters need real random values: build them, then copy the base weights in.
  with_lora = Decoder(config, rngs=nnx.Rngs(seed), lora=lora, attention_config=attention_config,
                      remat=remat)
  nnx.update(with_lora, nnx.state(model))
  return with_lora


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `model`, LoRA merged."""
  c = model.config
  out = {"model.embed_tokens.weight": np.asarray(model.embed.get_value(), np.float32),
         "model.norm.weight": np.asarray(model.final_norm.get_value(), np.float32)}
  for pname in model.layer_names:
    hf_name, is_kernel = LAYER_TABLE[pname]
    stacked = np.asarray(model.merged_kernel(pname), np.float32)
    for i in range(c.num_hidden_layers):
      out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(
          stacked[i].T if is_kernel else stacked[i])
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(np.asarray(model.lm_head.get_value(), np.float32).T)
  return out


EXPORT_MARKER = "tree_rl_export.json"
EXPORT_FORMAT = "tree_rl.hf_export"


def _export_files(folder: str) -> list[str] | None:
  """The files an earlier `save_hf` wrote to `folder`, from its marker; None if no export.

  A marker that does not parse, or names another format, is not an export's.
  """
  try:
    with open(os.path.join(folder, EXPORT_MARKER)) as f:
      marker = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(marker, dict) or marker.get("format") != EXPORT_FORMAT:
    return None
  files = marker.get("files")
  if not isinstance(files, list):
    return None
  return [str(x) for x in files]


def _listing(names: list[str], limit: int = 12) -> str:
  shown = ", ".join(sorted(names)[:limit])
  return shown + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def check_export_target(folder: str | os.PathLike) -> bool:
  """Whether `save_hf` may write `folder`: True if it holds an earlier export (replaced),
  False if it is absent or empty (created); raises if writing would destroy anything.

  Raises:
    FileExistsError: `folder` is a file, or a non-empty folder that is not an earlier
      export (a run's workdir, a source model, ...), or an earlier export to which other
      files were added since. The message names the folder and what is in it.
  """
  folder = os.fspath(folder)
  if not os.path.lexists(folder):
    return False
  if not os.path.isdir(folder) or os.path.islink(folder):
    raise FileExistsError(f"refusing to export to {folder}: it exists and is not a folder")
  present = os.listdir(folder)
  if not present:
    return False
  written = _export_files(folder)
  if written is None:
    raise FileExistsError(
        f"refusing to export to {folder}: it is not empty and not an earlier tree_rl export "
        f"(no {EXPORT_MARKER}), and export would replace it; it holds {_listing(present)}. "
        f"Choose a new or empty folder (e.g. a subfolder)")
  extra = sorted(set(present) - set(written) - {EXPORT_MARKER})
  if extra:
    raise FileExistsError(
        f"refusing to replace the earlier export in {folder}: it holds files the export did "
        f"not write: {_listing(extra)}")
  return True


def _swap(new: str, old: str) -> bool:
  """Atomically exchanges the folders `new` and `old` (Linux renameat2 RENAME_EXCHANGE);
  False where the system cannot, leaving both untouched."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                        ctypes.c_uint]
  if renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(old), rename_exchange) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # kernel or filesystem lacks it
    return False
  raise OSError(err, f"exchanging {new} and {old}: {os.strerror(err)}")


def save_hf(model: Decoder, folder: str | os.PathLike, tokenizer_from: str | None = None) -> str:
  """Writes an HF folder, never destroying anything but an earlier export.

  The folder holds model.safetensors, config.json, generation_config.json, the tokenizer
  files of `tokenizer_from` and the marker `tree_rl_export.json`:
  `{"format": "tree_rl.hf_export", "version": 1, "files": [<the other files written>]}`.
  The marker is how a later export recognises the folder as its own to replace.

  The export is written to a temporary sibling folder (`.export-*` next to `folder`) and
  moved into place once complete: a new folder by a rename; an earlier export by an atomic
  exchange of the two folders (on Linux; elsewhere the old one is renamed aside first), after
  which the old export is removed. A failed export leaves `folder` as it was.

  Raises:
    FileExistsError: `folder` is not empty and is not an earlier export (e.g. a run's
      workdir holding checkpoints/), or is an export with foreign files added; nothing is
      touched (`check_export_target`).
  """
  folder = os.fspath(folder)
  check_export_target(folder)  # fail before the (slow) write
  parent = os.path.dirname(os.path.abspath(folder))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
  try:
    save_file(hf_tensors(model), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    c = model.config
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(c.to_hf_dict(), f, indent=2)
    gen = {k: v for k, v in dict(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                                 pad_token_id=c.pad_token_id).items() if v is not None}
    if tokenizer_from is not None:
      src = os.path.join(tokenizer_from, "generation_config.json")
      if os.path.exists(src):
        with open(src) as f:
          gen = {**json.load(f), **{k: v for k, v in gen.items() if k not in ("eos_token_id",)}}
      for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_from, name)):
          shutil.copy(os.path.join(tokenizer_from, name), os.path.join(tmp, name))
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump(gen, f, indent=2)
    with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
      json.dump({"format": EXPORT_FORMAT, "version": 1,
                 "files": sorted(n for n in os.listdir(tmp) if n != EXPORT_MARKER)}, f, indent=2)
    # Checked again just before the move: the folder may have changed during the write.
    if not check_export_target(folder):
      os.rename(tmp, folder)  # replaces an empty folder only (ENOTEMPTY if it filled since)
    elif _swap(tmp, folder):
      shutil.rmtree(tmp)  # tmp now holds the old export
    else:
      aside = tempfile.mkdtemp(prefix=".export-old-", dir=parent)
      old = os.path.join(aside, "old")
      os.rename(folder, old)
      try:
        os.rename(tmp, folder)
      except BaseException:
        os.rename(old, folder)
        raise
      finally:
        if os.path.lexists(folder):
          shutil.rmtree(aside, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return folder
