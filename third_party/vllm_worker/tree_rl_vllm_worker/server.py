"""The vLLM worker process: one `vllm.LLM`, served over a local socket.

    TREE_RL_VLLM_AUTHKEY=<hex> python -m tree_rl_vllm_worker.server <socket path>

The trainer (`tree_rl.rollout.vllm_engine.VLLMEngine`) listens on a Unix
socket, starts this process with vLLM's interpreter and waits for it to connect
back. Everything crossing the socket is plain Python (dicts, lists, ints,
floats, strings), so the two interpreters share no classes. The exchange:

  1. trainer -> worker: the engine config (a dict, see `_build`);
     worker -> trainer: {"ok": True, "info": {...}} once the model is loaded (with
     "weight_transfer": the backend of vLLM's weight-transfer API that weight pushes use,
     or "in_place" where this vLLM has no such API or the config asks for the reload).
  2. any number of requests {"op": "generate" | "update_weights"},
     each answered by {"ok": True, "result": ...} or {"ok": False, "error":
     <traceback text>}; a failed request leaves the worker serving.
  3. {"op": "close"} (or the trainer's end of the socket closing) ends it.

Generation is token ids in, token ids out: prompts are `TokensPrompt`s and
nothing is re-tokenized; text is only decoded when a request has stop strings.
The log-probs are vLLM's `raw_logprobs` (the model's own distribution, before
temperature and top-k/top-p), the sampled token's and the top-k of each step.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

EXTENSION = "tree_rl_vllm_worker.extension.WeightSyncExtension"
IN_PLACE = "in_place"
# The LLM methods that drive vLLM's weight-transfer API.
_TRANSFER_RPCS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update")


def _transfer_backend(config: dict[str, Any]) -> str:
  """The weight-transfer path: our backend on vLLM's weight-transfer API when this vLLM has
  the API (found by import and attribute, never by version) and the config allows it
  ("auto"); else IN_PLACE (the extension's `tree_rl_load_weights`)."""
  mode = config.get("weight_transfer", "auto")
  if mode not in ("auto", IN_PLACE):
    raise ValueError(f"weight_transfer={mode!r} must be 'auto' or {IN_PLACE!r}")
  if mode == IN_PLACE:
    return IN_PLACE
  from vllm import LLM  # noqa: PLC0415

  from tree_rl_vllm_worker.extension import register_file_backend  # noqa: PLC0415

  backend = register_file_backend()
  if backend is None or not all(callable(getattr(LLM, m, None)) for m in _TRANSFER_RPCS):
    return IN_PLACE
  return backend


def _configure_process(config: dict[str, Any]) -> None:
  """Environment that vLLM reads when the engine starts (so: before building it)."""
  # Weights and tokenizer come from a local folder; never reach a hub.
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  os.environ.setdefault("VLLM_LOGGING_LEVEL", config.get("log_level", "WARNING"))
  import torch  # noqa: PLC0415  (only to ask for a GPU before vLLM reads its env)

  in_process = config.get("in_process_engine")
  if in_process is None:
    # This process is already separate from the trainer, so on CPU the engine
    # core and the model run inside it: two fewer interpreters to start (tens
    # of seconds each) and the cores go to the model. On GPU vLLM's own
    # processes overlap scheduling with the forward pass, so keep them.
    in_process = not torch.cuda.is_available()
  config["in_process_engine"] = bool(in_process)
  if config.get("enforce_eager") is None:
    # torch.compile would add minutes to the start-up on CPU.
    config["enforce_eager"] = not torch.cuda.is_available()
  if in_process:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not torch.cuda.is_available():
      # vLLM caps a serving process at one torch thread unless OMP_NUM_THREADS
      # is set; in-process, those threads run the model. The default keeps
      # vLLM's own policy (its auto binding leaves one core to the host side:
      # here the trainer), because OpenMP threads that spin-wait on a busy
      # core slow every GEMM down (2-4x on a loaded 2-core machine).
      threads = config.get("cpu_threads") or max(1, (os.cpu_count() or 2) - 1)
      if config.get("cpu_threads") or "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _build(config: dict[str, Any]):
  from vllm import LLM  # noqa: PLC0415

  kwargs = dict(
      model=config["model_dir"],
      dtype=config.get("dtype", "float32"),
      max_model_len=config["max_model_len"],
      seed=config.get("seed", 0),
      enable_prefix_caching=True,
      worker_extension_cls=EXTENSION,
      # Top-k log-probs of the model's own distribution, before temperature.
      logprobs_mode="raw_logprobs",
      max_logprobs=max(1, config.get("logprobs_k", 20)),
      gpu_memory_utilization=config.get("gpu_memory_utilization", 0.5),
      enforce_eager=config["enforce_eager"],
      skip_tokenizer_init=not config.get("has_tokenizer", True),
  )
  if config.get("kv_cache_bytes"):
    kwargs["kv_cache_memory_bytes"] = int(config["kv_cache_bytes"])
  if config.get("block_size"):
    kwargs["block_size"] = int(config["block_size"])
  if config.get("max_num_seqs"):
    kwargs["max_num_seqs"] = int(config["max_num_seqs"])
  if config["in_process_engine"]:
    kwargs["distributed_executor_backend"] = "uni"
  transfer = _transfer_backend(config)
  if transfer != IN_PLACE:
    from vllm.config import WeightTransferConfig  # noqa: PLC0415

    kwargs["weight_transfer_config"] = WeightTransferConfig(backend=transfer)
  kwargs.update(config.get("llm_kwargs") or {})
  llm = LLM(**kwargs)
  if transfer != IN_PLACE:
    llm.init_weight_transfer_engine({"init_info": {}})
  return llm, transfer


def _sampling_params(req: dict[str, Any], logprobs_k: int):
  from vllm import SamplingParams  # noqa: PLC0415

  stop = list(req.get("stop") or ())
  eos_ids = req.get("eos_ids")
  return SamplingParams(
      n=1,
      temperature=float(req["temperature"]),
      top_p=float(req["top_p"]),
      top_k=int(req["top_k"]),
      max_tokens=int(req["max_tokens"]),
      logprobs=logprobs_k,
      flat_logprobs=True,  # a few flat lists instead of one dict per step
      # Stop strings need text; otherwise skip detokenization altogether.
      detokenize=bool(stop),
      stop=stop or None,
      # tree_rl keeps the token that completes a stop string.
      include_stop_str_in_output=True,
      skip_special_tokens=False,
      # Explicit EOS ids replace the model's (generation_config + tokenizer).
      ignore_eos=eos_ids is not None,
      stop_token_ids=list(eos_ids) if eos_ids is not None else None,
      seed=req.get("seed"),  # None: the engine-wide stream
  )


def _generate(llm, msg: dict[str, Any], logprobs_k: int) -> list[dict[str, Any]]:
  from vllm.inputs import TokensPrompt  # noqa: PLC0415

  reqs = msg["requests"]
  prompts = [TokensPrompt(prompt_token_ids=list(r["tokens"])) for r in reqs]
  params = [_sampling_params(r, logprobs_k) for r in reqs]
  outs = llm.generate(prompts, params, use_tqdm=False)
  results = []
  for out in outs:
    comp = out.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    flat = comp.logprobs
    sampled, topk = [], []
    for i, tok in enumerate(ids):
      lo, hi = flat.start_indices[i], flat.end_indices[i]
      toks, lps = flat.token_ids[lo:hi], flat.logprobs[lo:hi]
      # The sampled token comes first, then the top-k (which may repeat it).
      sampled.append(float(lps[toks.index(tok)]))
      seen: dict[int, float] = {}
      for t, lp in zip(toks, lps):
        seen.setdefault(int(t), float(lp))
      topk.append(list(seen.values()))
    results.append(dict(
        tokens=ids, logprobs=sampled, topk_logprobs=topk,
        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
        num_cached_tokens=int(out.num_cached_tokens or 0)))
  return results


def _update_weights(llm, transfer: str, msg: dict[str, Any]) -> dict[str, Any]:
  if transfer == IN_PLACE:
    counts = llm.collective_rpc("tree_rl_load_weights", args=(msg["path"], msg.get("names")))
  else:  # vLLM's weight-transfer API, one update of our file backend
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": msg["path"], "names": msg.get("names")}})
    llm.finish_weight_update()
    counts = llm.collective_rpc("tree_rl_transfer_count")
  # The cached KV blocks were computed with the old weights.
  if not llm.reset_prefix_cache():
    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
  return {"tensors_loaded": [int(c) for c in counts], "weight_transfer": transfer}


def serve(address: str, authkey: bytes) -> int:
  conn = Client(address, family="AF_UNIX", authkey=authkey)
  config = conn.recv()
  try:
    _configure_process(config)
    llm, transfer = _build(config)
    import vllm  # noqa: PLC0415

    cache = llm.llm_engine.vllm_config.cache_config
    conn.send({"ok": True, "info": {
        "vllm_version": vllm.__version__, "block_size": int(cache.block_size),
        "weight_transfer": transfer,
        "in_process_engine": config["in_process_engine"], "pid": os.getpid()}})
  except BaseException:  # noqa: BLE001  (reported to the trainer, then exit)
    conn.send({"ok": False, "error": traceback.format_exc()})
    return 1
  logprobs_k = max(1, config.get("logprobs_k", 20))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, ConnectionError):
      return 0  # the trainer is gone
    op = msg.get("op")
    if op == "close":
      conn.send({"ok": True, "result": None})
      return 0
    try:
      if op == "generate":
        result = _generate(llm, msg, logprobs_k)
      elif op == "update_weights":
        result = _update_weights(llm, transfer, msg)
      else:
        raise ValueError(f"unknown op {op!r}")
      conn.send({"ok": True, "result": result})
    except Exception:  # noqa: BLE001  (the trainer raises it; keep serving)
      conn.send({"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
  # The guard matters: vLLM may start helper processes that re-import __main__.
  key = bytes.fromhex(os.environ.pop("TREE_RL_VLLM_AUTHKEY"))
  sys.exit(serve(sys.argv[1], key))
