"""config.json -> ModelConfig: every key is read, known to be inert, or rejected by name.

Parity of the accepted keys with `transformers` is in hf_parity_test.py; these
tests need no torch.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from tree_rl.models.config import HIDDEN_ACTS, ModelConfig
from tree_rl.models.decoder import ACTIVATIONS

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


def _base(family: str, **overrides) -> dict:
  hf = ModelConfig.tiny(family).to_hf_dict()
  hf.update(overrides)
  return hf


def _load(hf: dict) -> ModelConfig:
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an accepted config loads without "ignored keys" noise
    return ModelConfig.from_hf_dict(hf)


# Configs shaped like the published config.json of SmolLM2-135M-Instruct,
# Qwen2.5-0.5B-Instruct, Qwen3-0.6B and Llama-3.2-1B (their full key sets).
REAL = {
    "smollm2": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
        "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
        "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152},
    "qwen2.5": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
        "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
    "llama3.2": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {
            "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
}


def test_real_configs_load():
  c = {name: _load(hf) for name, hf in REAL.items()}
  assert (c["smollm2"].family, c["smollm2"].head_dim, c["smollm2"].rope_theta) == ("llama", 64, 1e5)
  assert c["qwen2.5"].attention_bias and not c["qwen2.5"].has_o_bias
  assert (c["qwen2.5"].head_dim, c["qwen2.5"].num_key_value_heads) == (64, 2)
  assert c["qwen3"].qk_norm and c["qwen3"].head_dim == 128 and not c["qwen3"].attention_bias
  l3 = c["llama3.2"]
  assert (l3.rope_type, l3.rope_factor, l3.rope_original_max_position) == ("llama3", 32.0, 8192)
  assert all(x.hidden_act == "silu" for x in c.values())


@pytest.mark.parametrize("config", [
    ModelConfig.tiny("llama"),
    ModelConfig.tiny("qwen2"),
    ModelConfig.tiny("qwen3"),
    ModelConfig.tiny("llama", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False,
                     attention_bias=True, rms_norm_eps=1e-5),
    ModelConfig.tiny("qwen3", hidden_act="relu2", attention_bias=True),
    ModelConfig.tiny("llama", rope_type="linear", rope_factor=2.0),
    ModelConfig.tiny("llama", rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_position=64),
])
def test_to_hf_dict_round_trips(config):
  assert _load(config.to_hf_dict()) == config


def test_every_accepted_activation_is_implemented():
  assert set(HIDDEN_ACTS) == set(ACTIVATIONS)
  with pytest.raises(ValueError, match="hidden_act='gelu_tanh'"):  # direct construction too
    dataclasses.replace(ModelConfig.tiny("llama"), hidden_act="gelu_tanh")


def test_missing_keys_take_the_transformers_defaults():
  shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4)
  llama = _load({"architectures": ["LlamaForCausalLM"], **shape})
  assert (llama.num_key_value_heads, llama.head_dim, llama.rms_norm_eps) == (4, 16, 1e-6)
  assert (llama.rope_type, llama.rope_theta, llama.hidden_act) == ("default", 10000.0, "silu")
  assert (llama.bos_token_id, llama.eos_token_id, llama.max_position_embeddings) == (1, 2, 2048)
  assert not llama.tie_word_embeddings and not llama.attention_bias
  # Qwen's class defaults are not derived from the shape: 32 kv heads, Qwen3 head_dim 128.
  qwen3 = _load({"model_type": "qwen3", **shape, "num_attention_heads": 32})
  assert (qwen3.family, qwen3.num_key_value_heads, qwen3.head_dim) == ("qwen3", 32, 128)
  assert qwen3.max_position_embeddings == 32768 and qwen3.bos_token_id is None
  qwen2 = _load({"architectures": ["Qwen2ForCausalLM"], **shape, "num_key_value_heads": 2})
  assert (qwen2.head_dim, qwen2.attention_bias) == (16, True)


def test_inactive_sliding_windows_are_accepted():
  # The window only exists when use_sliding_window is true, and only on sliding layers.
  for family in ("qwen2", "qwen3"):
    _load(_base(family, use_sliding_window=False, sliding_window=4, max_window_layers=0))
    _load(_base(family, use_sliding_window=True, sliding_window=4, max_window_layers=2))
    _load(_base(family, use_sliding_window=True, sliding_window=4))  # max_window_layers=28
    _load(_base(family, use_sliding_window=True, sliding_window=None, max_window_layers=0))
    _load(_base(family, use_sliding_window=True, sliding_window=4,
                layer_types=["full_attention", "attention"]))


@pytest.mark.parametrize("family,overrides,message", [
    # hidden_act
    ("llama", dict(hidden_act="prelu"), r"hidden_act='prelu'.*learned"),
    ("qwen2", dict(hidden_act="gelu_tanh"), r"hidden_act='gelu_tanh'.*not implemented"),
    ("qwen3", dict(hidden_act=None), r"hidden_act=None"),
    # rope_scaling / rope_parameters
    ("llama", dict(rope_scaling={k: v for k, v in LLAMA3.items()
                                 if k != "original_max_position_embeddings"}),
     r"rope_scaling with rope_type='llama3' lacks \['original_max_position_embeddings'\]"),
    ("llama", dict(rope_parameters={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
     r"rope_parameters.*lacks \['low_freq_factor'\]"),
    ("llama", dict(rope_scaling={**LLAMA3, "factor": None}), r"lacks \['factor'\]"),
    ("qwen2", dict(rope_scaling={"type": "linear"}), r"rope_type='linear' lacks \['factor'\]"),
    ("llama", dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}),
     r"high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
    ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64}),
     r"rope_scaling.rope_type='yarn' is not supported"),
    ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     r"rope_type='dynamic'"),
    ("llama", dict(rope_parameters={"rope_type": "default", "factor": 2.0}),
     r"rope_parameters.factor=2.0 is not read for rope_type 'default'"),
    ("llama", dict(rope_scaling={**LLAMA3, "attention_factor": 1.5}),
     r"rope_scaling.attention_factor=1.5"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "type": "default", "factor": 2.0}),
     r"rope_type='linear' and rope_scaling.type='default' disagree"),
    ("llama", dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     r"rope_parameters.rope_theta=500000.0 and rope_theta=10000.0 disagree"),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     r"rope_scaling=.*rope_parameters=.*disagree"),
    ("qwen2", dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     r"rope_parameters.partial_rotary_factor=0.5"),
    ("llama", dict(partial_rotary_factor=0.25), r"partial_rotary_factor=0.25"),
    ("llama", dict(rope_theta=-1.0), r"rope_parameters.rope_theta=-1.0 must be a positive"),
    # sliding windows (Qwen2 / Qwen3)
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"use_sliding_window=True with sliding_window=16 makes layers \[1\] \(max_window_layers=1\)"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"]),
     r"sliding_window=16 makes layers \[0\] \(layer_types\)"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer_types marks layers \[1\] 'sliding_attention' but use_sliding_window=False"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]),
     r"layer_types holds \['chunked_attention'\]"),
    ("qwen3", dict(layer_types=["full_attention"]), r"layer_types=.*one type per layer \(2\)"),
    ("qwen2", dict(use_sliding_window="yes"), r"use_sliding_window='yes' must be true or false"),
    # neutral-only keys
    ("llama", dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    ("qwen2", dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    ("qwen3", dict(attention_dropout=0.1), r"attention_dropout=0.1 is not supported"),
    ("llama", dict(rope_interleaved=True), r"rope_interleaved=True"),
    ("llama", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     r"quantization_config=.*gptq"),
    ("qwen2", dict(auto_map={"AutoModelForCausalLM": "modeling_x.X"}), r"auto_map=.*trust_remote"),
    ("llama", dict(pruned_heads={"0": [1]}), r"pruned_heads="),
    ("llama", dict(is_encoder_decoder=True), r"is_encoder_decoder=True"),
    ("llama", dict(per_layer_config={"0": {"hidden_act": "gelu"}}), r"per_layer_config="),
    # family-specific
    ("qwen2", dict(attention_bias=False), r"attention_bias=False is not supported for Qwen2"),
    ("llama", dict(attention_bias="false"), r"attention_bias='false' must be true or false"),
    ("qwen3", dict(head_dim=None), r"head_dim=None must be a positive integer"),
    # keys no transformers class reads, whose names look computational
    ("llama", dict(sliding_window=4096), r"sliding_window=4096 is not a LlamaConfig field"),
    ("llama", dict(num_experts=8), r"num_experts=8"),
    ("qwen3", dict(final_logit_softcapping=30.0), r"final_logit_softcapping=30.0"),
    ("qwen2", dict(hidden_activation="gelu"), r"hidden_activation='gelu'"),
    # shapes and architecture
    ("llama", dict(num_attention_heads=0), r"num_attention_heads=0 must be a positive integer"),
    ("llama", dict(tie_word_embeddings=1), r"tie_word_embeddings=1 must be true or false"),
    ("llama", dict(model_type="qwen2"), r"model_type='qwen2' contradicts"),
    ("llama", dict(architectures=["MistralForCausalLM"]), r"unsupported architecture"),
])
def test_unsupported_fields_are_rejected_by_name(family, overrides, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_hf_dict(_base(family, **overrides))


def test_unknown_keys_that_look_inert_warn_and_switched_off_ones_pass():
  with pytest.warns(UserWarning, match=r"\['my_notes', 'use_sliding_window'\].*ignored"):
    c = ModelConfig.from_hf_dict(_base("llama", my_notes="fine-tuned by x",
                                       use_sliding_window=False))
  assert c == ModelConfig.tiny("llama")
