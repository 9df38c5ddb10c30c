"""A vLLM worker extension that loads new policy weights in place.

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from safetensors import safe_open


def _tensors(path: str, names: Sequence[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
  with safe_open(path, framework="pt", device="cpu") as f:
    for name in (f.keys() if names is None else names):
      yield name, f.get_tensor(name)


class WeightSyncExtension:
  """Methods added to vLLM's worker; `self` is the worker."""

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
