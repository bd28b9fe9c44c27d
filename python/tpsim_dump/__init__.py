"""tpsim_dump: write a tpsim dump (docs/dump-format.md) from your own PyTorch TP code, for
`tpsim check`. Importable from a checkout (sys.path: the repository's python/); needs only
torch (1.13 and 2.x; the tests run PyPI's, pinned in python/requirements-test.txt).

  Recorder      forward hooks by module-name patterns, gradients, parameters, per step
  dump          write_rank, write_manifest, write_weights
  conventions   tpsim's names -> nanogpt, hf-gpt2, megatron, hf-llama, torchtitan
  safetensors   save / load {name: tensor}
"""
from . import conventions, dump, safetensors  # noqa: F401
from .recorder import Recorder  # noqa: F401
