"""The embedded JAX sampler against the policy it samples from.

Greedy decoding equals step-by-step argmax; recorded log-probs and entropies
equal the policy's recomputed ones; forks prefill a shared context once; a
branch continues exactly its parent's context; stop strings, EOS, budgets and
context overflow end generations in recorded ways; weight pushes take effect.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import Decoder, ModelConfig
from tree_rl.rollout import jax_sampler
from tree_rl.rollout.engine import GenerationRequest, SamplingParams
from tree_rl.rollout.jax_sampler import JaxSampler
from tests.rollout import reference

CFG = ModelConfig.tiny()
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


class CharTokenizer:
  """Token t spells the letter chr(97 + t % 26): ids t and t + 26 read the same."""

  def encode(self, text, add_special_tokens=False):
    return [ord(ch) - 97 for ch in text]

  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(97 + int(t) % 26) for t in ids)


def _lively(seed):
  """A tiny random model with weights scaled x5: at the default init scale,
  greedy decoding collapses to one repeated token, which would hide ordering
  bugs in the tests below."""
  graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(seed)))
  return nnx.merge(graphdef, jax.tree.map(lambda x: 5.0 * x, state))


@pytest.fixture(scope="module")
def model():
  return _lively(0)


def _ctx(seed, n=10):
  return tuple(int(x) for x in np.random.RandomState(seed).randint(3, CFG.vocab_size, n))


def _argmax_decode(model, ctx, n):
  return reference.argmax_decode(model, ctx, n)


def _policy_logprobs(model, ctx, gen):
  return reference.policy_logprobs(model, ctx, gen)


def test_greedy_equals_stepwise_argmax(model):
  eng = JaxSampler(model, rows=4, slots=64)
  ctxs = [_ctx(1), _ctx(2, 7)]
  res = eng.generate([GenerationRequest(c, GREEDY) for c in ctxs])
  for c, r in zip(ctxs, res):
    assert r.tokens == _argmax_decode(model, c, 8)
    assert r.finish_reason == "length"


def test_logprobs_and_entropies_equal_the_policy(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=3)
  ctx = _ctx(4)
  reqs = [GenerationRequest(ctx, SamplingParams(max_new_tokens=12))] * 3
  reqs.append(GenerationRequest(_ctx(5, 4), SamplingParams(temperature=0.7, top_k=20,
                                                           max_new_tokens=12)))
  for req, r in zip(reqs, eng.generate(reqs)):
    lp, ent = _policy_logprobs(model, req.tokens, r.tokens)
    np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)
    np.testing.assert_allclose(r.entropies, ent, atol=1e-4)


def test_forks_prefill_the_shared_context_once(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=0)
  ctx = _ctx(6, 20)
  res = eng.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=10))] * 4)
  assert [r.prefill_tokens for r in res] == [20, 0, 0, 0]
  assert eng.stats["prefill_tokens"] == 20
  assert len({r.tokens for r in res}) > 1  # independent samples after the fork
  # Next turn: each branch's context grows by its own tokens plus a tool reply;
  # only the tool reply is new (the branch's own tokens are cached).
  tool = (7, 8, 9)
  nxt = eng.generate([GenerationRequest(ctx + r.tokens + tool, GREEDY) for r in res])
  assert [r.prefill_tokens for r in nxt] == [3, 3, 3, 3]
  # Branching mid-sequence reruns only the branch point's token.
  mid = ctx + res[2].tokens[:4]
  (b,) = eng.generate([GenerationRequest(mid, GREEDY)])
  assert b.prefill_tokens == 1
  assert eng.stats["prefill_tokens"] == 20 + 12 + 1


def test_a_small_call_works_on_its_own_rows_and_leaves_the_others(model):
  eng = JaxSampler(model, rows=8, slots=64)
  ctxs = [_ctx(20 + i, 6 + i) for i in range(8)]
  first = eng.generate([GenerationRequest(c, GREEDY) for c in ctxs])
  # One request: a one-row program, written to the least recently used row only.
  (alone,) = eng.generate([GenerationRequest(_ctx(40, 9), GREEDY)])
  assert alone.tokens == _argmax_decode(model, _ctx(40, 9), 8)
  nxt = eng.generate([GenerationRequest(c + r.tokens, GREEDY) for c, r in zip(ctxs, first)])
  # Seven rows kept their contexts (only the last context token reruns); one row was
  # taken by the lone request, so its context is prefilled again.
  assert sorted(r.prefill_tokens for r in nxt) == [1] * 7 + [len(ctxs[0] + first[0].tokens)]
  for c, r0, r in zip(ctxs, first, nxt):
    assert r.tokens == _argmax_decode(model, c + r0.tokens, 8)


def test_branch_continues_exactly_the_parents_context(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=1)
  ctx = _ctx(7)
  (parent,) = eng.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=10))])
  prefix = ctx + parent.tokens[:5]
  (cached,) = eng.generate([GenerationRequest(prefix, GREEDY)])
  (fresh,) = JaxSampler(model, rows=4, slots=64).generate([GenerationRequest(prefix, GREEDY)])
  assert cached.prefill_tokens == 1 and fresh.prefill_tokens == len(prefix)
  assert cached.tokens == fresh.tokens == _argmax_decode(model, prefix, 8)
  np.testing.assert_allclose(cached.logprobs, fresh.logprobs, atol=1e-5)


def test_stop_strings_eos_budget_and_context(model):
  tok = CharTokenizer()
  ctx = _ctx(8)
  greedy = _argmax_decode(model, ctx, 8)
  stop = tok.decode(greedy[2:4])  # the text of greedy tokens 2-3
  eng = JaxSampler(model, rows=4, slots=64, tokenizer=tok, eos_ids=(greedy[5],))
  r_stop, r_eos, r_len = eng.generate([
      GenerationRequest(ctx, SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop,))),
      GenerationRequest(ctx, SamplingParams(temperature=0.0, max_new_tokens=8)),
      GenerationRequest(ctx, SamplingParams(temperature=0.0, max_new_tokens=3)),
  ])
  assert r_stop.finish_reason == "stop" and r_stop.stop == stop
  assert tok.decode(r_stop.tokens).endswith(stop) and len(r_stop.tokens) <= 4
  assert r_eos.finish_reason == "eos" and r_eos.tokens == greedy[:6]
  assert r_len.finish_reason == "length" and r_len.tokens == greedy[:3]
  # The window fills up: generation ends with "context", and a prompt that does
  # not fit at all gets no tokens; neither raises.
  small = JaxSampler(model, rows=2, slots=16)
  r_full, r_over = small.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=50)),
                                   GenerationRequest(_ctx(9, 20), GREEDY)])
  assert r_full.finish_reason == "context" and len(ctx) + len(r_full.tokens) == 16
  assert r_over.finish_reason == "context" and r_over.tokens == ()


def test_stop_string_spelled_with_other_tokens_is_cut_on_the_host(model):
  tok = CharTokenizer()
  ctx = _ctx(10)
  greedy = _argmax_decode(model, ctx, 8)
  # The stop table holds ids < 26; the model's own ids for the same letters
  # are generally >= 26, so only the text check can catch them.
  stop = tok.decode(greedy[1:3])
  eng = JaxSampler(model, rows=4, slots=64, tokenizer=tok)
  (r,) = eng.generate([GenerationRequest(ctx, SamplingParams(temperature=0.0, max_new_tokens=8,
                                                             stop=(stop,)))])
  first = next(j for j in range(1, 9) if stop in tok.decode(greedy[:j]))
  assert r.tokens == greedy[:first] and r.finish_reason == "stop"


def test_weight_push_changes_the_policy_and_resets_the_cache(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=2)
  ctx = _ctx(11)
  eng.generate([GenerationRequest(ctx, GREEDY)])
  other = _lively(1)
  eng.update_weights(other)
  (r,) = eng.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=8))])
  assert r.prefill_tokens == len(ctx)  # no stale KV reused
  lp_new, _ = _policy_logprobs(other, ctx, r.tokens)
  lp_old, _ = _policy_logprobs(model, ctx, r.tokens)
  np.testing.assert_allclose(r.logprobs, lp_new, atol=1e-4)
  assert np.abs(np.asarray(r.logprobs) - lp_old).max() > 1e-2


def test_top_k_one_and_tiny_top_p_are_greedy(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=5)
  ctx = _ctx(12)
  greedy = _argmax_decode(model, ctx, 6)
  res = eng.generate([GenerationRequest(ctx, SamplingParams(top_k=1, max_new_tokens=6)),
                      GenerationRequest(ctx, SamplingParams(top_p=1e-6, max_new_tokens=6))])
  assert [r.tokens for r in res] == [greedy, greedy]


def test_cdf_inversion_follows_the_weights():
  """Two-level CDF inversion: the float64 searchsorted answer, and never a zero-weight token."""
  rng = np.random.default_rng(0)
  v = 1000  # not a multiple of the 256-token block: the last block is padded
  w = rng.exponential(size=(3, v)).astype(np.float32)
  w[:, rng.choice(v, 300, replace=False)] = 0.0  # truncated tokens
  w[1, :] = 0.0
  w[1, [5, 700]] = (1.0, 3.0)  # two tokens in different blocks
  w[2, 257:] = 0.0  # the last positive token is the first of block 1
  u = np.concatenate([rng.uniform(1e-7, 1.0, 4000), [1e-9, 1.0]]).astype(np.float32)
  tok = np.asarray(jax.jit(jax.vmap(jax_sampler._invert_cdf, in_axes=(None, 0)))(
      jnp.asarray(w), jnp.asarray(u)[:, None].repeat(3, axis=1)))  # [U, 3]
  for r in range(3):
    assert (w[r, tok[:, r]] > 0).all()
    cdf = np.cumsum(w[r].astype(np.float64))
    want = np.minimum(np.searchsorted(cdf, u.astype(np.float64) * cdf[-1], side="left"), v - 1)
    assert np.mean(tok[:, r] == want) > 0.999  # float32 rounding may move a boundary draw
  assert set(tok[:, 1]) == {5, 700}
  assert np.isclose(np.mean(tok[:, 1] == 700), 0.75, atol=0.03)


def test_sampled_tokens_follow_the_tempered_distribution():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 40)) * 2, jnp.float32)
  n = 20000
  keys = jax.random.split(jax.random.key(3), n)
  temp = jnp.full((n,), 0.7)
  tok, lp, _ = jax.jit(jax_sampler.sample_tokens)(
      jnp.repeat(logits, n, axis=0), keys, temp, jnp.ones(n), jnp.zeros(n, jnp.int32))
  p = np.asarray(jax.nn.softmax(logits[0] / 0.7))
  freq = np.bincount(np.asarray(tok), minlength=40) / n
  assert np.abs(freq - p).max() < 5 * np.sqrt(p.max() / n)
  np.testing.assert_allclose(lp, jax.nn.log_softmax(logits[0])[tok], rtol=1e-6)


def test_one_compile_per_bucket(model):
  eng = JaxSampler(model, rows=4, slots=64, seed=6)
  sizes = lambda: (jax_sampler._prefill_program._cache_size()
                   + jax_sampler._decode_program._cache_size())
  before = sizes()
  for seed in range(3):  # contexts of different lengths in one prefill bucket
    eng.generate([GenerationRequest(_ctx(20 + seed, 5 + seed), SamplingParams(max_new_tokens=8))])
  assert sizes() - before <= 2  # one prefill and one decode program


def test_admission_compiles_once_across_slot_widths(model):
  """Calls of 1, 2 and 3 requests run 1, 2 and 4 work slots; their admissions (one
  context, so one lead and one prefill piece each) share one prefill program: only the
  small copy and seat programs and the decode loop are per width."""
  eng = JaxSampler(model, rows=4, slots=64, seed=7)
  before = jax_sampler._prefill_program._cache_size()
  for n in (1, 2, 3):
    eng.generate([GenerationRequest(_ctx(9, 6), SamplingParams(max_new_tokens=4))] * n)
  assert jax_sampler._prefill_program._cache_size() - before <= 1


def test_bad_requests_fail_clearly(model):
  eng = JaxSampler(model, rows=4, slots=64)
  with pytest.raises(ValueError, match="empty context"):
    eng.generate([GenerationRequest(())])
  with pytest.raises(ValueError, match="need a tokenizer"):
    eng.generate([GenerationRequest((5, 6), SamplingParams(stop=("x",)))])
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)


def _tiled(k, v, block):
  """Slot-major [R, S, Hk, Dh] keys and values in `KVCache`'s tiled layout."""
  r, s_len, hk, dh = k.shape
  k = k.reshape(r, s_len // block, block, hk, dh)
  return k.transpose(0, 3, 1, 4, 2), v.reshape(k.shape).transpose(0, 3, 1, 2, 4)


def test_cache_attention_equals_a_float64_softmax_at_any_block_size():
  from tree_rl.models.attention import cached_attention

  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (3, 5, 4, 16))
  k = jax.random.normal(keys[1], (3, 1024, 2, 16))
  v = jax.random.normal(keys[2], (3, 1024, 2, 16))
  # Rows at different depths: the loop stops at the deepest query's block.
  slot = jnp.asarray([[10, 11, 12, 13, 14], [300, 301, 302, 303, 304], [700, 701, 702, 703, 1023]])
  rows = np.asarray([2, 0, 1])  # work rows read cache rows in another order
  qn, kn, vn, sn = (np.asarray(a, np.float64) for a in (q, k, v, slot))
  want = np.zeros(q.shape)
  for w in range(3):
    for t in range(5):
      for h in range(4):
        kv = h // 2  # 4 query heads over 2 kv heads
        n = int(sn[w, t]) + 1
        sc = kn[rows[w], :n, kv] @ qn[w, t, h] / 4.0  # 1/sqrt(16)
        p = np.exp(sc - sc.max())
        want[w, t, h] = (p / p.sum()) @ vn[rows[w], :n, kv]
  for block in (64, 256, 1024):  # 1024: one block holds every slot
    kc, vc = _tiled(k, v, block)
    got = cached_attention(q, kc, vc, slot, rows=jnp.asarray(rows))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=f"block {block}")
  kc, vc = _tiled(k[rows], v[rows], 256)
  np.testing.assert_allclose(np.asarray(cached_attention(q, kc, vc, slot)), want, atol=1e-5)


