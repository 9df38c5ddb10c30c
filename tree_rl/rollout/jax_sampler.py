"""The embedded JAX sampler: continuous batching over a persistent row cache, in place.

A `generate` call runs W work slots (W: the number of requests rounded up to a
power of two, at most the cache's rows) through two jitted programs (admit runs
as up to four: see `_prefill_program`) that take the KV cache donated and index
it by row, so nothing but the slots a call needs is read, copied or written:

  * admit: A waiting requests take free slots. Each is given a cache row (the
    row sharing its longest prefix when nothing of that row is lost, else the
    least recently used idle row); a request starting from another row's prefix
    copies only the kept slots of it (`_copy_slots`, block by block up to the
    kept length), then the lead of each group of identical contexts prefills its
    uncached suffix and the others copy the lead's context slots and next-token
    logits, so a shared context is prefilled once. The suffixes are packed:
    cut into 32-token pieces that fill steps of up to 512 tokens
    (`CachedDecoder.extend` on [pieces, 32]), so short suffixes do not pad to
    the longest one.
  * decode: a `lax.while_loop` samples a token for every live slot and feeds it
    (so its KV is cached for the next turn or branch) until every slot is done,
    or, when requests are waiting, until some slot is done: the host then reads
    the finished slots' tokens, admits waiting requests into them, and decoding
    goes on (continuous batching: no finished row idles until the slowest ends,
    and more requests than rows run as one stream, not chunk after chunk).
    With nothing waiting, decoding also stops once at most half the slots are
    live; the host compacts the live slots into a state half as wide (or
    narrower) and decoding goes on there, so the tail of a call, where a few
    long requests outlive the rest, runs on few rows.

Each slot carries its own request's state (step, length, sampling knobs, key),
so a request samples the same tokens whichever slot, batch or admission it gets.
Values that change between calls (lengths, sampling knobs, stop tables) are
arrays, so programs compile once per shape bucket (W, A, prefill steps and pieces,
decode bound, stop table). The weights are `Decoder.sampling_weights()`: LoRA merged
and layers unrolled over per-layer buffers (a stacked layer scan re-copied the
weights and the cache on every token). Host side, `JaxSampler` keeps, for every
row, the tokens whose KV it holds, picks sources and destinations, and applies
stop *strings* on the decoded text (a model may spell "</tool_call>" with other
tokens than the stop table's).

One token is recomputed per reused prefix: a request whose whole context is
cached still runs its last context token, to get the next-token distribution.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax import lax
from jaxtyping import UInt

from tree_rl.models.decoder import CachedDecoder, Decoder, KVCache, SamplingWeights
from tree_rl.rollout.engine import GenerationRequest, GenerationResult
from tree_rl.tree.types import Array, Bool, Float, Int

_REASONS = ("running", "stop", "eos", "length", "context")
_NEG_INF = -jnp.inf


@flax.struct.dataclass
class Prefill:
  """The leads' uncached suffixes, packed: P leads, N steps (n_steps of them real) of L
  pieces of C tokens (`JaxSampler._schedule`).

  P is the cache rows R (padded), so the prefill program's shapes are set by L (and N)
  alone. A step runs its L pieces as one [L, C] `extend`, whichever leads and positions
  they hold, so an admission computes about its real suffix tokens (rounded up to C per
  lead), not P rows padded to the longest suffix.
  """

  new_len: Int[Array, "P"]  # each lead's suffix tokens (0 for padding)
  tokens: Int[Array, "N L C"]
  row: Int[Array, "N L"]  # cache row (R for padding: its writes are dropped)
  start: Int[Array, "N L"]  # slot (and position) of the piece's first token
  length: Int[Array, "N L"]  # its real tokens
  last: Int[Array, "N L"]  # the lead (index into P) whose last token ends it, else P
  n_steps: Int[Array, ""]


@flax.struct.dataclass
class Admission:
  """A requests entering free work slots, some of them leads that prefill their suffixes.

  A is the slot width W (entries padded). Padding entries have slot W and row R (out of
  range), so every write of theirs is dropped. Only the leads of identical contexts
  prefill (`prefill`): the others copy a lead.
  """

  slot: Int[Array, "A"]  # the work slot each request takes
  row: Int[Array, "A"]  # its cache row (distinct, idle)
  src_row: Int[Array, "A"]  # slots [0, copy_len) are copied from this row first
  copy_len: Int[Array, "A"]
  ctx_len: Int[Array, "A"]
  lead: Int[Array, "A"]  # the prefill lead (index into P) whose logits this request takes
  lead_row: Int[Array, "A"]  # after prefill, slots [0, fork_len) are copied from this row
  fork_len: Int[Array, "A"]  # 0 for leads
  prefill: Prefill
  temperature: Float[Array, "A"]
  top_p: Float[Array, "A"]
  top_k: Int[Array, "A"]
  max_new: Int[Array, "A"]
  stop_use: Bool[Array, "A NS"]
  # Entry a's sampling identity, folded into the stream key: (1, seed >> 32, seed mod 2**32)
  # for a seeded request, (0, generate call count, request index) otherwise.
  seeds: UInt[Array, "A 3"]


@flax.struct.dataclass
class SamplerState:
  """The W work slots (the decode loop's carry, kept on device between programs)."""

  row: Int[Array, "W"]  # cache row of the slot's request
  done: Bool[Array, "W"]  # finished, or free
  reason: Int[Array, "W"]  # index into _REASONS
  length: Int[Array, "W"]  # tokens with KV in the row
  t: Int[Array, "W"]  # tokens generated so far: decode step t samples with fold_in(key, t)
  logits: Float[Array, "W V"]  # next-token logits
  window: Int[Array, "W MS"]  # last MS sampled tokens, for stop sequences
  tokens: Int[Array, "W M"]
  logprobs: Float[Array, "W M"]
  entropies: Float[Array, "W M"]
  keys: Array  # [W] typed keys: the slot's request's stream
  temperature: Float[Array, "W"]
  top_p: Float[Array, "W"]
  top_k: Int[Array, "W"]
  max_new: Int[Array, "W"]
  stop_use: Bool[Array, "W NS"]


def row_keys(key: Array, seeds: UInt[Array, "R 3"]) -> Array:
  """[R] typed keys, row r's = fold_in(fold_in(fold_in(key, s0), s1), s2) for s = seeds[r].

  A row's key depends on its own identity only, not on the other rows.
  """
  fold = lambda k, s: jax.random.fold_in(
      jax.random.fold_in(jax.random.fold_in(k, s[0]), s[1]), s[2])
  return jax.vmap(fold, in_axes=(None, 0))(key, seeds.astype(jnp.uint32))


def sample_tokens(logits: Float[Array, "R V"], keys: Array, temperature: Float[Array, "R"],
                  top_p: Float[Array, "R"], top_k: Int[Array, "R"]):
  """Sample one token per row; returns (tokens, policy log-probs, policy entropies).

  Temperature 0 is greedy. Top-k then top-p (over the top-k renormalised
  distribution) restrict the *sampling* distribution only; the returned
  log-prob and entropy are those of the untempered policy. `keys` ([R] typed
  keys) gives every row its own uniform draw, so a row's token does not depend
  on the other rows' keys or on R. Sampling inverts the CDF (`_invert_cdf`):
  one uniform per row instead of V Gumbel draws (on SmolLM2's 49k vocabulary
  at 16 rows, 1.0-1.3 ms a decode step instead of 9-10 ms).
  """
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

  def truncate(s):
    v = s.shape[-1]
    desc = -jnp.sort(-s, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, _NEG_INF)
    cum = jnp.cumsum(jax.nn.softmax(desc, axis=-1), axis=-1)
    n_keep = jnp.minimum(1 + jnp.sum(cum < top_p[:, None], axis=-1), k)
    thr = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(s >= thr, s, _NEG_INF)

  # The sort costs O(V log V) per row: only pay it when some row asks.
  scaled = lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), truncate, lambda s: s, scaled)
  weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # 0 where truncated
  u = 1.0 - jax.vmap(jax.random.uniform)(keys)  # in (0, 1]: never the mass before token 0
  sampled = _invert_cdf(weights, u)
  tok = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return tok, lp, ent


