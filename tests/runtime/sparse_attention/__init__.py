"""Tests of ``runtime/sparse_attention/``."""
