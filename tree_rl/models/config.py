"""Model and LoRA configuration, read from (and written back to) HF `config.json`.

One decoder serves the three families because they differ only in two
switches: Qwen2 adds biases to the q/k/v projections, Qwen3 adds an RMSNorm
over each head of q and k. Keeping them in one module (rather than a folder
per family) keeps those differences visible side by side.

`ModelConfig.from_hf_dict` never guesses: every config.json key is either read
(with the default the transformers config class gives it when absent), known to
leave the logits unchanged, or rejected with an error naming it and its value
unless it holds its neutral value. docs/models.md has the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
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
# `hidden_act` values (transformers' ACT2FN names) that `decoder.ACTIVATIONS` implements.
HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh",
               "gelu_python_tanh", "gelu_fast", "gelu_accurate", "gelu_10", "quick_gelu", "relu",
               "relu2", "relu6", "leaky_relu", "sigmoid", "tanh", "linear", "mish", "hardswish",
               "laplace", "sqrtsoftplus")


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
  hidden_act: str = "silu"  # the MLP's gate activation, act(gate) * up
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
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(
          f"hidden_act={self.hidden_act!r} is not supported; choose one of {HIDDEN_ACTS}")
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
  def has_o_bias(self) -> bool:
    """Llama's and Qwen3's attention_bias also covers o_proj; Qwen2's q/k/v biases do not."""
    return self.attention_bias and self.family != "qwen2"

  @property
  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    q = self.num_attention_heads * self.head_dim
    kv = self.num_key_value_heads * self.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
    per_layer += (q + 2 * kv + d * self.has_o_bias) * self.attention_bias
    per_layer += 2 * self.head_dim * self.qk_norm
    return self.num_hidden_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

  # --------------------------------------------------------------------------
  # HF config.json
  # --------------------------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], dtype: str = "float32") -> "ModelConfig":
    """The config of an HF `config.json` (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM).

    A key absent from `hf` takes the default of the family's transformers config class
    (e.g. Qwen3's head_dim is 128, not hidden_size / num_attention_heads). A key whose value
    would change the computation in a way this decoder does not implement raises ValueError
    naming the key and its value (see `_audit_keys` and docs/models.md).
    """
    if not isinstance(hf, dict):
      raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    family = _family(hf)
    _audit_keys(hf, family)
    get = _Reader(hf, family)
    heads = get.integer("num_attention_heads")
    hidden = get.integer("hidden_size")
    layers = get.integer("num_hidden_layers")
    kv = hf.get("num_key_value_heads", _HF_DEFAULTS[family]["num_key_value_heads"])
    head_dim = hf.get("head_dim", _HF_DEFAULTS[family]["head_dim"])
    if family == "llama" and head_dim is None:  # LlamaConfig.__post_init__
      head_dim = hidden // heads
    elif family == "qwen2" and "head_dim" not in hf:  # Qwen2Attention's getattr fallback
      head_dim = hidden // heads
    rope = _read_rope(hf)
    _check_sliding_window(get, family, layers)
    attention_bias = get.flag("attention_bias")
    if family == "qwen2" and not attention_bias:
      raise ValueError(
          "attention_bias=False is not supported for Qwen2ForCausalLM: its q/k/v projections always"
          " carry a bias (transformers ignores this key for Qwen2)")
    act = get.string("hidden_act")
    if act not in HIDDEN_ACTS:
      why = _REJECTED_ACTS.get(act, "not implemented")
      raise ValueError(
          f"hidden_act={act!r} is not supported ({why}); supported: {list(HIDDEN_ACTS)}")
    return cls(
        family=family,
        vocab_size=get.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get.integer("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_positive_int("num_key_value_heads", heads if kv is None else kv),
        head_dim=_positive_int("head_dim", head_dim),
        hidden_act=act,
        rms_norm_eps=get.number("rms_norm_eps"),
        max_position_embeddings=get.integer("max_position_embeddings"),
        tie_word_embeddings=get.flag("tie_word_embeddings"),
        attention_bias=attention_bias,
        qk_norm=family == "qwen3",
        bos_token_id=get.raw("bos_token_id"),
        eos_token_id=get.raw("eos_token_id"),
        pad_token_id=get.raw("pad_token_id"),
        dtype=dtype,
        **rope,
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
        "hidden_act": self.hidden_act,
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


# ----------------------------------------------------------------------------
# config.json audit
#
# Each key of config.json is read into ModelConfig (with the transformers class
# default when absent), known to leave the logits unchanged (_INERT_KEYS), or
# accepted only at its neutral value (_NEUTRAL_KEYS). The classification follows
# transformers 5.x: LlamaConfig / Qwen2Config / Qwen3Config, PreTrainedConfig
# and the Llama / Qwen2 / Qwen3 modeling code, which reads no other config field.
# ----------------------------------------------------------------------------

# transformers' config-class defaults for keys missing from config.json (the
# rope_theta default, 10000, is RotaryEmbeddingConfigMixin.default_theta).
_COMMON_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                        pad_token_id=None, head_dim=None)
_QWEN_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
                      use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                      layer_types=None)
