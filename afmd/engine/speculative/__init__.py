"""Speculative decoding: proposals and their verification in one pass."""
