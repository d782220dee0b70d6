"""Configuration of DSpark, DeepSeek's block drafter for DeepSeek-V4 (the "0731" releases ship it as `mtp.*`)."""

from transformers import DeepseekV4Config

from .draft_options import DSPARK_DRAFTER_TYPE
from .target_architecture import TARGET_ONLY_FIELDS, target_fingerprint

DSPARK_CONDITIONINGS = ("stream_mean", "pre_collapse")


class DeepseekV4DSparkConfig(DeepseekV4Config):
    """`num_hidden_layers` V4 blocks (the stages: window attention only, top-k MoE) with the target's dimensions.

    `dspark_block_size` rows per block: the anchor, then `dspark_noise_token_id`, each row drafting the token after
    it. The context is `main_norm(main_proj(...))` of the stream-means of the target layers `dspark_target_layer_ids`
    (their outputs), the last `sliding_window` positions of it. `dspark_markov_rank`: the low-rank bias from the
    previous token. Names and defaults follow the released config (V4-Flash 0731: block 5, rank 256, layers
    [40, 41, 42], noise id 128799, 3 stages, window 128).

    `dspark_conditioning="pre_collapse"` (not DeepSeek's; HyperDFlash's idea on DSpark) conditions instead on the
    target's final pre-collapse residual (its last layer's output), collapsed by a gate of the target's `hc_head` form
    that starts as a copy of it, in place of the stream-mean: `main_norm(main_proj(gate(last layer's streams)))`.
    """

    model_type = DSPARK_DRAFTER_TYPE
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] | None = None
    dspark_markov_rank: int = 256
    dspark_conditioning: str = "stream_mean"
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None

    def __post_init__(self, **kwargs):
        self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        self.mlp_layer_types = ["moe"] * self.num_hidden_layers
        super().__post_init__(**kwargs)
        self._check_conditioning()

    def _check_conditioning(self) -> None:
        if self.dspark_conditioning not in DSPARK_CONDITIONINGS:
            raise ValueError(
                f"`dspark_conditioning` must be one of {DSPARK_CONDITIONINGS}, got {self.dspark_conditioning!r}."
            )
        if self.dspark_conditioning == "pre_collapse" and len(self.dspark_target_layer_ids or []) != 1:
            raise ValueError(
                "`dspark_conditioning='pre_collapse'` reads one layer, the target's last: set "
                f"`dspark_target_layer_ids` to [num_target_layers - 1], got {self.dspark_target_layer_ids}."
            )

    @classmethod
    def from_target_config(cls, target_config: DeepseekV4Config, **dspark) -> "DeepseekV4DSparkConfig":
        """The target's dimensions; `dspark` sets the `dspark_*` fields and `num_hidden_layers` (the stages, 3 by
        default; conditioning by default on the target's last three layers, or its last with `pre_collapse`)."""
        settings = {key: value for key, value in target_config.to_dict().items() if key not in TARGET_ONLY_FIELDS}
        layers = target_config.num_hidden_layers
        tapped = 1 if dspark.get("dspark_conditioning") == "pre_collapse" else 3
        settings |= {"num_hidden_layers": 3, "dspark_target_layer_ids": list(range(max(layers - tapped, 0), layers))}
        settings |= {key: value for key, value in dspark.items() if value is not None}
        settings["target_name_or_path"] = target_config.name_or_path or None
        settings["target_fingerprint"] = target_fingerprint(target_config)
        return cls(**settings)


__all__ = ["DeepseekV4DSparkConfig"]

DeepseekV4DSparkConfig.register_for_auto_class()
