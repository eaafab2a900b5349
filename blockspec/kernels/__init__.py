"""Triton kernels of the CUDA fast path. Each one has a torch reference elsewhere (the spec) and
a GPU test that they agree; nothing here is imported unless Triton is."""
