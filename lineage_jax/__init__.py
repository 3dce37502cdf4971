"""lineage_jax: the memory lineage of language models, from GPT-2 to Kimi K3, in JAX."""

__version__ = "0.1.0"
