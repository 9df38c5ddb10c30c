"""Export a training run's checkpoint as a Hugging Face folder (LoRA merged).

  python launch/export_hf.py --workdir=/tmp/apppo --out=/tmp/apppo_hf [--step=N]

The folder holds safetensors weights, config.json, generation_config.json and the
tokenizer with its chat template; `transformers` and vLLM load it. --out must be a new
or empty folder, or an earlier export (recognised by its `tree_rl_export.json`), which
is replaced atomically; anything else (the run's own workdir, say) is refused untouched.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory.")
_OUT = flags.DEFINE_string("out", None, "Output HF folder.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from tree_rl.models import hf_io
  from tree_rl.checkpoint import restore_policy

  # Refuse a folder that is not empty and not an earlier export (such as the run's own
  # workdir) before the slow restore; save_hf checks again and never deletes one.
  hf_io.check_export_target(_OUT.value)
  model, tokenizer, _ = restore_policy(_WORKDIR.value, _STEP.value)
  # The tokenizer files (and chat template) come from the folder it was loaded from.
  out = hf_io.save_hf(model, _OUT.value, tokenizer_from=tokenizer.name_or_path)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