_HF_DEFAULTS = {
    "llama": _COMMON_DEFAULTS | dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, attention_bias=False),
    # Qwen2Config has no attention_bias: q/k/v always carry one.
    "qwen2": _COMMON_DEFAULTS | _QWEN_DEFAULTS | dict(attention_bias=True),
    "qwen3": _COMMON_DEFAULTS | _QWEN_DEFAULTS | dict(attention_bias=False, head_dim=128),
}
_READ_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
_SLIDING_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
_FAMILY_KEYS = {"llama": _READ_KEYS, "qwen2": _READ_KEYS | _SLIDING_KEYS,
                "qwen3": _READ_KEYS | _SLIDING_KEYS}

# No effect on the logits whatever their value: bookkeeping, runtime switches
# (cache, kernels, output format), classification heads, generation defaults.
# pretraining_tp only splits Llama's matmuls into slices that sum to the same
# product; initializer_range only matters for fresh weights.
_INERT_KEYS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "dtype",
    "torch_dtype", "use_bfloat16", "use_cache", "attn_implementation", "_attn_implementation",
    "_attn_implementation_autoset", "experts_implementation", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "chunk_size_feed_forward",
    "tie_last_hidden_states", "pretraining_tp", "initializer_range", "sep_token_id",
    "decoder_start_token_id", "id2label", "label2id", "num_labels", "problem_type",
    "finetuning_task", "task_specific_params", "prefix", "tokenizer_class", "is_decoder",
    "tie_encoder_decoder", "tf_legacy_loss", "cross_attention_hidden_size",
    # GenerationConfig parameters that transformers pops off model configs.
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids",
    "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "epsilon_cutoff", "eta_cutoff",
    "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "num_beam_groups", "num_beams", "num_return_sequences",
    "output_scores", "remove_invalid_values", "repetition_penalty", "return_dict_in_generate",
    "suppress_tokens", "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
    # Metadata other tools leave in real checkpoints (SmolLM2: nanotron, transformers.js).
    "is_llama_config", "transformers.js_config", "keys_to_ignore_at_inference",
    "unsloth_version", "unsloth_fixed",
})

# Accepted only at a neutral value; key -> (neutral values, why others are rejected).
_NEUTRAL_KEYS = {
    "attention_dropout": ((0, None), "tree_rl applies no dropout, in training either"),
    "mlp_bias": ((False, None),
                 "MLP biases are not implemented; no Llama/Qwen checkpoint has them"),
    "partial_rotary_factor": ((1, None), "RoPE on part of each head is not implemented"),
    "rope_interleaved": ((False, None), "nanotron's interleaved rotary layout; transformers"
                         " ignores this key and rotates halves, as tree_rl does"),
    "pruned_heads": (({}, None), "pruned attention heads are not supported"),
    "add_cross_attention": ((False, None), "cross-attention is not supported"),
    "is_encoder_decoder": ((False, None), "encoder-decoder models are not supported"),
    "per_layer_config": ((None,), "per-layer config overrides are not supported"),
    "quantization_config": ((None,), "quantized checkpoints are not supported; dequantize first"),
    "auto_map": ((None,), "the checkpoint brings its own modeling code (trust_remote_code)"),
}

