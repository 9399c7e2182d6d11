"""diffjax: the Differential Transformer in JAX/Flax."""
