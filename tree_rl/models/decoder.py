"""The NNX decoder (Llama / Qwen2 / Qwen3) with tree attention and LoRA.

Layer parameters are stacked along a leading layer axis and the layers run as
one `lax.scan`: a 30-layer model compiles as fast as a 1-layer one, which
matters for CPU runs and for the one-compile-per-bucket rule. Every parameter
carries `logical_axes` metadata that `tree_rl.sharding` maps onto the mesh.
Sampling is the exception (`CachedDecoder`): there the weights are LoRA-merged
and split per layer (`sampling_weights`) and the layers run unrolled over a
per-layer KV cache, since a decode step is dominated by memory traffic and the
scan re-copied each layer's weights and the stacked cache on every token.

Conventions match Hugging Face so weights convert by a name table
(`tree_rl.models.hf_io`): kernels are stored `[in, out]` (HF's transposed),
RoPE rotates halves (`rotate_half`), RMSNorm normalises in float32,
Qwen3's q/k norms act per head before RoPE, and the MLP is
down(act(gate(h)) * up(h)) with transformers' `hidden_act` functions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import flax.struct
from jax import lax

from tree_rl.models.attention import AttentionConfig, TreeMask, attention, cached_attention
from tree_rl.models.config import LoRAConfig, ModelConfig
from tree_rl.tree.types import Array, Bool, Float, Int


@flax.struct.dataclass
class KVCache:
  """Keys and values of R rows of up to S slots, one array per layer (the sampler's state).

  Row r holds one linear context: slot s has the key/value of its token at
  position s. Which rows hold what is the sampler's bookkeeping, not the cache's.
  One buffer per layer rather than one stacked `[Ly, ...]` array: a decode step
  then updates every layer's buffer in place, where a stacked cache carried
  through the layer scan was rewritten layer by layer (most of a step's time).

  Tiled: the slots are cut into NB blocks of B (S = NB * B), head-major, keys
  transposed inside a block: `k[r, h, j, :, i]` is the key of slot j*B + i.
  So block j of every row is one slice along a major axis (`[:, :, j]`), and
  attention's two products run on it as plain [queries, Dh] x [Dh, B] and
  [queries, B] x [B, Dh] matrix products. Slot-major keys made the score
  product contract both operands' last axis, which XLA:CPU ran several times
  slower, and cutting a block out of a slots-last array was a scalar loop
  (about 1 ms per layer for 16 rows).
  """

  k: tuple[Float[Array, "R Hk NB Dh B"], ...]
  v: tuple[Float[Array, "R Hk NB B Dh"], ...]

  @staticmethod
  def zeros(config: ModelConfig, rows: int, slots: int, dtype=None, block: int = 128
            ) -> "KVCache":
    """An empty cache, in blocks of the largest divisor of `slots` up to `block` (128
    for the usual power-of-two windows; a window with no divisor near 128 makes
    attention visit many small blocks)."""
    c = config
    b = max(d for d in range(1, min(block, slots) + 1) if slots % d == 0)
    hk, dh, nb = c.num_key_value_heads, c.head_dim, slots // b
    dt = jnp.dtype(dtype or c.dtype)
    n = c.num_hidden_layers
    return KVCache(tuple(jnp.zeros((rows, hk, nb, dh, b), dt) for _ in range(n)),
                   tuple(jnp.zeros((rows, hk, nb, b, dh), dt) for _ in range(n)))

  @property
  def rows(self) -> int:
    return self.v[0].shape[0]

  @property
  def block(self) -> int:
    return self.v[0].shape[3]

  @property
  def slots(self) -> int:
    return self.v[0].shape[2] * self.v[0].shape[3]


@flax.struct.dataclass
class SamplingWeights:
  """A Decoder's weights laid out for token-by-token sampling (`Decoder.sampling_weights`).

  LoRA is merged into the base kernels (sampling would otherwise pay the
  adapters' two extra matmuls per projection on every token), and the layer
  stack is split into one dict per layer: the layers then run unrolled, each
  reading its own buffers, where slicing a stacked array inside a layer scan
  copies every layer's weights on every decode step.
  """

  embed: Float[Array, "V D"]
  head: Float[Array, "V D"]  # the LM head as [vocab, embed] (the embedding itself when tied)
  final_norm: Float[Array, "D"]
  layers: tuple[dict[str, Array], ...]

  def decode_bytes(self) -> int:
    """Bytes of weights one decode step reads: every layer's, the final norm and the head
    (of the embedding, only the sampled tokens' rows)."""
    return sum(x.size * x.dtype.itemsize
               for x in jax.tree.leaves((self.layers, self.final_norm, self.head)))


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
    if c.has_o_bias:  # Llama's and Qwen3's attention_bias also covers o_proj; Qwen2's does not.
      specs.append(("o_bias", (d,), ("embed",)))
  if c.qk_norm:
    specs += [("q_norm", (hd,), ("norm",)), ("k_norm", (hd,), ("norm",))]
  return specs


def _gelu_tanh(x):  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
  return jax.nn.gelu(x, approximate=True)


def _gelu_erf(x):  # x Phi(x)
  return jax.nn.gelu(x, approximate=False)


# hidden_act -> the function transformers' ACT2FN gives that name (config.HIDDEN_ACTS).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": _gelu_erf,
    "gelu_python": _gelu_erf,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    # FastGELU writes sqrt(2 / pi) as 0.7978845608: the same function to float32 precision.
    "gelu_fast": _gelu_tanh,
    "gelu_10": lambda x: jnp.clip(_gelu_erf(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.01),  # torch's default slope
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "hardswish": jax.nn.hard_swish,
    # LaplaceActivation(mu=0.707107, sigma=0.282095): the normal CDF at (x - mu) / sigma.
    "laplace": lambda x: 0.5 * (1.0 + lax.erf((x - 0.707107) / (0.282095 * np.sqrt(2.0)))),
    "sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)),
}


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

  def _proj(self, name: str, h: Array, w: dict[str, Array]) -> Array:
    dt = h.dtype
    y = h @ w[name].astype(dt)
    if f"{name}_lora_a" in w:
      scale = self.lora.scale if self.lora is not None else 0.0
      y = y + ((h @ w[f"{name}_lora_a"].astype(dt)) @ w[f"{name}_lora_b"].astype(dt)) * scale
    if f"{name[0]}_bias" in w and name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      y = y + w[f"{name[0]}_bias"].astype(dt)
    return y

  def _qkv(self, x, w, positions):
    """Queries, keys and values of one layer, RoPE applied at `positions`."""
    c = self.config
    b, l, _ = x.shape
    h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
    q = self._proj("q_proj", h, w).reshape(b, l, c.num_attention_heads, c.head_dim)
    k = self._proj("k_proj", h, w).reshape(b, l, c.num_key_value_heads, c.head_dim)
    v = self._proj("v_proj", h, w).reshape(b, l, c.num_key_value_heads, c.head_dim)
    if c.qk_norm:
      q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
      k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
    return rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq), v

  def _finish(self, x, a, w):
    """Output projection and MLP of one layer, given the attention output `a`."""
    c = self.config
    b, l = x.shape[:2]
    x = x + self._proj("o_proj", a.reshape(b, l, -1), w)
    h = rms_norm(x, w["post_norm"], c.rms_norm_eps)
    act = ACTIVATIONS[c.hidden_act]
    mlp = act(self._proj("gate_proj", h, w)) * self._proj("up_proj", h, w)
    return x + self._proj("down_proj", mlp, w)

  def _block(self, x, w, positions, tree: TreeMask):
    q, k, v = self._qkv(x, w, positions)
    return self._finish(x, attention(q, k, v, tree, self.attention_config), w)

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

  def merged_kernel(self, name: str) -> Array:
    """The stacked layer weight `name`, with its LoRA update (scale * A B) folded in."""
    w = getattr(self, name).get_value()
    if name in self.lora_names:
      a = getattr(self, f"{name}_lora_a").get_value()
      b = getattr(self, f"{name}_lora_b").get_value()
      w = w + self.lora.scale * jnp.einsum("lir,lro->lio", a, b)
    return w

  def sampling_weights(self) -> SamplingWeights:
    """This model's weights for `CachedDecoder`: LoRA merged (W + scale A B), layers split.

    The matrices (projections, embedding, head) are stored in the compute dtype, which
    every product casts them to anyway, so a bf16 decode step reads half the bytes of
    the float32 master weights for the same result; norms stay float32, as the learner
    applies them."""
    dt = jnp.dtype(self.config.dtype)
    cast = lambda w: w.astype(dt) if w.ndim == 3 else w  # [layers, in, out] matrices
    stacked = {name: cast(self.merged_kernel(name)) for name in self.layer_names}
    layers = tuple({k: v[i] for k, v in stacked.items()}
                   for i in range(self.config.num_hidden_layers))
    head = self.embed.get_value() if self.config.tie_word_embeddings else self.lm_head.get_value().T
    return SamplingWeights(embed=self.embed.get_value().astype(dt), head=jnp.asarray(head, dt),
                           final_norm=self.final_norm.get_value(), layers=layers)

  def cached(self) -> "CachedDecoder":
    """The model's structure for cached sampling (weights come from `sampling_weights`)."""
    return CachedDecoder(self.config, self.inv_freq)

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


@dataclasses.dataclass(frozen=True)
class CachedDecoder:
  """`Decoder`'s math over a per-row KV cache, for sampling: weights are passed in.

  Hashable and weightless, so a jitted sampler takes it as a static argument
  and the weights (`SamplingWeights`, LoRA merged) as arrays. The projections,
  norms, RoPE and MLP are Decoder's own methods, so both paths compute the same
  function.
  """

  config: ModelConfig
  inv_freq: tuple[float, ...]
  lora = None  # merged into the weights
  _proj = Decoder._proj
  _qkv = Decoder._qkv
  _finish = Decoder._finish

  def extend(self, weights: SamplingWeights, tokens: Int[Array, "W T"], start: Int[Array, "W"],
             rows: Int[Array, "W"], write: Bool[Array, "W T"], cache: KVCache
             ) -> tuple[Float[Array, "W T D"], KVCache]:
    """Run `tokens` on top of cache rows `rows`' contexts, in place (prefill and decode).

    Work row w's tokens go to slots start[w] .. start[w] + T - 1 of cache row
    rows[w], which are also their RoPE positions; each attends to slots 0 ..
    its own of that row. Only tokens with `write` store their key/value (the
    others, padding or finished rows, are dropped, as are writes past the last
    slot), so a call touches exactly its rows' new slots and nothing else.
    The layers run unrolled over per-layer weights and cache buffers, so the
    updates stay in place when the cache is donated.

    Returns:
      final hidden states `[W, T, D]` and the updated cache.
    """
    c = self.config
    dt = jnp.dtype(c.dtype)
    t = tokens.shape[1]
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]
    to = jnp.where(write, rows[:, None], cache.rows)  # row R: out of range, dropped
    jb, ib = slots // cache.block, slots % cache.block
    x = jnp.take(weights.embed, jnp.maximum(tokens, 0), axis=0).astype(dt)
    ks, vs = [], []
    for i, w in enumerate(weights.layers):
      q, k, v = self._qkv(x, w, slots)
      # [W, T, Hk, Dh] into the tiled buffers (`KVCache`).
      kc = cache.k[i].at[to, :, jb, :, ib].set(k.astype(cache.k[i].dtype), mode="drop")
      vc = cache.v[i].at[to, :, jb, ib].set(v.astype(cache.v[i].dtype), mode="drop")
      x = self._finish(x, cached_attention(q, kc, vc, slots, rows), w)
      ks.append(kc)
      vs.append(vc)
    return rms_norm(x, weights.final_norm, c.rms_norm_eps), KVCache(tuple(ks), tuple(vs))

  def logits(self, weights: SamplingWeights, h: Float[Array, "W D"]) -> Float[Array, "W V"]:
    return jnp.einsum("wd,vd->wv", h, weights.head.astype(h.dtype),
                      preferred_element_type=jnp.float32)
