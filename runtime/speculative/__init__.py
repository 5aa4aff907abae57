"""Speculative decoding: drafts (n-gram lookup or a small draft model) verified by one target pass."""