def _invert_cdf(weights: Float[Array, "R V"], u: Float[Array, "R"], block: int = 256
                ) -> Int[Array, "R"]:
  """Row r's token j with cdf[j - 1] < u[r] * total <= cdf[j], cdf the running sum of weights.

  Two levels, blocks of `block` tokens then tokens inside the chosen block, so
  no float32 running sum spans more than max(V / block, block) terms (a
  49k-term one drifts by ~1e-3 of the total). A token of weight 0 is never
  chosen: its cdf step is empty, and where rounding puts the target past the
  last step, the last positive block and token are taken.
  """
  r, v = weights.shape
  nb = -(-v // block)
  w = jnp.pad(weights, ((0, 0), (0, nb * block - v))).reshape(r, nb, block)
  sums = w.sum(-1)  # [R, nb]
  cdf = jnp.cumsum(sums, axis=-1)
  x = u * cdf[:, -1]
  last_b = nb - 1 - jnp.argmax((sums > 0)[:, ::-1], axis=-1)
  b = jnp.minimum(jnp.sum(cdf < x[:, None], axis=-1), last_b)
  inner = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [R, block]
  x = x - (jnp.take_along_axis(cdf, b[:, None], axis=-1)[:, 0] -
           jnp.take_along_axis(sums, b[:, None], axis=-1)[:, 0])
  last_j = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  j = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) < x[:, None], axis=-1), last_j)
  return b * block + j