def test_copy_slots_moves_only_the_kept_prefix_and_reads_before_it_writes():
  from tree_rl.models.decoder import KVCache
  from tree_rl.rollout.jax_sampler import _copy_slots

  r, s_len, hk, dh = 4, 256, 2, 8
  k = jax.random.normal(jax.random.key(1), (r, s_len, hk, dh))
  v = jax.random.normal(jax.random.key(2), (r, s_len, hk, dh))
  kc, vc = _tiled(k, v, 64)
  cache = KVCache((kc,), (vc,))
  # Row 1 is entry 0's destination and entry 1's source; entry 2 is padding (dst R).
  src, dst, n = jnp.asarray([0, 1, 2]), jnp.asarray([1, 3, r]), jnp.asarray([70, 130, 200])
  out = _copy_slots(cache, src, dst, n)
  kn, vn = np.asarray(k), np.asarray(v)
  want_k, want_v = kn.copy(), vn.copy()
  want_k[1, :70], want_v[1, :70] = kn[0, :70], vn[0, :70]
  want_k[3, :130], want_v[3, :130] = kn[1, :130], vn[1, :130]  # row 1 as it was
  tk, tv = _tiled(jnp.asarray(want_k), jnp.asarray(want_v), 64)
  np.testing.assert_array_equal(np.asarray(out.k[0]), np.asarray(tk))
  np.testing.assert_array_equal(np.asarray(out.v[0]), np.asarray(tv))


