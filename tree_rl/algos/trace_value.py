"""TRACE's learned success predictor: a small value model over serialized prefixes.

    V(H) = sigmoid(w . h_last(H) + b)          (TRACE, arXiv 2606.11119, §4.3, Eq. 17)

h_last is the final hidden state, at the last token of the prefix H, of a small
causal decoder (`tree_rl.models.Decoder` at a tiny size) that shares the policy's
vocabulary. The paper's predictor is a pretrained Qwen3-0.6B critic; ours starts
from random weights, which is why its learning rate is far above the paper's
3e-5 (see `ValueHeadConfig`). The head starts at zero, so a fresh predictor says
0.5 everywhere (docs/methods/trace.md#cold-start): stage 1 then gives every prompt 2
roots.

Training (TRACE §4.3 and App. E.6; docs/methods/trace.md#predictor): after a
rollout step, `update(trees)` regresses V on the tree-backed success rates V_hat of eq. 18 by MSE (eq. 19), with
success = clip(outcome, 0, 1) (docs/methods/trace.md#non-binary-rewards;
`tree_rl.rollout.strategies.trace.success`).
The supervision set holds every tree's root (its prompt) and every turn prefix:
each env node that a policy node follows, i.e. a history ending with a tool
reply, the places stage 2 branches from (eq. 7). The paper keeps prefixes at 6%
of the batch; here every prefix of the step counts once (our choice: the trees
of one step are few). The targets come from `tree_rl.algos.trace.backed_up_targets`
on the packed trees. Adam runs `epochs` passes of shuffled minibatches of
`batch_size` examples.

Shapes: a prefix longer than `max_prefix_tokens` is cut from the LEFT (its most
recent tokens are kept: the end of the history decides the state, while the
beginning is the system prompt and tool schemas every prompt of a family
shares). Lengths are padded to power-of-two buckets (at least 64 tokens) and
rows to power-of-two counts, so the jitted forward and update compile once per
bucket, not once per call.

Everything is a pure function of the seed and the trees seen: the weights come
from `nnx.Rngs(seed)`, and the minibatch shuffle of update u from
`np.random.default_rng([seed, u])`. `state_dict()` / `load_state_dict()` carry
the weights, Adam's state and the update count, so a resumed run predicts and
trains exactly like the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tree_rl.algos.trace import backed_up_targets
from tree_rl.models.attention import TreeMask
from tree_rl.models.config import ModelConfig
from tree_rl.models.decoder import Decoder
from tree_rl.tree.batch import Buckets, pack
from tree_rl.tree.rollout_tree import RolloutTree
from tree_rl.tree.types import Array, Float, Int, NodeKind

MIN_BUCKET = 64  # shortest padded prefix length
# Trees per packed batch when the targets are computed: powers of two, so
# `backed_up_targets` compiles once per size class.
_TREE_BUCKETS = tuple(2**i for i in range(16))


@dataclasses.dataclass(frozen=True)
class ValueHeadConfig:
  """The value model and its online training.

  Attributes:
    num_layers, hidden_size, num_heads, intermediate_size: the decoder (head_dim =
      hidden_size / num_heads; key/value heads = query heads).
    max_prefix_tokens: longer prefixes keep their last this many tokens.
    lr: Adam's learning rate. The paper's 3e-5 (1.5e-5 for math) fine-tunes a
      pretrained 0.6B model; a randomly initialised tiny model needs ~1e-3.
    epochs: passes over a step's examples (2: the paper's for QA and FC, App. E.6).
    batch_size: examples per Adam step (not stated in the paper; ours).
    predict_tokens: padded tokens per forward chunk in `predict` (memory bound).
  """

  num_layers: int = 2
  hidden_size: int = 64
  num_heads: int = 4
  intermediate_size: int = 128
  max_prefix_tokens: int = 1024
  lr: float = 1e-3
  epochs: int = 2
  batch_size: int = 16
  predict_tokens: int = 16384

  def __post_init__(self):
    for name in ("num_layers", "hidden_size", "num_heads", "intermediate_size",
                 "max_prefix_tokens", "epochs", "batch_size", "predict_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"ValueHeadConfig.{name}={getattr(self, name)} must be >= 1")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"ValueHeadConfig: hidden_size={self.hidden_size} must be a multiple of "
                       f"num_heads={self.num_heads}")
    if not self.lr > 0:
      raise ValueError(f"ValueHeadConfig.lr={self.lr} must be > 0")


class ValueModel(nnx.Module):
  """A causal decoder with a scalar head on each row's last token (logits of V)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.backbone = Decoder(config, rngs=rngs)
    # Zero head: V = sigmoid(0) = 0.5 for every prefix until the first update.
    self.head_w = nnx.Param(jnp.zeros((config.hidden_size,)))
    self.head_b = nnx.Param(jnp.zeros(()))

  def __call__(self, tokens: Int[Array, "R T"], lengths: Int[Array, "R"]) -> Float[Array, "R"]:
    """Logits of V for R right-padded prefixes of `lengths` tokens (0: padding row)."""
    r, t = tokens.shape
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    h = self.backbone.hidden(tokens, positions, TreeMask.causal(valid))  # [R, T, D]
    last = h[jnp.arange(r), jnp.maximum(lengths - 1, 0)].astype(jnp.float32)
    return last @ self.head_w.get_value() + self.head_b.get_value()


