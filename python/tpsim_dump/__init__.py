"""tpsim_dump: write a tpsim dump (docs/dump-format.md) from your own PyTorch TP code, for
`tpsim check`. Importable from a checkout (sys.path: the repository's python/); needs only
torch (Debian's python3-torch 1.13 works).

  safetensors   save / load {name: tensor}
  conventions   tpsim's names -> nanogpt, hf-gpt2, megatron, hf-llama, torchtitan
"""
