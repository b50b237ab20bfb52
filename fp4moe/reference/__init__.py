"""The pure-torch reference backend: the oracle every kernel is tested against.

It runs on CPU and CUDA tensors alike and follows the arithmetic of docs/semantics.md literally.
"""