def test_lora_is_merged_once_and_samples_the_unmerged_policy():
  from tree_rl.models import LoRAConfig
  from tree_rl.models.decoder import LoRAParam

  lora = Decoder(CFG, rngs=nnx.Rngs(3), lora=LoRAConfig(rank=4, alpha=8.0))
  nnx.update(lora, nnx.state(_lively(0), nnx.Param))  # lively base weights
  # Nonzero B: a fresh adapter is the identity, which would make the test vacuous.
  graphdef, adapters, rest = nnx.split(lora, LoRAParam, ...)
  adapters = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape),
                          adapters)
  lora = nnx.merge(graphdef, adapters, rest)
  eng = JaxSampler(lora, rows=4, slots=64, seed=4)
  # The sampler runs LoRA-free weights: the adapters are folded into the kernels.
  assert not any("lora" in name for layer in eng.weights.layers for name in layer)
  ctx = _ctx(13)
  (r,) = eng.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=10))])
  lp, ent = _policy_logprobs(lora, ctx, r.tokens)  # the unmerged model's forward
  np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)
  np.testing.assert_allclose(r.entropies, ent, atol=1e-4)
  base_lp, _ = _policy_logprobs(_lively(0), ctx, r.tokens)
  assert np.abs(np.asarray(r.logprobs) - base_lp).max() > 1e-2  # the adapters matter
  # A weight push of the LoRA state (as the trainer sends) is merged the same way.
  eng.update_weights(nnx.state(lora))
  (again,) = eng.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=10))])
  np.testing.assert_allclose(_policy_logprobs(lora, ctx, again.tokens)[0], again.logprobs,
                             atol=1e-4)


