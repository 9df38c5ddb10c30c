"""Model and LoRA configuration, read from (and written back to) HF `config.json`.

One decoder serves the three families because they differ only in two
switches: Qwen2 adds biases to the q/k/v projections, Qwen3 adds an RMSNorm
over each head of q and k. Keeping them in one module (rather than a folder
per family) keeps those differences visible side by side.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# HF architecture name -> family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters (names follow HF's config.json)."""

  family: str  # llama | qwen2 | qwen3
  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_type: str = "default"
  rope_factor: float = 1.0
  # llama3 rope scaling only.
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # bias on q/k/v (Qwen2 always)
  qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
  bos_token_id: int | None = None
  eos_token_id: int | list[int] | None = None
  pad_token_id: int | None = None
  dtype: str = "float32"  # activation dtype; parameters are kept in float32

  def __post_init__(self):
    if self.family not in _MODEL_TYPES:
      raise ValueError(f"family={self.family!r}; supported: {sorted(_MODEL_TYPES)}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type={self.rope_type!r} is not supported; choose one of {ROPE_TYPES}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r}; choose one of {DTYPES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of"
          f" num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

  @property
  def architecture(self) -> str:
    return _MODEL_TYPES[self.family]

  @property
  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    q = self.num_attention_heads * self.head_dim
    kv = self.num_key_value_heads * self.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
    per_layer += (q + 2 * kv) * self.attention_bias + 2 * self.head_dim * self.qk_norm
    return self.num_hidden_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

  # --------------------------------------------------------------------------
  # HF config.json
  # --------------------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
    archs = hf.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
      raise ValueError(
          f"unsupported architecture {archs or hf.get('model_type')!r}; supported:"
          f" {sorted(SUPPORTED_ARCHITECTURES)}")
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias=True is not supported (no Llama/Qwen checkpoint uses it)")
    heads = hf["num_attention_heads"]
    # rope_theta moved under rope_parameters in newer transformers releases.
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    return cls(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        dtype=dtype,
    )

  @classmethod
  def from_hf_folder(cls, path: str | os.PathLike, dtype: str = "float32") -> "ModelConfig":
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
      raise FileNotFoundError(f"{file} not found: not a Hugging Face model folder")
    with open(file) as f:
      return cls.from_hf_dict(json.load(f), dtype)

  def to_hf_dict(self) -> dict[str, Any]:
    out = {
        "architectures": [self.architecture],
        "model_type": self.family,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        "pad_token_id": self.pad_token_id,
    }
    if self.family != "qwen2":  # Qwen2 has no switch: q/k/v always carry a bias.
      out["attention_bias"] = self.attention_bias
    if self.rope_type != "default":
      scaling = {"rope_type": self.rope_type, "factor": self.rope_factor}
      if self.rope_type == "llama3":
        scaling.update(low_freq_factor=self.rope_low_freq_factor,
                       high_freq_factor=self.rope_high_freq_factor,
                       original_max_position_embeddings=self.rope_original_max_position)
      out["rope_scaling"] = scaling
    return out

  @classmethod
  def tiny(cls, family: str = "llama", **overrides) -> "ModelConfig":
    """A small random-init model of the same code (tests, runlocal presets)."""
    base = dict(family=family, vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_theta=10000.0, tie_word_embeddings=family != "qwen3",
                attention_bias=family == "qwen2", qk_norm=family == "qwen3",
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    return cls(**base)

  def inv_frequencies(self):
    """RoPE inverse frequencies [head_dim / 2] (numpy float64), with scaling."""
    import numpy as np

    inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2) / self.head_dim))
    if self.rope_type == "linear":
      inv = inv / self.rope_factor
    elif self.rope_type == "llama3":
      # Llama 3.1 rope scaling: long wavelengths are slowed by `factor`, short
      # ones kept, and the band between is interpolated smoothly.
      low_wavelen = self.rope_original_max_position / self.rope_low_freq_factor
      high_wavelen = self.rope_original_max_position / self.rope_high_freq_factor
      wavelen = 2 * math.pi / inv
      smooth = (self.rope_original_max_position / wavelen - self.rope_low_freq_factor) / (
          self.rope_high_freq_factor - self.rope_low_freq_factor)
      scaled = np.where(wavelen > low_wavelen, inv / self.rope_factor, inv)
      mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
      inv = np.where(mid, (1 - smooth) * inv / self.rope_factor + smooth * inv, scaled)
    return inv


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Low-rank adapters W + (alpha / rank) * B A on the named projections."""

  rank: int = 16
  alpha: float = 32.0
  target_modules: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoRA rank={self.rank} must be >= 1")
    bad = sorted(set(self.target_modules) - set(LORA_TARGETS))
    if bad:
      raise ValueError(f"unknown LoRA target module(s) {bad}; valid: {list(LORA_TARGETS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank
