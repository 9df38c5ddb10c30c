"""The vLLM engine against the policy it serves (tree_rl's own decoder as the oracle).

A tiny random Llama (head_dim 64, which vLLM's CPU attention needs) is saved
as an HF folder and served by one vLLM worker for the whole module (startup
is the slow part). Greedy decoding equals tree_rl's step-by-step argmax;
sampled tokens' log-probs equal `sequence_logprobs`; a weight push makes the
engine follow the new weights; requests sharing a prefix hit the prefix
cache and get the same results as uncached ones; stop strings, EOS, budgets
and the context window end generations as the protocol says.

Needs an interpreter with vLLM (`$TREE_RL_VLLM_PYTHON`, see
third_party/vllm_worker/README.md); without one these tests skip, except the
entropy-estimator ones, which need no vLLM.
"""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from tree_rl.models import Decoder, ModelConfig, gguf_import
from tree_rl.models.hf_io import hf_tensors, save_hf
from tree_rl.rollout.engine import GenerationRequest, SamplingParams
from tests.rollout import reference
from tests.vllm_support import vllm_python_or_skip
from tree_rl.rollout.vllm_engine import VLLMEngine, topk_entropy, vllm_request_seed

# SmolLM2's vocabulary, so that the folder carries its tokenizer (stop strings).
CFG = ModelConfig.tiny(head_dim=64, hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=49152)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
MAX_LEN = 256
BLOCK = 32  # the smallest KV block vLLM's CPU backend takes: caching granularity
TOPK = 20
# vLLM's CPU kernels (oneDNN GEMMs, its own attention) in float32 against
# XLA's, measured over ~600 sampled tokens: the log-probs agree to 1e-6 at the
# init scale, 2e-5 with the weights x3 (below) and 3e-4 with them x5. The gap
# is float32 rounding, growing with the size of the logits, so the models here
# are scaled x3 and the 1e-4 tolerance keeps a 5x margin.
ATOL = 1e-4


def _lively(seed):
  """Random weights scaled x3: at the init scale, greedy decoding repeats one token."""
  graphdef, state = nnx.split(Decoder(CFG, rngs=nnx.Rngs(seed)))
  return nnx.merge(graphdef, jax.tree.map(lambda x: 3.0 * x, state))


def _ctx(seed, n=10):
  return tuple(int(x) for x in np.random.RandomState(seed).randint(3, CFG.vocab_size, n))


# The oracle: tree_rl's decoder, full forward passes padded to one length.
PAD = 192


def _argmax_decode(model, ctx, n):
  return reference.argmax_decode(model, ctx, n, pad=PAD)


def _policy_logprobs(model, ctx, gen):
  return reference.policy_logprobs(model, ctx, gen, pad=PAD)[0]


def _full_logprobs(model, ctx, gen):
  """[len(gen), V] log-distributions at each generated position."""
  return reference.log_distributions(model, ctx, gen, pad=PAD)


# ----------------------------------------------------------------------------
# The entropy estimator (no vLLM needed).
# ----------------------------------------------------------------------------


def test_topk_entropy_is_exact_when_the_topk_hold_all_the_mass():
  logp = np.log(np.array([0.5, 0.25, 0.125, 0.125]))
  # By hand: 0.5 log 2 + 0.25 log 4 + 2 * 0.125 log 8 = 1.75 log 2.
  assert topk_entropy(logp.tolist()) == pytest.approx(1.75 * math.log(2), abs=1e-12)


def test_topk_entropy_bounds_the_true_entropy():
  rng = np.random.default_rng(0)
  for scale in (0.3, 1.0, 3.0, 10.0):
    logits = scale * rng.normal(size=1000)
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    true = float(-(np.exp(logp) * logp).sum())
    top = np.sort(logp)[::-1][:TOPK]
    est = topk_entropy(top.tolist())
    tail = 1.0 - np.exp(top).sum()
    assert est <= true + 1e-9
    assert true - est <= tail * math.log(1000 - TOPK) + 1e-9
    # Grouping rule: the renormalised top-k's entropy, weighted by their mass,
    # plus the binary entropy of "top-k or tail".
    q = np.exp(top) / np.exp(top).sum()
    h_q = float(-(q * np.log(q)).sum())
    h_b = -(1 - tail) * math.log(1 - tail) - tail * math.log(tail)
    assert est == pytest.approx((1 - tail) * h_q + h_b, abs=1e-9)


def test_a_seeded_request_gets_its_vllm_seed_from_the_key_and_its_seed_only():
  base = [11, 22]
  got = vllm_request_seed(base, 0, 5, call=0, index=0)
  assert 0 <= got < 2**31
  # Where the request sits (call count, index in the call) does not matter ...
  assert {vllm_request_seed(base, 0, 5, c, i) for c in range(3) for i in range(4)} == {got}
  # ... the reseed key and the request's own seed do.
  assert vllm_request_seed([11, 23], 0, 5, 0, 0) != got
  assert vllm_request_seed(base, 0, 6, 0, 0) != got
  # Before any reseed, the constructor's seed stands in for the key.
  assert vllm_request_seed(None, 3, 5, 0, 0) == vllm_request_seed([3], 9, 5, 0, 0)
  # Without a seed: (key, call, index) after a reseed, vLLM's own stream before one.
  unseeded = {vllm_request_seed(base, 0, None, c, i) for c in range(3) for i in range(4)}
  assert len(unseeded) == 12
  assert vllm_request_seed(None, 0, None, 0, 0) is None


# ----------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
  return _lively(0)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
  python = vllm_python_or_skip()
  folder = save_hf(model, tmp_path_factory.mktemp("vllm") / "tiny",
                   tokenizer_from=str(gguf_import.default_model_dir()))
  eng = VLLMEngine(folder, python=python, max_model_len=MAX_LEN, eos_ids=(), seed=0,
                   block_size=BLOCK, logprobs_k=TOPK, kv_cache_gb=0.25)
  yield eng
  eng.close()


@pytest.mark.vllm
def test_greedy_equals_tree_rl_argmax(engine, model):
  ctxs = [_ctx(1), _ctx(2, 7), _ctx(3, 40)]
  res = engine.generate([GenerationRequest(c, GREEDY) for c in ctxs])
  for c, r in zip(ctxs, res):
    assert r.tokens == _argmax_decode(model, c, GREEDY.max_new_tokens)
    assert r.finish_reason == "length"
    np.testing.assert_allclose(r.logprobs, _policy_logprobs(model, c, r.tokens), atol=ATOL)


@pytest.mark.vllm
def test_sampled_logprobs_and_entropies_equal_the_policy(engine, model):
  ctx = _ctx(4)
  reqs = [GenerationRequest(ctx, SamplingParams(max_new_tokens=16))] * 3
  reqs.append(GenerationRequest(_ctx(5, 4), SamplingParams(temperature=0.7, top_k=20,
                                                           max_new_tokens=16)))
  res = engine.generate(reqs)
  assert len({r.tokens for r in res[:3]}) > 1  # independent samples of one context
  for req, r in zip(reqs, res):
    assert len(r.tokens) == 16
    # The untempered policy's log-probs, whatever the sampling knobs.
    np.testing.assert_allclose(r.logprobs, _policy_logprobs(model, req.tokens, r.tokens),
                               atol=ATOL)
    # The entropy is the estimator over the policy's top-k (plus the sampled
    # token when it falls outside them).
    full = _full_logprobs(model, req.tokens, r.tokens)
    for t, (row, tok) in enumerate(zip(full, r.tokens)):
      keep = set(np.argsort(-row)[:TOPK].tolist()) | {tok}
      expect = topk_entropy([float(row[i]) for i in keep])
      assert r.entropies[t] == pytest.approx(expect, abs=ATOL)
      assert r.entropies[t] <= float(-(np.exp(row) * row).sum()) + ATOL


