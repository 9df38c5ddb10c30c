"""Parity with `transformers` (extra `torch`): tiny random Llama, Qwen2 and
Qwen3 checkpoints written by transformers load into tree_rl with the same
logits (every accepted hidden_act, rope type and attention variant), and a
tree_rl model exported (LoRA merged) reloads in transformers with the same
logits."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import LoRAConfig
from tree_rl.models.attention import TreeMask
from tree_rl.models.config import HIDDEN_ACTS, ModelConfig
from tree_rl.models.decoder import ACTIVATIONS, Decoder
from tree_rl.models.hf_io import load_hf, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=5e5)),
    "llama_untied_bias": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=False, attention_bias=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="linear", factor=4.0))),
    # head_dim != hidden_size / heads, and an eps that matters at these activation sizes.
    "llama_head_dim": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32, rms_norm_eps=1e-2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # A window that would bite at 24 tokens, switched off: every layer attends fully.
    "qwen2_window_off": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=False, sliding_window=8, max_window_layers=0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_bias": ("Qwen3Config", "Qwen3ForCausalLM", dict(attention_bias=True)),  # o_proj too
    # use_sliding_window on, but max_window_layers=2 leaves no sliding layer.
    "qwen3_window_unused": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        use_sliding_window=True, sliding_window=8, max_window_layers=2)),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def _save(cfg_cls: str, model_cls: str, extra: dict, folder: str, gate_scale: float = 1.0):
  """A random transformers model of `extra` config, saved to `folder`.

  gate_scale multiplies gate_proj so the activation sees inputs of order +-10,
  not the +-0.5 of the initialisation (where most activations look alike).
  """
  torch.manual_seed(0)
  cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
  model = getattr(transformers, model_cls)(cfg).eval()
  with torch.no_grad():  # norms start at 1: perturb them so a wrong mapping shows
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
      if "gate_proj" in name:
        p.mul_(gate_scale)
  model.save_pretrained(folder)
  return model


def _hf_model(kind: str, folder: str):
  cfg_cls, model_cls, extra = FAMILIES[kind]
  return _save(cfg_cls, model_cls, extra, folder)


def _tokens(seed=0, batch=2, length=24):
  return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], (batch, length))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _ours(model, tokens):
  valid = jnp.ones(tokens.shape, bool)
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(model(jnp.asarray(tokens), pos, TreeMask.causal(valid)))


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_load_matches_transformers(kind, tmp_path):
  hf = _hf_model(kind, str(tmp_path))
  ours = load_hf(str(tmp_path))
  toks = _tokens()
  np.testing.assert_allclose(_ours(ours, toks), _hf_logits(hf, toks), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_export_with_merged_lora_reloads_in_transformers(kind, tmp_path):
  _hf_model(kind, str(tmp_path / "src"))
  ours = load_hf(str(tmp_path / "src"), lora=LoRAConfig(rank=4, alpha=8.0))
  # Give the adapters non-zero B so the merge is exercised.
  for name in ours.lora_names:
    b = getattr(ours, f"{name}_lora_b")
    b.set_value(0.05 * jax.random.normal(jax.random.key(len(name)), b.get_value().shape))
  toks = _tokens(1)
  want = _ours(ours, toks)
  save_hf(ours, str(tmp_path / "out"))
  with open(tmp_path / "out" / "config.json") as f:
    assert json.load(f)["architectures"] == [FAMILIES[kind][1]]
  back = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "out"), local_files_only=True, dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(back, toks), want, atol=1e-4, rtol=1e-4)
  # And the exported folder loads back into tree_rl unchanged.
  again = load_hf(str(tmp_path / "out"))
  np.testing.assert_allclose(_ours(again, toks), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# hidden_act
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("act", HIDDEN_ACTS)
def test_activation_matches_act2fn(act):
  from transformers.activations import ACT2FN

  x = np.concatenate([np.linspace(-12, 12, 2401), [-1e3, -30, 30, 1e3]]).astype(np.float32)
  want = ACT2FN[act](torch.tensor(x)).numpy()
  np.testing.assert_allclose(np.asarray(ACTIVATIONS[act](jnp.asarray(x))), want,
                             rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("act", HIDDEN_ACTS)
def test_load_matches_transformers_for_every_activation(act, tmp_path):
  family = ("llama", "qwen2", "qwen3")[HIDDEN_ACTS.index(act) % 3]
  hf = _save(*CLASSES[family], dict(hidden_act=act), str(tmp_path), gate_scale=25.0)
  ours = load_hf(str(tmp_path))
  assert ours.config.hidden_act == act
  toks = _tokens()
  np.testing.assert_allclose(_ours(ours, toks), _hf_logits(hf, toks), atol=1e-4, rtol=1e-4)


def test_gelu_llama_is_not_run_as_silu(tmp_path):
  """The bug this guards: hidden_act was ignored, so GELU checkpoints ran SiLU."""
  hf = _save("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu"), str(tmp_path),
             gate_scale=25.0)
  ours = load_hf(str(tmp_path))
  as_silu = Decoder(dataclasses.replace(ours.config, hidden_act="silu"), rngs=nnx.Rngs(0))
  nnx.update(as_silu, nnx.state(ours))
  toks = _tokens()
  want = _hf_logits(hf, toks)
  np.testing.assert_allclose(_ours(ours, toks), want, atol=1e-4, rtol=1e-4)
  assert np.abs(_ours(as_silu, toks) - want).max() > 1e-2


# ----------------------------------------------------------------------------
# Sliding windows and config defaults
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_active_sliding_window_is_rejected(family, tmp_path):
  window = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
  hf = _save(*CLASSES[family], window, str(tmp_path))
  # save_pretrained writes the layer_types that max_window_layers derived.
  with pytest.raises(ValueError, match=r"use_sliding_window=True with sliding_window=8 makes"
                                       r" layers \[1\] \(layer_types\)"):
    load_hf(str(tmp_path))
  # Why it must be rejected: transformers' logits change past the window, not before it.
  full = _save(*CLASSES[family], {}, str(tmp_path / "full"))
  toks = _tokens()
  a, b = _hf_logits(hf, toks), _hf_logits(full, toks)
  np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-5)
  assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_missing_keys_default_as_in_transformers(family):
  """A config.json with only the architecture and shapes reads as transformers reads it."""
  hf = {"architectures": [CLASSES[family][1]], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 32}
  ours = ModelConfig.from_hf_dict(hf)
  theirs = getattr(transformers, CLASSES[family][0])(**hf)
  assert ours.head_dim == getattr(theirs, "head_dim", 64 // 32)
  assert ours.num_key_value_heads == theirs.num_key_value_heads
  assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
  assert ours.rope_type == theirs.rope_parameters["rope_type"]
  for key in ("rms_norm_eps", "hidden_act", "max_position_embeddings", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id"):
    assert getattr(ours, key) == getattr(theirs, key), key
  assert ours.attention_bias == getattr(theirs, "attention_bias", True)  # Qwen2: always