def _next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def supervision_examples(trees: Sequence[RolloutTree]
                         ) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
  """(prefixes, V_hat targets [E], is_root [E]) of the trees' roots and turn prefixes.

  A tree's root example is its prompt; a turn prefix is the context up to an env
  node that a policy node follows. Targets are eq. 18's backed-up success rates:
  the mean of clip(outcome, 0, 1) over every leaf under the node. Trees without
  leaves are skipped.
  """
  canon = [t.canonical() for t in trees if t.leaves]
  if not canon:
    return [], np.zeros(0, np.float32), np.zeros(0, bool)
  batch = pack(canon, Buckets(trees=_TREE_BUCKETS), reward_channels=("outcome",))
  batch = batch.replace(leaf_reward=jnp.clip(batch.leaf_reward, 0.0, 1.0))  # success
  v_hat = jax.device_get(backed_up_targets(batch)[1])
  prefixes, targets, is_root = [], [], []
  for b, tree in enumerate(canon):
    prefixes.append(list(tree.nodes[0].tokens))
    targets.append(v_hat[b, 0])
    is_root.append(True)
    anchors = {node.parent for node in tree.nodes
               if node.kind == NodeKind.POLICY and node.parent >= 0
               and tree.nodes[node.parent].kind == NodeKind.ENV}
    for a in sorted(anchors):
      prefixes.append(tree.context(a))
      targets.append(v_hat[b, a])
      is_root.append(False)
  return prefixes, np.asarray(targets, np.float32), np.asarray(is_root, bool)