def _copy_slots(cache: KVCache, src: Int[Array, "A"], dst: Int[Array, "A"],
                n: Int[Array, "A"]) -> KVCache:
  """Copy slots [0, n[a]) of cache row src[a] to row dst[a], in every layer, in place.

  Cache block by cache block up to max(n): only the kept prefix moves, never
  whole rows. Block j of the entries' sources and destinations is gathered
  (contiguous in the tiled `KVCache`), the kept slots taken from the source,
  and the block scattered into the destination rows in place. A block's reads
  all precede its writes, so a row may be one entry's source and another's
  destination. Entries whose dst is R (padding) write nothing. Gathering only
  the entries' rows measured 56 ms for 16 rows x 330 slots over 30 layers,
  slicing every row's block first 140 ms.
  """
  r, b = cache.rows, cache.block
  # Padding entries (dst = R) read row R - 1, and their writes are dropped.
  src_rows, dst_rows = jnp.minimum(src, r - 1), jnp.minimum(dst, r - 1)

  def move(c, j, keep):  # block j of the entries' rows: keys [A, Hk, Dh, B], values [A, Hk, B, Dh]
    new = jnp.where(keep, c[src_rows, :, j], c[dst_rows, :, j])
    return c.at[dst, :, j].set(new, mode="drop")

  def body(j, kv):
    ks, vs = kv
    keep = (j * b + jnp.arange(b))[None, :] < n[:, None]  # [A, B]: entry a keeps slot j*b + i
    keep_k, keep_v = keep[:, None, None, :], keep[:, None, :, None]
    return tuple(move(c, j, keep_k) for c in ks), tuple(move(c, j, keep_v) for c in vs)

  n_blocks = (jnp.max(n) + b - 1) // b
  return KVCache(*lax.fori_loop(0, n_blocks, body, (cache.k, cache.v)))


