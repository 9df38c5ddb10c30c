"""A vLLM worker extension that loads new policy weights: vLLM's weight-transfer API with
a file backend of tree_rl's own where vLLM has that API, an in-place reload otherwise.

vLLM mixes this class into its worker (`LLM(worker_extension_cls=...)`), and
`LLM.collective_rpc("tree_rl_load_weights", args=(path,))` runs the method on
every worker. The tensors arrive as one safetensors file of HF-named tensors
(tree_rl's export table, `tree_rl.models.hf_io.hf_tensors`); a file rather than
a pickled message because it is zero-copy to read (mmap) and needs no torch on
the trainer's side.

Loading goes through the worker's `reload_weights`, not a bare
`model.load_weights`: on CPU, vLLM repacks every linear weight after loading
(oneDNN / packed GEMM kernels) and drops the original tensor, so writing into
the parameters alone would leave the kernels on the old weights. The reload
path restores each layer, runs the model's own HF-name loader (which also fuses
q/k/v and gate/up), and re-runs the repacking, layer by layer. One layer it
misses, a tied LM head, is re-packed here afterwards.

Weight-transfer API (in vLLM 0.32.0, the pinned version). vLLM's
`vllm.distributed.weight_transfer` defines `WeightTransferEngine` (one per
worker, built from `LLM(weight_transfer_config=WeightTransferConfig(backend=))`
through `WeightTransferEngineFactory`) and the `LLM` methods
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`. Its built-in backends (nccl, ipc = CUDA IPC,
sparse_nccl, nccl_m2n, sharded_rdt, modelexpress) all move torch CUDA tensors
from a torch trainer; tree_rl's trainer is JAX and may be on CPU. The factory
takes custom backends (`register_engine`), so `FileWeightTransferEngine` below
is one: an update names a safetensors file, read with mmap, and the engine runs
vLLM's layerwise reload around it (start/finish), as its checkpoint-format
backends do. Registration happens when this module is imported, which vLLM does
in every worker process (the extension class is resolved there), so it holds
with vLLM's own worker processes too. Without the API (`register_file_backend`
returns None) the server falls back to `tree_rl_load_weights` below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
from safetensors import safe_open

# The name our backend is registered under in vLLM's WeightTransferEngineFactory.
FILE_BACKEND = "tree_rl_safetensors"


def _tensors(path: str, names: Sequence[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
  with safe_open(path, framework="pt", device="cpu") as f:
    for name in (f.keys() if names is None else names):
      yield name, f.get_tensor(name)


def register_file_backend() -> str | None:
  """Registers `FileWeightTransferEngine` with vLLM's weight-transfer factory, once.

  Feature detection, not a version check: returns FILE_BACKEND when this vLLM has the
  worker side of the weight-transfer API (the factory, `WeightTransferConfig`, the engine
  base class and the layerwise reload), None when it lacks any of them. (The server also
  checks the `LLM` methods that drive it.)
  """
  try:
    from vllm.config import WeightTransferConfig  # noqa: F401, PLC0415
    from vllm.distributed.weight_transfer.base import WeightTransferEngine  # noqa: PLC0415
    from vllm.distributed.weight_transfer.factory import (  # noqa: PLC0415
        WeightTransferEngineFactory)
    from vllm.model_executor.model_loader.reload import (  # noqa: F401, PLC0415
        finalize_layerwise_reload, initialize_layerwise_reload)
  except ImportError:
    return None
  registry = getattr(WeightTransferEngineFactory, "_registry", None)
  if registry is None or FILE_BACKEND not in registry:
    WeightTransferEngineFactory.register_engine(FILE_BACKEND,
                                                _file_engine_class(WeightTransferEngine))
  return FILE_BACKEND


@dataclasses.dataclass
class FileInitInfo:
  """Our backend's init info: nothing to set up (no communicator; files travel by path)."""


@dataclasses.dataclass
class FileUpdateInfo:
  """One update: a safetensors file of HF-named tensors, and which of them (None: all)."""

  path: str
  names: list[str] | None = None


def _file_engine_class(base: type) -> type:
  """`FileWeightTransferEngine`, a subclass of vLLM's WeightTransferEngine `base` (built
  here because the base class only exists in vLLMs with the API)."""

  class FileWeightTransferEngine(base):
    """Weights from a safetensors file, loaded through vLLM's layerwise reload.

    start: `initialize_layerwise_reload` (each layer's kernels go back to checkpoint form);
    update: the model's own HF-name loader over the file's tensors; finish:
    `finalize_layerwise_reload` (re-runs the CPU repacking), then the tied LM head's
    GEMM, which the reload skips. `loaded` counts the tensors read since `start`.
    """

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.loaded = 0

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
      self.loaded = 0

    def start_weight_update(self) -> None:
      from vllm.model_executor.model_loader.reload import (  # noqa: PLC0415
          initialize_layerwise_reload)

      self.loaded = 0
      initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
      def counted():
        for item in _tensors(update_info.path, update_info.names):
          self.loaded += 1
          yield item

      self.model.load_weights(counted())

    def update_weights(self, update_info: dict) -> None:
      # The base class ends with torch.accelerator.synchronize() for asynchronous
      # transports; a file is read synchronously, and there may be no accelerator.
      self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
      from vllm.model_executor.model_loader.reload import (  # noqa: PLC0415
          finalize_layerwise_reload)

      finalize_layerwise_reload(self.model, self.model_config)
      _refresh_cpu_vocab_gemms(self.model)

    def shutdown(self) -> None:
      self.loaded = 0

  return FileWeightTransferEngine


class WeightSyncExtension:
  """Methods added to vLLM's worker; `self` is the worker."""

  def tree_rl_transfer_count(self) -> int:
    """Tensors the weight-transfer engine read in the last update (checked by the caller)."""
    return int(self.weight_transfer_engine.loaded)

  def tree_rl_load_weights(self, path: str, names: Sequence[str] | None = None) -> int:
    """Loads the tensors of a safetensors file (all, or `names`) in place.

    Returns:
      the number of tensors read, for the caller to check.
    """
    count = 0

    def counted():
      nonlocal count
      for item in _tensors(path, names):
        count += 1
        yield item

    self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
    _refresh_cpu_vocab_gemms(self.model_runner.get_model())
    return count


def _refresh_cpu_vocab_gemms(model: torch.nn.Module) -> None:
  """Re-packs the CPU GEMM of every vocabulary layer from its current weight.

  With tied embeddings the LM head loads nothing of its own (its weight *is*
  the embedding's), so the reload leaves its CPU GEMM (packed from the weight
  at start-up) on the old values, and the logits with it. Embedding layers
  keep their weight after packing, so packing again is safe; on GPU there is
  no packed copy and nothing to do.
  """
  from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: PLC0415
      UnquantizedEmbeddingMethod, VocabParallelEmbedding)
  from vllm.platforms import current_platform  # noqa: PLC0415

  if not current_platform.is_cpu():
    return
  for module in model.modules():
    if (isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear")
        and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)):
      module.quant_method.process_weights_after_loading(module)


# vLLM imports this module in every worker process (to resolve the extension class) before
# it builds the worker's weight-transfer engine: register our backend there.
register_file_backend()
