"""Native ops: JIT-built C++/CUDA extensions from csrc/, each with a PyTorch fallback."""
