"""The embedded JAX sampler: batched prefill + decode in one jitted program, with a row cache.

Device side, one program per shape bucket (work rows W, slots S, prefill length
T, decode bound M, stop-sequence table) does, for the call's W rows at once (W:
the number of requests rounded up to a power of two, at most the cache's rows,
so a call with 2 requests costs 2 rows of work, not the whole cache):

  1. gather rows of the KV cache (`src_rows`): a request starts from the cached
     row that shares its longest prefix (possibly another request's row),
  2. prefill each lead row's uncached suffix (`Decoder.extend`),
  3. gather again (`fork_src`): k requests with the same context copy the lead
     row's KV after its prefill, so a shared context is prefilled once,
  4. decode in a `lax.while_loop` over a typed `SamplerState` until every row
     has hit EOS, a stop sequence, its token budget or the end of the cache,
  5. scatter the W work rows back into their cache rows (`rows`).

Values that change between calls (lengths, sampling knobs, stop tables) are
arrays, so they do not recompile; the cache is donated. Host side, `JaxSampler`
keeps, for every row, the tokens whose KV it holds, picks sources and
destinations (longest common prefix, least recently used), and applies stop
*strings* on the decoded text (a model may spell "</tool_call>" with other
tokens than the stop table's).

One token is recomputed per reused prefix: a request whose whole context is
cached still runs its last context token, to get the next-token distribution.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jaxtyping import UInt

from tree_rl.models.decoder import Decoder, KVCache
from tree_rl.rollout.engine import GenerationRequest, GenerationResult
from tree_rl.tree.types import Array, Bool, Float, Int

_REASONS = ("running", "stop", "eos", "length", "context")
_NEG_INF = -jnp.inf


@flax.struct.dataclass
class SamplerInputs:
  """Per-call arrays (W work rows; T prefill tokens; NS stop sequences of up to MS tokens).

  A call works on W of the cache's rows (the requests' rows, W a power of two),
  so its prefill and decode cost scales with the requests, not the cache.
  """

  rows: Int[Array, "W"]  # the cache rows this call writes (distinct)
  src_rows: Int[Array, "W"]  # work row w starts as a copy of cache row src_rows[w]
  keep_len: Int[Array, "W"]  # cached tokens kept in work row w (its prefill starts there)
  new_tokens: Int[Array, "W T"]  # suffix to prefill (lead rows), padded
  new_len: Int[Array, "W"]
  fork_src: Int[Array, "W"]  # after prefill, work row w copies work row fork_src[w]
  active: Bool[Array, "W"]  # rows that generate in this call
  temperature: Float[Array, "W"]
  top_p: Float[Array, "W"]
  top_k: Int[Array, "W"]
  max_new: Int[Array, "W"]
  stop_seqs: Int[Array, "NS MS"]  # right-aligned token sequences, -1 padded on the left
  stop_use: Bool[Array, "W NS"]
  # Row w's sampling identity, folded into the stream key: (1, seed >> 32, seed mod 2**32)
  # for a seeded request, (0, device call count, w) otherwise (`GenerationRequest.seed`).
  seeds: UInt[Array, "W 3"]


@flax.struct.dataclass
class SamplerState:
  """The decode loop's carry."""

  step: Int[Array, ""]
  done: Bool[Array, "R"]
  reason: Int[Array, "R"]  # index into _REASONS
  length: Int[Array, "R"]  # tokens with KV in the row
  logits: Float[Array, "R V"]  # next-token logits
  window: Int[Array, "R MS"]  # last MS sampled tokens, for stop sequences
  tokens: Int[Array, "R M"]
  logprobs: Float[Array, "R M"]
  entropies: Float[Array, "R M"]
  cache: KVCache
  rng: Array  # [R] typed keys: row r's stream; decode step t samples with fold_in(rng[r], t)


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
  keys) gives every row its own Gumbel noise, so a row's token does not depend
  on the other rows' keys or on R.
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
  sampled = jax.vmap(lambda k, s: jax.random.categorical(k, s, axis=-1))(keys, scaled)
  tok = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
  ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return tok, lp, ent


