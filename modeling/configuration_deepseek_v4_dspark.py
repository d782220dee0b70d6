"""Configuration of DSpark, DeepSeek's block drafter for DeepSeek-V4 (the "0731" releases ship it as `mtp.*`)."""

from transformers import DeepseekV4Config

from .draft_options import DSPARK_DRAFTER_TYPE
from .target_fingerprint import TARGET_ONLY_FIELDS, target_fingerprint


class DeepseekV4DSparkConfig(DeepseekV4Config):
    """`num_hidden_layers` V4 blocks (the stages: window attention only, top-k MoE) with the target's dimensions.

    `dspark_block_size` rows per block: the anchor, then `dspark_noise_token_id`, each row drafting the token after
    it. The context is `main_norm(main_proj(...))` of the stream-means of the target layers `dspark_target_layer_ids`
    (their outputs), the last `sliding_window` positions of it. `dspark_markov_rank`: the low-rank bias from the
    previous token. Names and defaults follow the released config (V4-Flash 0731: block 5, rank 256, layers
    [40, 41, 42], noise id 128799, 3 stages, window 128).
    """

    model_type = DSPARK_DRAFTER_TYPE
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None

    def __post_init__(self, **kwargs):
        self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        self.mlp_layer_types = ["moe"] * self.num_hidden_layers
        super().__post_init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: DeepseekV4Config, **dspark) -> "DeepseekV4DSparkConfig":
        """The target's dimensions; `dspark` sets the `dspark_*` fields and `num_hidden_layers` (the stages, 3 by
        default; conditioning by default on the target's last three layers)."""
        settings = {key: value for key, value in target_config.to_dict().items() if key not in TARGET_ONLY_FIELDS}
        layers = target_config.num_hidden_layers
        settings |= {"num_hidden_layers": 3, "dspark_target_layer_ids": list(range(max(layers - 3, 0), layers))}
        settings |= {key: value for key, value in dspark.items() if value is not None}
        settings["target_name_or_path"] = target_config.name_or_path or None
        settings["target_fingerprint"] = target_fingerprint(target_config)
        return cls(**settings)


__all__ = ["DeepseekV4DSparkConfig"]

DeepseekV4DSparkConfig.register_for_auto_class()
