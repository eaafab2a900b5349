"""Our kernels. Triton kernels of the CUDA fast path (nothing of them is imported unless Triton
is); native.py and cpu_kernels.cpp, the CPU kernels of quantized GGUF targets. Each one has a
torch reference elsewhere (the spec) and a test that they agree."""
