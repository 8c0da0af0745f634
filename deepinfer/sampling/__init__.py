"""Sampling parameters, counter-based randomness and the sampler."""