# Unknown keys whose names contain these look computational: they are rejected
# (unless None / False, a switched-off feature) rather than silently ignored,
# because a key transformers' Llama/Qwen code does not read usually comes from
# another architecture's config whose weights mean something else.
_COMPUTATIONAL = re.compile(
    r"act|attn|attention|bias|dim|dropout|embed|eps|expert|factor|ffn|gate|gating|head|hidden"
    r"|intermediate|kv|layer|logit|mlp|moe|mult|norm|parallel|position|quant|residual|rope"
    r"|rotary|router|scal|softcap|sparse|theta|tie|window|vocab")

# ACT2FN entries that are rejected, with the reason.
_REJECTED_ACTS = {
    "prelu": "a learned activation: its weights have no place in the checkpoint layout",
    "xielu": "a learned activation: its weights have no place in the checkpoint layout",
}

# Keys transformers reads from rope_scaling / rope_parameters, per rope_type
# (besides rope_type / type, rope_theta and partial_rotary_factor).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _family(hf: dict[str, Any]) -> str:
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
  if not archs and model_type in _MODEL_TYPES:  # AutoModel picks the class by model_type
    known = [model_type]
  if not known:
    raise ValueError(f"unsupported architecture {archs or model_type!r}; supported:"
                     f" {sorted(SUPPORTED_ARCHITECTURES)}")
  if len(archs) > 1:
    raise ValueError(f"architectures={archs!r}: expected exactly one architecture")
  family = known[0]
  if model_type is not None and model_type != family:
    raise ValueError(f"model_type={model_type!r} contradicts architectures={archs!r}")
  return family


def _audit_keys(hf: dict[str, Any], family: str) -> None:
  """Rejects keys that would change the logits in a way the decoder does not implement."""
  ignored = []
  for key, value in hf.items():
    if key in _FAMILY_KEYS[family] or key in _INERT_KEYS:
      continue
    if key in _NEUTRAL_KEYS:
      neutral, why = _NEUTRAL_KEYS[key]
      # `is` for None / False / True, == for numbers and {} (so True does not pass as 1).
      if not any(value is n or (type(value) is not bool and value == n) for n in neutral):
        raise ValueError(f"{key}={value!r} is not supported ({why})")
      continue
    if _COMPUTATIONAL.search(key.lower()) and value is not None and value is not False:
      raise ValueError(
          f"{key}={value!r} is not a {_CONFIG_CLASSES[family]} field (transformers'"
          f" {_MODEL_TYPES[family]} ignores it) and its name looks computational: tree_rl does"
          " not guess what it means; remove it from config.json if it has no effect")
    ignored.append(key)
  if ignored:
    warnings.warn(f"config.json keys {sorted(ignored)} are not read by {_MODEL_TYPES[family]};"
                  " ignored", stacklevel=3)


