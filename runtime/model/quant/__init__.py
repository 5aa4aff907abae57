"""Quantized weights served quantized (issue 49): GGUF blocks kept as the file stores them, repacked
once at load for the C++ kernels (kernels/csrc/gguf_linear_cpu.cpp)."""
