"""Fused kernels (C via ctypes on CPU, Triton/CUDA on GPU), each with a reference path."""
