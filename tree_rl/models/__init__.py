"""The policy: one NNX decoder for the Llama, Qwen2 and Qwen3 families.

`ModelConfig` is read from a Hugging Face `config.json`; `Decoder` runs on
packed trees with tree attention; `hf_io` moves weights to and from HF
safetensors folders; `gguf_import` turns a GGUF file (the default
SmolLM2-135M-Instruct ships as one) into such a folder.
"""

from tree_rl.models.config import SUPPORTED_ARCHITECTURES, LoRAConfig, ModelConfig
from tree_rl.models.decoder import Decoder, LoRAParam

__all__ = ["SUPPORTED_ARCHITECTURES", "Decoder", "LoRAConfig", "LoRAParam", "ModelConfig"]
