"""One Decoder from a layer pattern, and the named configs (GPT-2 small to Kimi K3)."""

from lineage_jax.models.config import CONFIGS, MIXERS, ModelConfig, config_names, get_config
from lineage_jax.models.decoder import Decoder, DecoderCache, layer_groups

__all__ = ["CONFIGS", "MIXERS", "Decoder", "DecoderCache", "ModelConfig", "config_names", "get_config", "layer_groups"]