class ValueHeadPredictor:
  """TRACE's success predictor V(H) (eq. 17) as a small learned value model.

  Implements `tree_rl.rollout.strategies.trace.SuccessPredictor`: `predict` scores
  prefixes (jitted, bucketed; prefixes over `max_prefix_tokens` are cut from the
  left), `update` fits the step's backed-up success rates by MSE (eqs. 18-19).
  The prediction ignores the task id: everything it knows is in the tokens.

  Args:
    vocab_size: the policy's vocabulary (every token of a prefix is below it).
    seed: initial weights and minibatch shuffles.
    config: sizes and training (defaults: `ValueHeadConfig()`).
  """

  def __init__(self, vocab_size: int, seed: int = 0, config: ValueHeadConfig | None = None):
    self.config = c = config or ValueHeadConfig()
    self.seed = seed
    model_config = ModelConfig.tiny(
        vocab_size=vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_heads, head_dim=c.hidden_size // c.num_heads,
        max_position_embeddings=c.max_prefix_tokens)
    graphdef, self.params = nnx.split(ValueModel(model_config, rngs=nnx.Rngs(seed)))
    self.optimizer = optax.adam(c.lr)
    self.opt_state = self.optimizer.init(self.params)
    self.updates = 0  # update() calls so far: seeds the shuffle of the next one
    self.last_loss = float("nan")

    def forward(params, tokens, lengths):
      return nnx.merge(graphdef, params)(tokens, lengths)

    def loss_fn(params, tokens, lengths, target, weight):
      v = jax.nn.sigmoid(forward(params, tokens, lengths))
      return jnp.sum(weight * (v - target) ** 2) / jnp.maximum(jnp.sum(weight), 1.0)

    def train_step(params, opt_state, tokens, lengths, target, weight):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens, lengths, target, weight)
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    self._predict = jax.jit(lambda p, tokens, lengths: jax.nn.sigmoid(forward(p, tokens, lengths)))
    self._train_step = jax.jit(train_step)

  # ---------------------------------------------------------------------------

  def _bucket(self, n: int) -> int:
    return min(max(_next_pow2(n), MIN_BUCKET), self.config.max_prefix_tokens)

  def _rows(self, prefixes: Sequence[Sequence[int]], rows: int, length: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """[rows, length] right-padded tokens (each prefix's last `length` tokens) and lengths."""
    tokens = np.zeros((rows, length), np.int32)
    lengths = np.zeros(rows, np.int32)
    for i, p in enumerate(prefixes):
      p = list(p)[-length:]
      tokens[i, :len(p)] = p
      lengths[i] = len(p)
    return tokens, lengths

  def predict(self, task_ids: Sequence[str], prefixes: Sequence[Sequence[int]]) -> np.ndarray:
    """[A] success probabilities in (0, 1), float64, one per prefix (task ids unused)."""
    del task_ids
    out = np.zeros(len(prefixes), np.float64)
    by_bucket: dict[int, list[int]] = {}
    for i, p in enumerate(prefixes):
      by_bucket.setdefault(self._bucket(len(p)), []).append(i)
    for length, idx in sorted(by_bucket.items()):
      chunk = max(1, self.config.predict_tokens // length)
      chunk = 1 << (chunk.bit_length() - 1)  # a power of two: few row shapes
      for s in range(0, len(idx), chunk):
        part = idx[s:s + chunk]
        tokens, lengths = self._rows([prefixes[i] for i in part], _next_pow2(len(part)), length)
        v = jax.device_get(self._predict(self.params, *jax.device_put((tokens, lengths))))
        out[part] = v[:len(part)]
    return out

  def update(self, trees: Sequence[RolloutTree]) -> dict[str, float]:
    """`epochs` Adam passes over the trees' (prefix, V_hat) pairs (eqs. 18-19).

    Returns:
      {"predictor_mse_before": MSE of the predictions the step allocated with,
       "predictor_loss": mean minibatch MSE of the last epoch,
       "predictor_examples": E}; {} when no tree has a leaf.
    """
    prefixes, targets, _ = supervision_examples(trees)
    if not prefixes:
      return {}
    c = self.config
    before = float(np.mean((self.predict([""] * len(prefixes), prefixes) - targets) ** 2))
    rng = np.random.default_rng([self.seed, self.updates])
    losses: list[float] = []
    for _ in range(c.epochs):
      order = rng.permutation(len(prefixes))
      losses = []
      for s in range(0, len(order), c.batch_size):
        part = order[s:s + c.batch_size]
        length = self._bucket(max(len(prefixes[i]) for i in part))
        tokens, lengths = self._rows([prefixes[i] for i in part], c.batch_size, length)
        target = np.zeros(c.batch_size, np.float32)
        target[:len(part)] = targets[part]
        weight = (np.arange(c.batch_size) < len(part)).astype(np.float32)
        self.params, self.opt_state, loss = self._train_step(
            self.params, self.opt_state, *jax.device_put((tokens, lengths, target, weight)))
        losses.append(float(jax.device_get(loss)))
    self.updates += 1
    self.last_loss = float(np.mean(losses))
    return {"predictor_mse_before": before, "predictor_loss": self.last_loss,
            "predictor_examples": float(len(prefixes))}

  # ---------------------------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """{"meta": seed and counters (JSON), "arrays": {"params", "opt_state"}} for checkpoints."""
    loss = None if np.isnan(self.last_loss) else self.last_loss  # JSON has no NaN
    return {"meta": {"seed": self.seed, "updates": self.updates, "last_loss": loss},
            "arrays": {"params": self.params, "opt_state": self.opt_state}}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Takes back `state_dict()`'s output (arrays in the same tree structure)."""
    arrays = state["arrays"]
    for name in ("params", "opt_state"):
      want = jax.tree.structure(getattr(self, name))
      got = jax.tree.structure(arrays[name])
      if want != got:
        raise ValueError(f"ValueHeadPredictor.load_state_dict: {name} has structure {got}, "
                         f"this predictor's is {want}")
    self.params = jax.tree.map(jnp.asarray, arrays["params"])
    self.opt_state = jax.tree.map(jnp.asarray, arrays["opt_state"])
    self.seed = int(state["meta"]["seed"])  # the shuffles continue the saved stream
    self.updates = int(state["meta"]["updates"])
    loss = state["meta"]["last_loss"]
    self.last_loss = float("nan") if loss is None else float(loss)