@pytest.mark.vllm
def test_weight_push_switches_to_the_new_policy(engine, model):
  ctx = _ctx(6, 12)
  other = _lively(1)
  engine.update_weights(nnx.split(other)[1])  # a bare nnx.State
  try:
    res = engine.generate([GenerationRequest(ctx, SamplingParams(max_new_tokens=16)),
                           GenerationRequest(ctx, GREEDY)])
    # Cache reset: the context is prefilled again, with the new weights.
    assert res[0].prefill_tokens + res[1].prefill_tokens >= len(ctx)
    for r in res:
      lp_new = _policy_logprobs(other, ctx, r.tokens)
      lp_old = _policy_logprobs(model, ctx, r.tokens)
      np.testing.assert_allclose(r.logprobs, lp_new, atol=ATOL)
      assert np.abs(np.asarray(r.logprobs) - lp_old).max() > 1e-2
    assert res[1].tokens == _argmax_decode(other, ctx, GREEDY.max_new_tokens)
  finally:
    engine.update_weights(hf_tensors(model))  # HF-named arrays: back to the module's model
  (back,) = engine.generate([GenerationRequest(ctx, GREEDY)])
  assert back.tokens == _argmax_decode(model, ctx, GREEDY.max_new_tokens)


@pytest.mark.vllm
def test_shared_prefixes_hit_the_cache_and_change_nothing(engine, model):
  prefix = _ctx(7, 3 * BLOCK + 5)
  ctxs = [prefix + _ctx(8 + i, 6) for i in range(3)]
  first = engine.generate([GenerationRequest(c, GREEDY) for c in ctxs])
  for c, r in zip(ctxs, first):
    assert r.tokens == _argmax_decode(model, c, GREEDY.max_new_tokens)
  # The shared full blocks are prefilled once, whichever request gets there first.
  assert sum(r.prefill_tokens for r in first) <= sum(map(len, ctxs)) - 2 * 3 * BLOCK
  # A second pass: every full block of every context is cached.
  again = engine.generate([GenerationRequest(c, GREEDY) for c in ctxs])
  for c, r0, r1 in zip(ctxs, first, again):
    assert r1.prefill_tokens <= len(c) - (len(c) - 1) // BLOCK * BLOCK
    assert r1.tokens == r0.tokens
    np.testing.assert_allclose(r1.logprobs, r0.logprobs, atol=1e-5)
  # The next turn: a context grown by the sampled tokens and a tool reply.
  turn = ctxs[0] + first[0].tokens + _ctx(20, 5)
  (nxt,) = engine.generate([GenerationRequest(turn, GREEDY)])
  assert nxt.prefill_tokens <= len(turn) - 3 * BLOCK  # the full blocks of the last turn
  assert nxt.tokens == _argmax_decode(model, turn, GREEDY.max_new_tokens)


@pytest.mark.vllm
def test_budget_and_context_window(engine):
  near = _ctx(9, MAX_LEN - 5)
  r_len, r_full, r_over = engine.generate([
      GenerationRequest(_ctx(10), SamplingParams(max_new_tokens=3)),
      GenerationRequest(near, SamplingParams(max_new_tokens=50)),
      GenerationRequest(_ctx(11, MAX_LEN), GREEDY),
  ])
  assert r_len.finish_reason == "length" and len(r_len.tokens) == 3
  assert r_full.finish_reason == "context" and len(near) + len(r_full.tokens) == MAX_LEN
  assert r_over.finish_reason == "context" and r_over.tokens == ()


@pytest.mark.vllm
def test_stop_strings_and_eos(engine, model):
  from transformers import AutoTokenizer  # noqa: PLC0415

  tok = AutoTokenizer.from_pretrained(engine.model_dir)
  ctx = _ctx(12)
  greedy = _argmax_decode(model, ctx, GREEDY.max_new_tokens)
  stop = tok.decode(greedy[2:4])
  (r_stop,) = engine.generate([GenerationRequest(ctx, SamplingParams(
      temperature=0.0, max_new_tokens=GREEDY.max_new_tokens, stop=(stop,)))])
  # Generation ends at the first token completing the stop string, and keeps it.
  first = next(j for j in range(1, len(greedy) + 1) if stop in tok.decode(greedy[:j]))
  assert r_stop.finish_reason == "stop" and r_stop.stop == stop
  assert r_stop.tokens == greedy[:first]
  eos = greedy[5]
  engine.eos_ids = (eos,)
  try:
    (r_eos,) = engine.generate([GenerationRequest(ctx, GREEDY)])
  finally:
    engine.eos_ids = ()
  assert r_eos.finish_reason == "eos" and r_eos.tokens == greedy[:greedy.index(eos) + 1]
