"""Weights in and out of Hugging Face safetensors folders.

The mapping is a table from HF names to (tree_rl parameter, transform):
per-layer HF tensors stack into tree_rl's `[layers, ...]` parameters and HF's
`[out, in]` projection weights transpose into `[in, out]` kernels. Export
runs the table backwards, merging LoRA into the base kernels first, and
writes a folder that `transformers` and vLLM load (safetensors, config.json,
generation_config.json and the tokenizer files of the source model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
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


def merged_kernel(model: Decoder, name: str) -> jax.Array:
  """The projection kernel `name` with its LoRA update folded in."""
  w = getattr(model, name).get_value()
  if name in model.lora_names:
    a = getattr(model, f"{name}_lora_a").get_value()
    b = getattr(model, f"{name}_lora_b").get_value()
    w = w + model.lora.scale * jnp.einsum("lir,lro->lio", a, b)
  return w


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `model`, LoRA merged."""
  c = model.config
  out = {"model.embed_tokens.weight": np.asarray(model.embed.get_value(), np.float32),
         "model.norm.weight": np.asarray(model.final_norm.get_value(), np.float32)}
  for pname in model.layer_names:
    hf_name, is_kernel = LAYER_TABLE[pname]
    stacked = np.asarray(merged_kernel(model, pname), np.float32)
    for i in range(c.num_hidden_layers):
      out[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(
          stacked[i].T if is_kernel else stacked[i])
  if not c.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(np.asarray(model.lm_head.get_value(), np.float32).T)
  return out


def save_hf(model: Decoder, folder: str | os.PathLike, tokenizer_from: str | None = None) -> str:
  """Writes an HF folder (atomically: a temp folder renamed into place)."""
  folder = os.fspath(folder)
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
    if os.path.exists(folder):
      shutil.rmtree(folder)
    os.replace(tmp, folder)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return folder