@dataclasses.dataclass(frozen=True)
class SamplerLoop:
  """The static half of the programs: model structure, decode bound, EOS ids."""

  model: CachedDecoder
  max_new_tokens: int
  eos_ids: tuple[int, ...]

  def admit(self, weights: SamplingWeights, cache: KVCache, st: SamplerState, adm: Admission,
            rng: Array) -> tuple[KVCache, SamplerState]:
    """An admission as one function: what `JaxSampler` runs as `_copy_program`,
    `_prefill_program`, `_copy_program` (forks) and `_seat_program` (lowering exports it)."""
    cache = _copy_slots(cache, adm.src_row, adm.row, adm.copy_len)
    cache, last = self.prefill(weights, cache, adm.prefill)
    cache = _copy_slots(cache, adm.lead_row, adm.row, adm.fork_len)
    return cache, self.seat(weights, st, adm, last, rng)

  def seat(self, weights: SamplingWeights, st: SamplerState, adm: Admission,
           last: Float[Array, "P D"], rng: Array) -> SamplerState:
    """Puts the admitted requests into their work slots, each with its lead's next-token
    logits (from the lead's last hidden state, `prefill`)."""
    logits = self.model.logits(weights, last[adm.lead])
    put = lambda buf, x: buf.at[adm.slot].set(x, mode="drop")
    return SamplerState(
        row=put(st.row, adm.row), done=put(st.done, False), reason=put(st.reason, 0),
        length=put(st.length, adm.ctx_len), t=put(st.t, 0),
        logits=put(st.logits, logits), window=put(st.window, -2),
        tokens=put(st.tokens, -1), logprobs=put(st.logprobs, 0.0),
        entropies=put(st.entropies, 0.0), keys=put(st.keys, row_keys(rng, adm.seeds)),
        temperature=put(st.temperature, adm.temperature), top_p=put(st.top_p, adm.top_p),
        top_k=put(st.top_k, adm.top_k), max_new=put(st.max_new, adm.max_new),
        stop_use=put(st.stop_use, adm.stop_use))

  def prefill(self, weights: SamplingWeights, cache: KVCache, pre: Prefill
              ) -> tuple[KVCache, Float[Array, "P D"]]:
    """Runs the packed suffix pieces step by step; returns the cache and each of the P
    leads' last hidden state.

    Pieces of one entry may share a step: `extend` writes every lane's keys of
    a layer before any lane attends, so a piece sees the earlier pieces' keys
    of the same layer as if they had run before it. Steps past `n_steps` are
    not run (a dynamic trip count), so the step axis is only a shape bucket.
    """
    _, lanes, c = pre.tokens.shape

    def step(i, carry):
      cache, last = carry
      toks, length = pre.tokens[i], pre.length[i]
      write = jnp.arange(c)[None, :] < length[:, None]
      h, cache = self.model.extend(weights, toks, pre.start[i], pre.row[i], write, cache)
      h_end = h[jnp.arange(lanes), jnp.maximum(length - 1, 0)]  # [L, D]
      return cache, last.at[pre.last[i]].set(h_end, mode="drop")

    cfg = self.model.config
    last = jnp.zeros((pre.new_len.shape[0], cfg.hidden_size), jnp.dtype(cfg.dtype))
    return lax.fori_loop(0, pre.n_steps, step, (cache, last))

  def decode(self, weights: SamplingWeights, cache: KVCache, st: SamplerState,
             stop_seqs: Int[Array, "NS MS"], waiting: Bool[Array, ""], shrink_at: Int[Array, ""]
             ) -> tuple[KVCache, SamplerState]:
    """Decode until every slot is done, or (with requests `waiting`) until one more is, or
    until at most `shrink_at` slots are live (the host then compacts them into fewer)."""
    s_len, m = cache.slots, self.max_new_tokens
    w = st.done.shape[0]
    eos = jnp.asarray(self.eos_ids if self.eos_ids else (-3,), jnp.int32)
    done0 = st.done

    def cond(carry):
      st = carry[1]
      live = jnp.sum(~st.done)
      return (live > 0) & ~(waiting & jnp.any(st.done & ~done0)) & (live > shrink_at)

    def body(carry):
      cache, st = carry
      keys = jax.vmap(jax.random.fold_in)(st.keys, st.t)
      tok, lp, ent = sample_tokens(st.logits, keys, st.temperature, st.top_p, st.top_k)
      live = ~st.done
      window = jnp.concatenate([st.window[:, 1:], tok[:, None]], axis=1)
      seq = stop_seqs[None]  # [1, NS, MS]
      hit = jnp.all((seq == window[:, None, :]) | (seq < 0), axis=-1)
      hit = jnp.any(hit & st.stop_use & jnp.any(seq >= 0, axis=-1), axis=-1)
      is_eos = jnp.any(tok[:, None] == eos[None, :], axis=-1)
      new_length = st.length + live.astype(jnp.int32)
      out_of_budget = st.t + 1 >= st.max_new
      full = new_length >= s_len
      reason = jnp.select(
          [~live, is_eos, hit, out_of_budget, full],
          [st.reason, jnp.full_like(st.reason, 2), jnp.full_like(st.reason, 1),
           jnp.full_like(st.reason, 3), jnp.full_like(st.reason, 4)], st.reason)
      done = st.done | (live & (is_eos | hit | out_of_budget | full))
      col = jnp.where(live, st.t, m)  # finished slots write nothing
      put = lambda buf, x: buf.at[jnp.arange(w), col].set(x, mode="drop")
      # Feed the token so its KV is cached (the next turn or branch reuses it).
      h, cache = self.model.extend(weights, tok[:, None], st.length, st.row, live[:, None], cache)
      st = st.replace(
          done=done, reason=reason, length=new_length, t=st.t + live.astype(jnp.int32),
          logits=self.model.logits(weights, h[:, 0]), window=window,
          tokens=put(st.tokens, tok), logprobs=put(st.logprobs, lp),
          entropies=put(st.entropies, ent))
      return cache, st

    return lax.while_loop(cond, body, (cache, st))