def test_more_requests_than_rows_stream_through_freed_rows(model):
  # Two rows, five requests with different budgets: a row that finishes takes the
  # next waiting request (continuous batching) and every result is still exact.
  eng = JaxSampler(model, rows=2, slots=64)
  ctxs = [_ctx(30 + i, 5 + i) for i in range(5)]
  budgets = [3, 8, 2, 6, 4]
  res = eng.generate([GenerationRequest(c, SamplingParams(temperature=0.0, max_new_tokens=n))
                      for c, n in zip(ctxs, budgets)])
  for c, n, r in zip(ctxs, budgets, res):
    assert r.tokens == _argmax_decode(model, c, n) and r.finish_reason == "length"
  assert eng.stats["generated_tokens"] == sum(budgets)


def test_decoding_narrows_to_the_live_requests_and_samples_the_same(model, monkeypatch):
  # Four slots; three requests end after 2 tokens, one runs 12. Decoding stops when
  # one slot is left live, goes on in a 1-slot state, and every request samples what
  # it samples alone (seeded requests: the same stream whatever the batch or slot).
  widths = []
  compact = jax_sampler._compact
  monkeypatch.setattr(jax_sampler, "_compact",
                      lambda st, keep: widths.append(len(keep)) or compact(st, keep))
  ctxs = [_ctx(40 + i, 6 + i) for i in range(4)]
  budgets = [2, 12, 2, 2]
  reqs = [GenerationRequest(c, SamplingParams(temperature=1.0, max_new_tokens=n), seed=i)
          for i, (c, n) in enumerate(zip(ctxs, budgets))]
  together = JaxSampler(model, rows=4, slots=64, seed=3).generate(reqs)
  assert widths == [1]
  for req, got in zip(reqs, together):
    alone = JaxSampler(model, rows=4, slots=64, seed=3).generate([req])[0]
    assert got.tokens == alone.tokens and len(got.tokens) == req.params.max_new_tokens
    np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5)
  greedy = [GenerationRequest(c, SamplingParams(temperature=0.0, max_new_tokens=n))
            for c, n in zip(ctxs, budgets)]
  for c, n, r in zip(ctxs, budgets, JaxSampler(model, rows=4, slots=64).generate(greedy)):
    assert r.tokens == _argmax_decode(model, c, n)


def test_non_finite_logits_are_counted_and_their_tree_is_refused():
  """A NaN weight makes every logit NaN: the sampler counts the tokens drawn from them,
  and a tree holding their log-probs fails its checks, so it never reaches a loss."""
  from tree_rl.tree import NodeKind, RolloutTree, TreeError  # noqa: PLC0415

  graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)))
  broken = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state))
  eng = JaxSampler(broken, rows=2, slots=64)
  ctx = _ctx(3)
  (res,) = eng.generate([GenerationRequest(ctx, SamplingParams(temperature=1.0,
                                                               max_new_tokens=4))])
  assert eng.stats["nonfinite_tokens"] == len(res.tokens) > 0
  tree = RolloutTree.new(list(ctx))
  node = tree.add_node(0, NodeKind.POLICY, list(res.tokens), logprobs=list(res.logprobs))
  tree.add_leaf(node, {"outcome": 1.0})
  with pytest.raises(TreeError, match="must be finite"):
    tree.check(vocab_size=CFG.vocab_size)