@dataclasses.dataclass(frozen=True)
class SamplerLoop:
  """The static half of the program: model structure, decode bound, EOS ids."""

  graphdef: Any
  max_new_tokens: int
  eos_ids: tuple[int, ...]
  prefill_chunk: int = 256

  def run(self, params, cache: KVCache, inp: SamplerInputs, rng: Array) -> SamplerState:
    model: Decoder = nnx.merge(self.graphdef, params)
    full_cache = cache
    r, s_len = inp.src_rows.shape[0], cache.slots
    head = model.head()
    # 1-2: start from the best cached row, prefill the uncached suffix.
    cache = KVCache(cache.k[:, inp.src_rows], cache.v[:, inp.src_rows])
    last, cache = self._prefill(model, cache, inp)
    logits = jnp.einsum("rd,dv->rv", last, head.astype(last.dtype),
                        preferred_element_type=jnp.float32)
    # 3: branches copy their lead row (KV and next-token logits).
    cache = KVCache(cache.k[:, inp.fork_src], cache.v[:, inp.fork_src])
    logits = logits[inp.fork_src]
    length = (inp.keep_len + inp.new_len)[inp.fork_src]
    m, ms = self.max_new_tokens, inp.stop_seqs.shape[1]
    state = SamplerState(
        step=jnp.zeros((), jnp.int32), done=~inp.active,
        reason=jnp.zeros((r,), jnp.int32), length=length, logits=logits,
        window=jnp.full((r, ms), -2, jnp.int32), tokens=jnp.full((r, m), -1, jnp.int32),
        logprobs=jnp.zeros((r, m), jnp.float32), entropies=jnp.zeros((r, m), jnp.float32),
        cache=cache, rng=row_keys(rng, inp.seeds))
    eos = jnp.asarray(self.eos_ids if self.eos_ids else (-3,), jnp.int32)

    def cond(st: SamplerState):
      return (st.step < m) & ~jnp.all(st.done)

    def body(st: SamplerState) -> SamplerState:
      keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(st.rng, st.step)
      tok, lp, ent = sample_tokens(st.logits, keys, inp.temperature, inp.top_p, inp.top_k)
      live = ~st.done
      window = jnp.concatenate([st.window[:, 1:], tok[:, None]], axis=1)
      seq = inp.stop_seqs[None]  # [1, NS, MS]
      hit = jnp.all((seq == window[:, None, :]) | (seq < 0), axis=-1)
      hit = jnp.any(hit & inp.stop_use & jnp.any(seq >= 0, axis=-1), axis=-1)
      is_eos = jnp.any(tok[:, None] == eos[None, :], axis=-1)
      new_length = st.length + live.astype(jnp.int32)
      out_of_budget = st.step + 1 >= inp.max_new
      full = new_length >= s_len
      reason = jnp.select(
          [~live, is_eos, hit, out_of_budget, full],
          [st.reason, jnp.full_like(st.reason, 2), jnp.full_like(st.reason, 1),
           jnp.full_like(st.reason, 3), jnp.full_like(st.reason, 4)], st.reason)
      done = st.done | (live & (is_eos | hit | out_of_budget | full))
      put = lambda buf, x, fill: buf.at[:, st.step].set(jnp.where(live, x, fill))
      # Feed the token so its KV is cached (the next turn or branch reuses it).
      h, cache = model.extend(tok[:, None], st.length, st.cache)
      logits = jnp.einsum("rd,dv->rv", h[:, 0], head.astype(h.dtype),
                          preferred_element_type=jnp.float32)
      return SamplerState(
          step=st.step + 1, done=done, reason=reason, length=new_length, logits=logits,
          window=window, tokens=put(st.tokens, tok, -1), logprobs=put(st.logprobs, lp, 0.0),
          entropies=put(st.entropies, ent, 0.0), cache=cache, rng=st.rng)

    out = lax.while_loop(cond, body, state)
    # The work rows go back to their cache rows; every other row is untouched.
    return out.replace(cache=KVCache(full_cache.k.at[:, inp.rows].set(out.cache.k),
                                     full_cache.v.at[:, inp.rows].set(out.cache.v)))

  def _prefill(self, model: Decoder, cache: KVCache, inp: SamplerInputs):
    """Runs the suffixes in chunks of `prefill_chunk` tokens; returns each row's last hidden.

    Chunking bounds the attention scores at [R, H, chunk, S] instead of
    [R, H, T, S]; chunks past every row's suffix are skipped.
    """
    r, t = inp.new_tokens.shape
    c = min(t, self.prefill_chunk)  # both powers of two: c divides t
    chunks = jnp.moveaxis(inp.new_tokens.reshape(r, t // c, c), 1, 0)

    def step(carry, xs):
      cache, last = carry
      i, toks = xs

      def run(args):
        cache, last = args
        h, cache = model.extend(toks, inp.keep_len + i * c, cache)
        idx = inp.new_len - 1 - i * c  # a row's last suffix token, if in this chunk
        h_idx = jnp.take_along_axis(h, jnp.clip(idx, 0, c - 1)[:, None, None], axis=1)[:, 0]
        return cache, jnp.where(((idx >= 0) & (idx < c))[:, None], h_idx, last)

      return lax.cond(jnp.any(inp.new_len > i * c), run, lambda a: a, (cache, last)), None

    last = jnp.zeros((r, model.config.hidden_size), jnp.dtype(model.config.dtype))
    (cache, last), _ = lax.scan(step, (cache, last), (jnp.arange(t // c), chunks))
    return last, cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _run(loop: SamplerLoop, params, cache, inp, rng):
  return loop.run(params, cache, inp, rng)


def _bucket(n: int, minimum: int = 16) -> int:
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _encode(tokenizer, text: str) -> list[int]:
  ids = tokenizer.encode(text, add_special_tokens=False)
  return list(getattr(ids, "ids", ids))


def _decode(tokenizer, ids) -> str:
  return tokenizer.decode(list(ids), skip_special_tokens=False)


class JaxSampler:
  """The embedded RolloutEngine: a jitted sampler over a persistent row cache.

  Args:
    model: the policy (its current weights are copied in; see update_weights).
    rows: KV-cache rows, i.e. the most sequences generated or kept at once.
    slots: cache length per row, the context window of generation.
    tokenizer: optional (HF `tokenizers` or `transformers`); needed for stop strings.
    eos_ids: token ids that end a generation (finish "eos").
    seed: sampling seed, the stream's key until the first `reseed`.

  Sampling randomness: a request's decode step t uses fold_in(row_key, t), with
  row_key the stream key folded with (1, seed >> 32, seed mod 2**32) for a request
  with a `seed` (independent of the batch: see `GenerationRequest.seed`), or with
  (0, c, i) for one without: the c-th device call since the reseed (a `generate`
  of more requests than `rows` makes several), its i-th row (batch-dependent).
  """

  def __init__(self, model: Decoder, *, rows: int = 16, slots: int = 2048, tokenizer=None,
               eos_ids: Sequence[int] = (), seed: int = 0, max_stop_tokens: int = 8):
    self.graphdef, self.params = nnx.split(model)
    self.config = model.config
    self.rows, self.slots = rows, slots
    self.tokenizer = tokenizer
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.max_stop_tokens = max_stop_tokens
    self.cache = KVCache.zeros(model.config, rows, slots)
    self.row_tokens: list[np.ndarray | None] = [None] * rows
    self.last_used = np.zeros(rows, np.int64)
    self.calls = 0
    self.rng = jax.random.key(seed)
    self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0}

  # ------------------------------------------------------------------------

  def update_weights(self, params: Any) -> None:
    """Take new policy weights (an `nnx.State` of the same graph, or a Decoder).

    The cached KV was computed with the old weights, so the row cache is reset.
    """
    if isinstance(params, nnx.Module):
      params = nnx.split(params)[1]
    self.params = params
    self.row_tokens = [None] * self.rows

  def reseed(self, key: Array) -> None:
    """Restart the sampling stream at `key` (the trainer reseeds every step from
    (seed, step), so a resumed run samples exactly what the uninterrupted run did;
    seeded requests then sample from (key, request seed) alone)."""
    self.rng, self.calls = key, 0

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    results: list[GenerationResult | None] = [None] * len(requests)
    todo = []
    for i, req in enumerate(requests):
      if not req.tokens:
        raise ValueError(f"request {i} has an empty context")
      if len(req.tokens) >= self.slots:  # no room for even one new token
        results[i] = GenerationResult((), (), (), "context")
      else:
        todo.append(i)
    for start in range(0, len(todo), self.rows):
      chunk = todo[start:start + self.rows]
      for i, res in zip(chunk, self._generate_chunk([requests[i] for i in chunk])):
        results[i] = res
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
    use = np.zeros((self.rows, ns), bool)
    for r, req in enumerate(requests):
      for j, s in enumerate(strings):
        use[r, j] = s in req.params.stop
    return strings, table, use

  def _generate_chunk(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    r = self.rows
    self.calls += 1
    ctx = [np.asarray(req.tokens, np.int32) for req in requests]
    # Group identical contexts: one lead row prefills, the others copy it.
    leads: dict[tuple[int, ...], int] = {}
    for i, req in enumerate(requests):
      leads.setdefault(req.tokens, i)
    # Destinations: a lead extends its source row in place when nothing of that
    # row is lost; everything else takes the least recently used free row.
    sources = {i: self._lcp(ctx[i]) for i in leads.values()}
    dest = [-1] * len(requests)
    taken: set[int] = set()
    for i in leads.values():
      row, lcp = sources[i]
      cached = self.row_tokens[row]
      if cached is not None and lcp == len(cached) and row not in taken:
        dest[i] = row
        taken.add(row)
    free = [row for row in np.argsort(self.last_used, kind="stable") if row not in taken]
    for i in range(len(requests)):
      if dest[i] < 0:
        dest[i] = int(free.pop(0))
        taken.add(dest[i])

    # Work rows: request i works in row w = i (cache row dest[i]); a power-of-two
    # count, padded with other rows that the call leaves as they are (their cached
    # tokens are kept; only slots past them are scribbled on).
    w = min(r, _bucket(len(requests), 1))
    work = dest + free[:w - len(requests)]
    src_rows = np.array(work, np.int32)
    keep_len = np.array([0 if self.row_tokens[row] is None else len(self.row_tokens[row])
                         for row in work], np.int32)
    new_len = np.zeros(w, np.int32)
    suffixes, prefill = {}, [0] * len(requests)
    for key, i in leads.items():
      row, lcp = sources[i]
      keep = min(lcp, len(key) - 1)  # the last context token always runs
      src_rows[i], keep_len[i] = row, keep
      suffixes[i] = ctx[i][keep:]
      new_len[i] = len(key) - keep
      prefill[i] = len(key) - keep
      self.stats["reused_tokens"] += keep
    t = min(_bucket(int(new_len.max())), self.slots)
    new_tokens = np.zeros((w, t), np.int32)
    for i, suffix in suffixes.items():
      new_tokens[i, :len(suffix)] = suffix
    fork_src = np.arange(w, dtype=np.int32)
    active = np.zeros(w, bool)
    temperature, top_p = np.ones(w, np.float32), np.ones(w, np.float32)
    top_k, max_new = np.zeros(w, np.int32), np.ones(w, np.int32)
    for i, req in enumerate(requests):
      fork_src[i] = leads[req.tokens]
      active[i] = True
      p = req.params
      temperature[i], top_p[i], top_k[i], max_new[i] = (p.temperature, p.top_p, p.top_k,
                                                         p.max_new_tokens)
    strings, table, use = self._stop_table(requests)
    stop_use = np.zeros((w, table.shape[0]), bool)
    stop_use[:len(requests)] = use[:len(requests)]
    seeds = np.zeros((w, 3), np.uint32)
    seeds[:, 1], seeds[:, 2] = self.calls, np.arange(w)
    for i, req in enumerate(requests):
      if req.seed is not None:
        seeds[i] = (1, req.seed >> 32, req.seed & 0xFFFFFFFF)

    host = dict(
        rows=np.array(work, np.int32), src_rows=src_rows, keep_len=keep_len, new_tokens=new_tokens, new_len=new_len,
        fork_src=fork_src, active=active, temperature=temperature, top_p=top_p, top_k=top_k,
        max_new=max_new, stop_seqs=table, stop_use=stop_use, seeds=seeds)
    inp = SamplerInputs(**{k: jax.device_put(v) for k, v in host.items()})
    loop = SamplerLoop(self.graphdef, _bucket(int(max_new.max())), self.eos_ids)
    state = _run(loop, self.params, self.cache, inp, self.rng)
    self.cache = state.cache
    out = jax.device_get((state.tokens, state.logprobs, state.entropies, state.reason))
    tokens, logprobs, entropies, reason = out

    # Host: apply stop strings on text, record results and what each row now holds.
    results = []
    for i, req in enumerate(requests):
      n = int((tokens[i] >= 0).sum())
      gen = tokens[i, :n]
      finish, stop = _REASONS[int(reason[i])], None
      if finish == "stop" or (self.tokenizer is not None and req.params.stop):
        cut, stop = self._stop_cut(gen, req.params.stop)
        if stop is not None:
          n, finish = cut, "stop"
      results.append(GenerationResult(
          tokens=tuple(int(x) for x in gen[:n]), logprobs=tuple(float(x) for x in logprobs[i, :n]),
          entropies=tuple(float(x) for x in entropies[i, :n]), finish_reason=finish, stop=stop,
          prefill_tokens=prefill[i]))
      self.stats["prefill_tokens"] += prefill[i]
      self.stats["generated_tokens"] += n
    for i in range(len(requests)):
      d = dest[i]
      self.row_tokens[d] = np.concatenate([ctx[i], np.asarray(results[i].tokens, np.int32)])
      self.last_used[d] = self.calls
    return results

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
