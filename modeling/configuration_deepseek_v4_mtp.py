"""Configuration of DeepSeek-V4's native multi-token-prediction (MTP) module, used as a drafter."""

from transformers import DeepseekV4Config

from .draft_options import MTP_DRAFTER_TYPE
from .target_architecture import TARGET_ONLY_FIELDS, target_fingerprint


class DeepseekV4MTPConfig(DeepseekV4Config):
    """A one-block DeepSeek-V4 config describing the MTP module of a V4 target.

    The block is V4's own decoder layer restricted, as in the reference inference code, to
    sliding-window attention and top-k (non-hash) MoE. Every other dimension is the target's.
    `num_nextn_predict_layers` keeps the target's value for reference; drafting depth is
    `generation_config.num_assistant_tokens` (the module is reused on its own output).
    `target_name_or_path` / `target_fingerprint` record the target it was built for (see HyperDFlashConfig).
    """

    model_type = MTP_DRAFTER_TYPE
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None

    def __post_init__(self, **kwargs):
        if self.num_hidden_layers != 1:
            raise ValueError(f"An MTP module is one decoder block; got num_hidden_layers={self.num_hidden_layers}.")
        self.layer_types = ["sliding_attention"]
        self.mlp_layer_types = ["moe"]
        super().__post_init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: DeepseekV4Config) -> "DeepseekV4MTPConfig":
        settings = {key: value for key, value in target_config.to_dict().items() if key not in TARGET_ONLY_FIELDS}
        settings["num_hidden_layers"] = 1
        settings["target_name_or_path"] = target_config.name_or_path or None
        settings["target_fingerprint"] = target_fingerprint(target_config)
        return cls(**settings)


__all__ = ["DeepseekV4MTPConfig"]

DeepseekV4MTPConfig.register_for_auto_class()
