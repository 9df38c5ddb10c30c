"""The NNX decoder (Llama / Qwen2 / Qwen3) with tree attention and LoRA.

Layer parameters are stacked along a leading layer axis and the layers run as
one `lax.scan`: a 30-layer model compiles as fast as a 1-layer one, which
matters for CPU runs and for the one-compile-per-bucket rule. Every parameter
carries `logical_axes` metadata that `tree_rl.sharding` maps onto the mesh.

Conventions match Hugging Face so weights convert by a name table
(`tree_rl.models.hf_io`): kernels are stored `[in, out]` (HF's transposed),
RoPE rotates halves (`rotate_half`), RMSNorm normalises in float32, and
Qwen3's q/k norms act per head before RoPE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from tree_rl.models.attention import AttentionConfig, TreeMask, attention
from tree_rl.models.config import LoRAConfig, ModelConfig
from tree_rl.tree.types import Array, Float, Int


class LoRAParam(nnx.Param):
  """LoRA adapter weights: the only trainable parameters when LoRA is on."""


# (name, shape given the config, logical axes, HF projection it belongs to)
def _layer_specs(c: ModelConfig):
  d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
  q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
  specs = [
      ("input_norm", (d,), ("norm",)),
      ("q_proj", (d, q), ("embed", "q_heads")),
      ("k_proj", (d, kv), ("embed", "kv_heads")),
      ("v_proj", (d, kv), ("embed", "kv_heads")),
      ("o_proj", (q, d), ("q_heads", "embed")),
      ("post_norm", (d,), ("norm",)),
      ("gate_proj", (d, f), ("embed", "mlp")),
      ("up_proj", (d, f), ("embed", "mlp")),
      ("down_proj", (f, d), ("mlp", "embed")),
  ]
  if c.attention_bias:
    specs += [("q_bias", (q,), ("q_heads",)), ("k_bias", (kv,), ("kv_heads",)),
              ("v_bias", (kv,), ("kv_heads",))]
    if c.family == "llama":  # Llama's attention_bias also covers o_proj; Qwen2's does not.
      specs.append(("o_bias", (d,), ("embed",)))
  if c.qk_norm:
    specs += [("q_norm", (hd,), ("norm",)), ("k_norm", (hd,), ("norm",))]
  return specs


def rms_norm(x: Array, w: Array, eps: float) -> Array:
  xf = x.astype(jnp.float32)
  xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (w * xf).astype(x.dtype)


def rope(x: Float[Array, "B L H Dh"], positions: Int[Array, "B L"], inv_freq) -> Array:
  """Rotary embedding at explicit positions (HF rotate-half layout)."""
  ang = positions[..., None].astype(jnp.float32) * jnp.asarray(np.asarray(inv_freq), jnp.float32)
  ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]  # [B, L, 1, Dh]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


class Decoder(nnx.Module):
  """Decoder-only transformer over packed trees.

  `hidden(tokens, positions, tree)` gives the final hidden states `[B, L, D]`;
  `logits(...)` projects them on the vocabulary. With `lora`, each targeted
  projection W gains (alpha / r) * A B with A `[in, r]` (random) and B
  `[r, out]` (zeros), so a fresh LoRA model equals its base model.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               attention_config: AttentionConfig = AttentionConfig(), remat: bool = False):
    self.config = config
    self.lora = lora
    self.attention_config = attention_config
    self.remat = remat
    self.inv_freq = tuple(float(f) for f in config.inv_frequencies())  # static, hashable
    c, n = config, config.num_hidden_layers
    init = jax.nn.initializers.normal(0.02)
    self.embed = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size)),
                           logical_axes=("vocab", "embed"))
    self.layer_names = tuple(name for name, _, _ in _layer_specs(c))
    for name, shape, axes in _layer_specs(c):
      if name.endswith("norm"):
        value = jnp.ones((n,) + shape)
      elif name.endswith("bias"):
        value = jnp.zeros((n,) + shape)
      else:
        value = init(rngs.params(), (n,) + shape)
      setattr(self, name, nnx.Param(value, logical_axes=("layers",) + axes))
    self.lora_names = ()
    if lora is not None:
      names = []
      for name, shape, axes in _layer_specs(c):
        if name in lora.target_modules:
          a = jax.random.normal(rngs.params(), (n, shape[0], lora.rank)) / np.sqrt(shape[0])
          setattr(self, f"{name}_lora_a", LoRAParam(a, logical_axes=("layers", axes[0], "lora")))
          setattr(self, f"{name}_lora_b", LoRAParam(jnp.zeros((n, lora.rank, shape[1])),
                                                    logical_axes=("layers", "lora", axes[1])))
          names.append(name)
      self.lora_names = tuple(names)
    self.final_norm = nnx.Param(jnp.ones((c.hidden_size,)), logical_axes=("norm",))
    if not c.tie_word_embeddings:
      self.lm_head = nnx.Param(init(rngs.params(), (c.hidden_size, c.vocab_size)),
                               logical_axes=("embed", "vocab"))

  # --------------------------------------------------------------------------

  def _layer_weights(self) -> dict[str, Array]:
    w = {name: getattr(self, name).get_value() for name in self.layer_names}
    for name in self.lora_names:
      w[f"{name}_lora_a"] = getattr(self, f"{name}_lora_a").get_value()
      w[f"{name}_lora_b"] = getattr(self, f"{name}_lora_b").get_value()
    return w

  def _block(self, x, w, positions, tree: TreeMask):
    c, dt = self.config, x.dtype
    scale = self.lora.scale if self.lora is not None else 0.0

    def proj(name, h):
      y = h @ w[name].astype(dt)
      if f"{name}_lora_a" in w:
        y = y + ((h @ w[f"{name}_lora_a"].astype(dt)) @ w[f"{name}_lora_b"].astype(dt)) * scale
      if f"{name[0]}_bias" in w and name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        y = y + w[f"{name[0]}_bias"].astype(dt)
      return y

    b, l, _ = x.shape
    h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
    q = proj("q_proj", h).reshape(b, l, c.num_attention_heads, c.head_dim)
    k = proj("k_proj", h).reshape(b, l, c.num_key_value_heads, c.head_dim)
    v = proj("v_proj", h).reshape(b, l, c.num_key_value_heads, c.head_dim)
    if c.qk_norm:
      q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
      k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
    q, k = rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq)
    a = attention(q, k, v, tree, self.attention_config).reshape(b, l, -1)
    x = x + proj("o_proj", a)
    h = rms_norm(x, w["post_norm"], c.rms_norm_eps)
    x = x + proj("down_proj", jax.nn.silu(proj("gate_proj", h)) * proj("up_proj", h))
    return x

  def hidden(self, tokens: Int[Array, "B L"], positions: Int[Array, "B L"], tree: TreeMask
             ) -> Float[Array, "B L D"]:
    dt = jnp.dtype(self.config.dtype)
    x = jnp.take(self.embed.get_value(), jnp.maximum(tokens, 0), axis=0).astype(dt)

    def body(x, w):
      return self._block(x, w, positions, tree), None

    if self.remat:
      body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x, _ = lax.scan(body, x, self._layer_weights())
    return rms_norm(x, self.final_norm.get_value(), self.config.rms_norm_eps)

  def head(self) -> Float[Array, "D V"]:
    if self.config.tie_word_embeddings:
      return self.embed.get_value().T
    return self.lm_head.get_value()

  def logits(self, tokens, positions, tree: TreeMask) -> Float[Array, "B L V"]:
    h = self.hidden(tokens, positions, tree)
    return jnp.einsum("bld,dv->blv", h, self.head().astype(h.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens, positions, tree: TreeMask) -> Float[Array, "B L V"]:
    return self.logits(tokens, positions, tree)