def _positive_int(key: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{key}={value!r} must be a positive integer")
  return value


def _number(key: str, value: Any, positive: bool = True) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
    raise ValueError(f"{key}={value!r} must be a {'positive ' if positive else ''}number")
  return float(value)


class _Reader:
  """Typed reads of config.json keys, absent ones taking the transformers default."""

  def __init__(self, hf: dict[str, Any], family: str):
    self.hf, self.defaults = hf, _HF_DEFAULTS[family]

  def raw(self, key: str) -> Any:
    return self.hf.get(key, self.defaults[key])

  def integer(self, key: str) -> int:
    return _positive_int(key, self.raw(key))

  def number(self, key: str) -> float:
    return _number(key, self.raw(key))

  def flag(self, key: str) -> bool:
    value = self.raw(key)
    if not isinstance(value, bool):
      raise ValueError(f"{key}={value!r} must be true or false")
    return value

  def string(self, key: str) -> str:
    value = self.raw(key)
    if not isinstance(value, str):
      raise ValueError(f"{key}={value!r} must be a string")
    return value


def _read_rope(hf: dict[str, Any]) -> dict[str, Any]:
  """ModelConfig's rope_* fields from rope_scaling / rope_parameters and rope_theta.

  transformers reads rope_scaling when it is set, else rope_parameters (never a
  merge), and takes rope_theta from that dict before the top-level key.
  """
  scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
  if scaling and params and scaling != params:
    raise ValueError(f"rope_scaling={scaling!r} and rope_parameters={params!r} disagree"
                     " (transformers would read rope_scaling only)")
  name = "rope_scaling" if scaling else "rope_parameters"
  rope = scaling or params or {}
  if not isinstance(rope, dict):
    raise ValueError(f"{name}={rope!r} must be a JSON object")
  rope = dict(rope)
  rope_type, legacy = rope.pop("rope_type", None), rope.pop("type", None)
  if rope_type is not None and legacy is not None and rope_type != legacy:
    raise ValueError(f"{name}.rope_type={rope_type!r} and {name}.type={legacy!r} disagree")
  rope_type = rope_type or legacy or "default"
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"{name}.rope_type={rope_type!r} is not supported; choose one of {ROPE_TYPES}")
  inner, outer = rope.pop("rope_theta", None), hf.get("rope_theta")
  if inner is not None and outer is not None and inner != outer:
    raise ValueError(f"{name}.rope_theta={inner!r} and rope_theta={outer!r} disagree")
  theta = next((t for t in (inner, outer) if t is not None), 10000.0)
  partial = rope.pop("partial_rotary_factor", None)
  if partial not in (None, 1) or isinstance(partial, bool):
    raise ValueError(f"{name}.partial_rotary_factor={partial!r} is not supported"
                     f" ({_NEUTRAL_KEYS['partial_rotary_factor'][1]})")
  missing = [k for k in _ROPE_KEYS[rope_type] if rope.get(k) is None]
  if missing:
    raise ValueError(f"{name} with rope_type={rope_type!r} lacks {missing}"
                     " (tree_rl does not assume a value)")
  extra = sorted(set(rope) - set(_ROPE_KEYS[rope_type]))
  if extra:
    raise ValueError(f"{name}.{extra[0]}={rope[extra[0]]!r} is not read for rope_type"
                     f" {rope_type!r} (keys read: {list(_ROPE_KEYS[rope_type])})")
  out = dict(rope_type=rope_type, rope_theta=_number(f"{name}.rope_theta", theta))
  if rope_type in ("linear", "llama3"):
    out["rope_factor"] = _number(f"{name}.factor", rope["factor"])
  if rope_type == "llama3":
    low = _number(f"{name}.low_freq_factor", rope["low_freq_factor"])
    high = _number(f"{name}.high_freq_factor", rope["high_freq_factor"])
    if high <= low:
      raise ValueError(f"{name}.high_freq_factor={high} must exceed low_freq_factor={low}")
    out.update(rope_low_freq_factor=low, rope_high_freq_factor=high,
               rope_original_max_position=_positive_int(
                   f"{name}.original_max_position_embeddings",
                   rope["original_max_position_embeddings"]))
  return out


def _check_sliding_window(get: _Reader, family: str, layers: int) -> None:
  """Rejects a Qwen config whose sliding-window attention would be active.

  As Qwen2Config / Qwen3Config.__post_init__: the window is sliding_window when
  use_sliding_window is true (else None); layer_types, when absent, marks layers
  i >= max_window_layers 'sliding_attention' if there is a window. A sliding layer
  attends to the keys less than sliding_window positions back. tree_rl's attention
  has no window, so only configs where no layer slides are accepted.
  """
  if family not in ("qwen2", "qwen3"):
    return
  use = get.flag("use_sliding_window")
  window = get.raw("sliding_window") if use else None
  types = get.raw("layer_types")
  if types is None:
    first = get.raw("max_window_layers")
    if window is None:
      return
    if isinstance(first, bool) or not isinstance(first, int):
      raise ValueError(f"max_window_layers={first!r} must be an integer")
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    source = f"max_window_layers={first}"
  else:
    if not isinstance(types, list) or len(types) != layers:
      raise ValueError(f"layer_types={types!r} must list one type per layer ({layers})")
    known = ("full_attention", "attention", "sliding_attention")  # "attention": legacy name
    bad = sorted({t for t in types if t not in known})
    if bad:
      raise ValueError(f"layer_types holds {bad}; only 'full_attention' is supported")
    source = "layer_types"
  sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
  if not sliding:
    return
  if window is None:
    raise ValueError(
        f"layer_types marks layers {sliding} 'sliding_attention' but use_sliding_window={use}"
        f" leaves no window (transformers fails on this config)")
  if isinstance(window, bool) or not isinstance(window, int):
    raise ValueError(f"sliding_window={window!r} must be an integer")
  raise ValueError(
      f"use_sliding_window=True with sliding_window={window} makes layers {sliding} ({source})"
      " attend only to the last sliding_window positions; sliding-window attention is not"
      " implemented")


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
