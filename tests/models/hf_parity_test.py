"""Parity with `transformers` (extra `torch`): tiny random Llama, Qwen2 and
Qwen3 checkpoints written by transformers load into tree_rl with the same
logits, and a tree_rl model exported (LoRA merged) reloads in transformers
with the same logits."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import LoRAConfig
from tree_rl.models.attention import TreeMask
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
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
}


def _hf_model(kind: str, folder: str):
  cfg_cls, model_cls, extra = FAMILIES[kind]
  torch.manual_seed(0)
  cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
  model = getattr(transformers, model_cls)(cfg).eval()
  with torch.no_grad():  # norms start at 1: perturb them so a wrong mapping shows
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(folder)
  return model


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
