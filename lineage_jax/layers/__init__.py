"""Flax NNX layers: thin wrappers over lineage_jax.memory, plus MLA, FFNs, MoE and AttnRes."""