# An admission runs as up to four programs, so that the whole model's prefill (30
# unrolled layers, ~4 s to compile) is compiled once per prefill shape (lanes, steps),
# never per slot width: the prefix copies (per entry count; skipped when nothing is
# copied), the prefill (leads padded to the cache rows), the forks' copies, and the seat
# (per slot width: slot bookkeeping and the logits of the entries' last hidden states).
_copy_program = jax.jit(_copy_slots, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _prefill_program(loop: SamplerLoop, weights, cache, pre):
  return loop.prefill(weights, cache, pre)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _seat_program(loop: SamplerLoop, weights, state, adm, last, rng):
  return loop.seat(weights, state, adm, last, rng)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _decode_program(loop: SamplerLoop, weights, cache, state, stop_seqs, waiting, shrink_at):
  return loop.decode(weights, cache, state, stop_seqs, waiting, shrink_at)


@jax.jit
def _compact(state: SamplerState, keep: Int[Array, "W2"]) -> SamplerState:
  """The slots `keep`, in that order, as a narrower state (each carries its whole request)."""
  return jax.tree.map(lambda x: x[keep], state)


def _bucket(n: int, minimum: int = 16) -> int:
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _encode(tokenizer, text: str) -> list[int]:
  ids = tokenizer.encode(text, add_special_tokens=False)
  return list(getattr(ids, "ids", ids))


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode(list(ids), skip_special_tokens=False)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _free_state(w: int, m: int, ns: int, vocab: int, max_stop_tokens: int) -> SamplerState:
  """A call's state of `w` free slots for up to `m` new tokens each and `ns` stop
  sequences: one program per shape, not one op-by-op dispatch per field."""
  i32, f32 = jnp.int32, jnp.float32
  return SamplerState(
      row=jnp.zeros(w, i32), done=jnp.ones(w, bool), reason=jnp.zeros(w, i32),
      length=jnp.zeros(w, i32), t=jnp.zeros(w, i32), logits=jnp.zeros((w, vocab), f32),
      window=jnp.full((w, max_stop_tokens), -2, i32), tokens=jnp.full((w, m), -1, i32),
      logprobs=jnp.zeros((w, m), f32), entropies=jnp.zeros((w, m), f32),
      keys=jax.random.split(jax.random.key(0), w), temperature=jnp.ones(w, f32),
      top_p=jnp.ones(w, f32), top_k=jnp.zeros(w, i32), max_new=jnp.ones(w, i32),
      stop_use=jnp.zeros((w, ns), bool))


class JaxSampler:
  """The embedded RolloutEngine: jitted admit/decode programs over a persistent row cache.

  Args:
    model: the policy (its current weights are taken, LoRA merged; see update_weights).
    rows: KV-cache rows, i.e. the most sequences decoded or kept at once.
    slots: cache length per row, the context window of generation.
    tokenizer: optional (HF `tokenizers` or `transformers`); needed for stop strings.
    eos_ids: token ids that end a generation (finish "eos").
    seed: sampling seed, the stream's key until the first `reseed`.

  Sampling randomness: a request's decode step t uses fold_in(request_key, t),
  with request_key the stream key folded with (1, seed >> 32, seed mod 2**32) for
  a request with a `seed` (independent of the batch: see `GenerationRequest.seed`),
  or with (0, c, i) for one without: the c-th `generate` since the reseed, its
  i-th request (batch-dependent).
  """

  def __init__(self, model: Decoder, *, rows: int = 16, slots: int = 2048, tokenizer=None,
               eos_ids: Sequence[int] = (), seed: int = 0, max_stop_tokens: int = 8,
               prefill_piece: int = 32, prefill_tokens: int = 512):
    self.graphdef = nnx.graphdef(model)
    self.model = model.cached()
    self.weights = model.sampling_weights()
    self.config = model.config
    self.rows, self.slots = rows, slots
    self.tokenizer = tokenizer
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.max_stop_tokens = max_stop_tokens
    self.prefill_piece, self.prefill_tokens = prefill_piece, prefill_tokens
    self.cache = KVCache.zeros(model.config, rows, slots)
    self.row_tokens: list[np.ndarray | None] = [None] * rows
    self.last_used = np.zeros(rows, np.int64)
    self.clock = 0  # admissions so far: the rows' LRU clock
    self.calls = 0
    self.rng = jax.random.key(seed)
    # nonfinite_tokens: sampled from a non-finite logits row (their log-prob is not finite:
    # the tree fails its checks and never reaches a loss; see RolloutTree.check).
    self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0,
                  "nonfinite_tokens": 0}

  # ------------------------------------------------------------------------

  def update_weights(self, params: Any) -> None:
    """Take new policy weights (an `nnx.State` of the same graph, or a Decoder).

    They are merged (LoRA folded into the base kernels) once here, not on every
    token. The cached KV was computed with the old weights, so the row cache is reset.
    """
    model = params if isinstance(params, nnx.Module) else nnx.merge(self.graphdef, params)
    self.weights = model.sampling_weights()
    self.row_tokens = [None] * self.rows

  def reseed(self, key: Array) -> None:
    """Restart the sampling stream at `key` (the trainer reseeds every step from
    (seed, step), so a resumed run samples exactly what the uninterrupted run did;
    seeded requests then sample from (key, request seed) alone).

    It also forgets the cached rows: a reused prefix skips its prefill, which changes how
    the call's other tokens are batched and so the floating-point sums behind every later
    logit. Then what a stream samples depends on the weights, the key and its requests
    only, never on what the sampler ran before (an evaluation, the SFT phase, an earlier
    step, or nothing, in a resumed process). Within the stream, prefixes are reused as
    before; across steps a weight update clears the rows anyway.
    """
    self.rng, self.calls = key, 0
    self.row_tokens = [None] * self.rows
    self.last_used[:] = 0
    self.clock = 0

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Continuous batching: requests wait in order and take work slots as slots free up."""
    results: list[GenerationResult | None] = [None] * len(requests)
    todo = []
    for i, req in enumerate(requests):
      if not req.tokens:
        raise ValueError(f"request {i} has an empty context")
      if len(req.tokens) >= self.slots:  # no room for even one new token
        results[i] = GenerationResult((), (), (), "context")
      else:
        todo.append(i)
    if not todo:
      return results  # type: ignore[return-value]
    self.calls += 1
    strings, table = self._stop_table(requests)
    w = min(self.rows, _bucket(len(todo), 1))
    m = _bucket(max(requests[i].params.max_new_tokens for i in todo))
    loop = SamplerLoop(self.model, m, self.eos_ids)
    state = _free_state(w, m, table.shape[0], self.config.vocab_size, self.max_stop_tokens)
    stop_seqs = jax.device_put(table)
    queue = collections.deque(todo)
    slot_req, slot_row = [-1] * w, [-1] * w  # the request each slot runs, and its row
    prefill: dict[int, int] = {}
    while queue or max(slot_req) >= 0:
      free = [k for k in range(w) if slot_req[k] < 0]
      batch = [queue.popleft() for _ in range(min(len(free), len(queue)))]
      if batch:
        busy = {slot_row[k] for k in range(w) if slot_req[k] >= 0}
        adm, dest, copies, forks = self._admission(requests, batch, free, w, busy, strings,
                                                   table.shape[0], prefill)
        for k, i, d in zip(free, batch, dest):
          slot_req[k], slot_row[k] = i, d
        if copies:  # kept prefixes from other rows
          self.cache = _copy_program(self.cache, adm.src_row, adm.row, adm.copy_len)
        self.cache, last = _prefill_program(loop, self.weights, self.cache, adm.prefill)
        if forks:  # identical contexts copy their lead's
          self.cache = _copy_program(self.cache, adm.lead_row, adm.row, adm.fork_len)
        state = _seat_program(loop, self.weights, state, adm, last, self.rng)
      # With nothing waiting, decoding stops early once at most half the slots are live,
      # and the live ones go on in a state half as wide (a finished slot would otherwise
      # run every layer until the slowest request of the call ends).
      shrink_at = -1 if queue else w // 2
      self.cache, state = _decode_program(loop, self.weights, self.cache, state, stop_seqs,
                                          jnp.asarray(bool(queue)), jnp.asarray(shrink_at))
      done, reason, tokens, logprobs, entropies = jax.device_get(
          (state.done, state.reason, state.tokens, state.logprobs, state.entropies))
      for k in range(w):
        i = slot_req[k]
        if i < 0 or not done[k]:
          continue
        req = requests[i]
        results[i] = self._result(req, tokens[k], logprobs[k], entropies[k], int(reason[k]),
                                  prefill[i])
        self.row_tokens[slot_row[k]] = np.concatenate(
            [np.asarray(req.tokens, np.int32), np.asarray(results[i].tokens, np.int32)])
        slot_req[k] = -1
      live = [k for k in range(w) if slot_req[k] >= 0]
      if not queue and live and len(live) <= w // 2:
        w = _bucket(len(live), 1)
        keep = live + [k for k in range(len(slot_req)) if slot_req[k] < 0][:w - len(live)]
        state = _compact(state, jnp.asarray(keep, jnp.int32))
        slot_req, slot_row = [slot_req[k] for k in keep], [slot_row[k] for k in keep]
    return results  # type: ignore[return-value]

  # ------------------------------------------------------------------------

  def _lcp(self, tokens: np.ndarray) -> tuple[int, int]:
    """(row, length) of the cached row sharing the longest prefix with `tokens`."""
    best_row, best = 0, 0
    for row, cached in enumerate(self.row_tokens):
      if cached is None:
        continue
      n = min(len(cached), len(tokens))
      neq = np.flatnonzero(cached[:n] != tokens[:n])
      lcp = int(neq[0]) if neq.size else n
      if lcp > best:
        best_row, best = row, lcp
    return best_row, best

  def _stop_table(self, requests: Sequence[GenerationRequest]):
    strings = sorted({s for req in requests for s in req.params.stop})
    if strings and self.tokenizer is None:
      raise ValueError(f"stop strings {strings} need a tokenizer; pass tokenizer= to JaxSampler")
    seqs = []
    for s in strings:
      ids = _encode(self.tokenizer, s)
      if not ids or len(ids) > self.max_stop_tokens:
        raise ValueError(f"stop string {s!r} encodes to {len(ids)} tokens; "
                         f"1..{self.max_stop_tokens} are supported")
      seqs.append(ids)
    ns = _bucket(max(len(seqs), 1), 1)
    table = np.full((ns, self.max_stop_tokens), -1, np.int32)
    for j, ids in enumerate(seqs):
      table[j, -len(ids):] = ids
    return strings, table

  def _admission(self, requests: Sequence[GenerationRequest], batch: list[int], slots: list[int],
                 w: int, busy: set[int], strings: list[str], ns: int, prefill: dict[int, int]
                 ) -> tuple[Admission, list[int], bool, bool]:
    """Rows, prefix sources and prefill suffixes for requests `batch` entering `slots`;
    also whether some entry copies a kept prefix, and whether some copies its lead.

    Rows of running slots (`busy`) are never destinations, but may be sources:
    a running row's context slots do not change. A row may be one entry's
    source and another's destination (copies read before they write).
    """
    ctx = [np.asarray(requests[i].tokens, np.int32) for i in batch]
    # Group identical contexts: one lead entry prefills, the others copy it.
    leads: dict[tuple[int, ...], int] = {}
    for e, i in enumerate(batch):
      leads.setdefault(requests[i].tokens, e)
    # Destinations: a lead extends its source row in place when nothing of that
    # row is lost; everything else takes the least recently used idle row.
    sources = {e: self._lcp(ctx[e]) for e in leads.values()}
    dest = [-1] * len(batch)
    taken = set(busy)
    for e in leads.values():
      row, lcp = sources[e]
      cached = self.row_tokens[row]
      if cached is not None and lcp == len(cached) and row not in taken:
        dest[e] = row
        taken.add(row)
    idle = [int(r) for r in np.argsort(self.last_used, kind="stable") if r not in taken]
    for e in range(len(batch)):
      if dest[e] < 0:
        dest[e] = idle.pop(0)
        taken.add(dest[e])

    # Entries padded to the slot width; leads to the cache rows (the prefill's shape is then
    # set by its lanes alone).
    a, pad = w, self.rows
    slot = np.full(a, w, np.int32)  # padding: out of range, its writes are dropped
    slot[:len(batch)] = slots[:len(batch)]
    row = np.full(a, self.rows, np.int32)
    row[:len(batch)] = dest
    src_row, copy_len, ctx_len, lead, lead_row, fork_len = (np.zeros(a, np.int32)
                                                            for _ in range(6))
    p_row = np.full(pad, self.rows, np.int32)
    keep_len, new_len = np.zeros(pad, np.int32), np.zeros(pad, np.int32)
    suffixes = []
    lead_index = {}
    for p, (key, e) in enumerate(leads.items()):
      src, lcp = sources[e]
      keep = min(lcp, len(key) - 1)  # the last context token always runs
      src_row[e], copy_len[e] = src, (keep if src != dest[e] else 0)
      p_row[p], keep_len[p], new_len[p] = dest[e], keep, len(key) - keep
      suffixes.append(ctx[e][keep:])
      lead_index[key] = p
      self.stats["reused_tokens"] += keep
    pieces = self._schedule(suffixes, p_row, keep_len)
    temperature, top_p = np.ones(a, np.float32), np.ones(a, np.float32)
    top_k, max_new = np.zeros(a, np.int32), np.ones(a, np.int32)
    stop_use = np.zeros((a, ns), bool)
    seeds = np.zeros((a, 3), np.uint32)
    self.clock += 1
    for e, i in enumerate(batch):
      req = requests[i]
      ctx_len[e] = len(ctx[e])
      lead[e] = lead_index[req.tokens]
      first = leads[req.tokens]
      if first != e:  # a fork: copies its lead's context, prefills nothing
        lead_row[e], fork_len[e] = dest[first], len(ctx[e])
      prefill[i] = int(new_len[lead[e]]) if first == e else 0
      p = req.params
      temperature[e], top_p[e], top_k[e], max_new[e] = (p.temperature, p.top_p, p.top_k,
                                                         p.max_new_tokens)
      stop_use[e, :len(strings)] = [s in p.stop for s in strings]
      seeds[e] = ((1, req.seed >> 32, req.seed & 0xFFFFFFFF) if req.seed is not None
                  else (0, self.calls, i))
      # The row holds the context once admitted (its generated tokens follow at the end).
      self.row_tokens[dest[e]] = ctx[e]
      self.last_used[dest[e]] = self.clock
    host = dict(slot=slot, row=row, src_row=src_row, copy_len=copy_len, ctx_len=ctx_len,
                lead=lead, lead_row=lead_row, fork_len=fork_len, temperature=temperature,
                top_p=top_p, top_k=top_k, max_new=max_new, stop_use=stop_use, seeds=seeds)
    adm = Admission(prefill=Prefill(**jax.device_put(dict(new_len=new_len, **pieces))),
                    **jax.device_put(host))
    return adm, dest, bool(copy_len.any()), bool(fork_len.any())

  def _schedule(self, suffixes: list[np.ndarray], rows: np.ndarray, starts: np.ndarray
                ) -> dict[str, np.ndarray]:
    """Packs the leads' suffixes into steps of L pieces of C tokens (`Prefill`'s fields).

    C is `prefill_piece` (32: a suffix wastes fewer positions than that). L is the piece
    count's power of two, at most `prefill_tokens // C` (a step of ~512 tokens keeps the
    matmuls large). Only the real steps run, so the step axis is a shape only: one step
    when the pieces fit in one (L below its most), else the most any admission can need
    (every row's whole context). The prefill program's shapes are then set by L alone
    (its leads are padded to the cache rows, `_admission`; the slot width is only the
    small copy and seat programs'): ~4 s a compile, which power-of-two buckets for the
    step count, the entries, the leads, C and the width paid 17 times in the main job's
    first two RL steps.
    Pieces go in entry order, so a step holds nearby positions of few entries and its
    attention reads few blocks.
    """
    c = self.prefill_piece
    plan = [(p, o) for p, x in enumerate(suffixes) for o in range(0, len(x), c)]
    most_lanes = max(1, self.prefill_tokens // c)
    lanes = min(_bucket(len(plan), 1), most_lanes)
    steps = -(-len(plan) // lanes)
    most_steps = -(-self.rows * -(-self.slots // c) // lanes)  # every row, every slot
    shape = (most_steps if lanes == most_lanes else 1, lanes)
    tokens = np.zeros(shape + (c,), np.int32)
    row = np.full(shape, self.rows, np.int32)
    start, length = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    last = np.full(shape, len(rows), np.int32)
    for j, (p, o) in enumerate(plan):
      i, k = divmod(j, lanes)
      piece = suffixes[p][o:o + c]
      tokens[i, k, :len(piece)] = piece
      row[i, k], start[i, k], length[i, k] = rows[p], starts[p] + o, len(piece)
      if o + c >= len(suffixes[p]):
        last[i, k] = p
    return dict(tokens=tokens, row=row, start=start, length=length, last=last,
                n_steps=np.asarray(steps, np.int32))

  def _result(self, req: GenerationRequest, tokens, logprobs, entropies, reason: int,
              prefill: int) -> GenerationResult:
    """A finished slot's result, stop strings applied on the host."""
    n = int((tokens >= 0).sum())
    gen = tokens[:n]
    finish, stop = _REASONS[reason], None
    if finish == "stop" or (self.tokenizer is not None and req.params.stop):
      cut, stop = self._stop_cut(gen, req.params.stop)
      if stop is not None:
        n, finish = cut, "stop"
    self.stats["prefill_tokens"] += prefill
    self.stats["generated_tokens"] += n
    bad = int((~np.isfinite(logprobs[:n])).sum())
    if bad:
      self.stats["nonfinite_tokens"] += bad
      logging.warning("JaxSampler: %d of %d sampled tokens came from non-finite logits", bad, n)
    return GenerationResult(
        tokens=tuple(int(x) for x in gen[:n]), logprobs=tuple(float(x) for x in logprobs[:n]),
        entropies=tuple(float(x) for x in entropies[:n]), finish_reason=finish, stop=stop,
        prefill_tokens=prefill)

  def _stop_cut(self, gen: np.ndarray, stops: Sequence[str]) -> tuple[int, str | None]:
    """(tokens to keep, stop string) for the earliest token completing a stop string."""
    if not stops or self.tokenizer is None or len(gen) == 0:
      return len(gen), None
    text = _decode(self.tokenizer, gen)
    if not any(s in text for s in stops):
      return len(gen), None
    lo, hi = 1, len(gen)  # smallest prefix whose text contains a stop string
    while lo < hi:
      mid = (lo + hi) // 2
      if any(s in _decode(self.tokenizer, gen[:mid]) for s in stops):
        hi = mid
      else:
        lo = mid + 1
    prefix = _decode(self.tokenizer, gen[:lo])
    first = min((prefix.find(s), s) for s in stops if s in prefix)[1]
    return lo, first
