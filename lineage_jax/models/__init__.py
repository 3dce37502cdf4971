"""One Decoder from a layer pattern, and the named configs (GPT-2 small to Kimi K3)."""

from lineage_jax.models.config import CONFIGS, MIXERS, ModelConfig, config_names, get_config, register_rule
from lineage_jax.models.decoder import Decoder, DecoderCache, InferenceSteps, inference_steps, layer_groups

__all__ = ["CONFIGS", "MIXERS", "Decoder", "DecoderCache", "InferenceSteps", "ModelConfig", "config_names", "get_config",
           "inference_steps", "layer_groups", "register_rule"]
