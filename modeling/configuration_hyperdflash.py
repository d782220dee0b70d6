"""Configuration of the HyperDFlash drafter (also the Hub's remote code, so it imports transformers and nothing
heavier)."""

from transformers import PreTrainedConfig

from .draft_options import BLOCK_DRAFTER_TYPE

REDUCERS = ("inherited_gate", "dense")
CONDITIONINGS = ("pre_collapse", "intermediate")
TARGET_MODEL_TYPES = ("deepseek_v4", "hy_v4", "glm5_next_text", "qwen4_exp_text")
# Target families whose collapse is a gated residual over a flat `[B, S, hc * D]` stream (the others: V4's head form)
GATED_RESIDUAL_TARGETS = ("qwen4_exp_text",)


class HyperDFlashConfig(PreTrainedConfig):
    r"""
    A block-parallel (DFlash-style) drafter conditioned on a multi-stream (mHC) target. Defaults match a drafter for
    DeepSeek-V4-Flash; `HyperDFlashForDrafting.from_target` fills in the target-dependent fields.

    Args:
        vocab_size (`int`): vocabulary of the target; the drafter has no embedding or LM head of its own, this only
            records which target it belongs to.
        hidden_size (`int`): the target's hidden size (the drafter works at the same width).
        intermediate_size (`int`): SwiGLU width of the draft layers.
        num_hidden_layers (`int`): number of draft layers.
        num_attention_heads / num_key_value_heads / head_dim (`int`): draft attention shape (GQA).
        hidden_act (`str`): activation of the SwiGLU MLP.
        max_position_embeddings (`int`): longest position the drafter is meant for (the target's).
        initializer_range (`float`): std of the normal init of projections and the mask embedding.
        rms_norm_eps (`float`): eps of every RMSNorm, including the reducer's unweighted input norm.
        hc_mult (`int`): number of residual streams of the target (mHC).
        hc_eps (`float`): floor added to each stream gate, as in the target's `hc_head`.
        rope_parameters (`dict`, *optional*): RoPE of the draft layers; `rope_theta` may also be passed alone.
        attention_dropout (`float`): dropout on draft attention weights (training only).
        block_size (`int`): tokens per draft block: the anchor plus `block_size - 1` drafted tokens.
        reducer (`str`): `"inherited_gate"` (the target's `hc_head` form, HyperDFlash) or `"dense"` (a bias-free
            linear map of the flattened streams, vanilla DFlash).
        conditioning (`str`): `"pre_collapse"` (the target's final residual before `hc_head`, HyperDFlash) or
            `"intermediate"` (outputs of target decoder layers `target_layer_ids`, vanilla DFlash).
        target_layer_ids (`list[int]`, *optional*): 0-based target decoder layers whose outputs condition the drafter;
            required for, and only allowed with, `conditioning="intermediate"`.
        target_model_type (`str`): `model_type` of the target family's text config; it also picks the inherited
            gate's form (DeepSeek-V4's head, or Qwen4-Exp's gated residual).
        hc_lowrank (`int`, *optional*): rank of the inherited gate for Qwen4-Exp targets (the target's `hc_lowrank`).
        markov_rank (`int`): > 0 adds DSpark's Markov and confidence heads (`draft_heads.py`) with a Markov bias of
            this rank; drafts are then drawn left to right and the confidence head is the draft schedule's confidence
            input. 0 (HyperDFlash, vanilla DFlash): none.
        context_window (`int`, *optional*): the drafter attends to (and caches) only the target positions within
            this many places before each anchor, so its per-step cost and cache stay bounded at long context; the same
            window applies in training. None keeps the whole context (what a config saved without the field was
            trained with); `from_target` sets `draft_options.DEFAULT_CONTEXT_WINDOW`.
        target_name_or_path (`str`, *optional*): the target this drafter was built for (Hub id or path), for the
            model card and for the warning when it runs with another target.
        target_fingerprint (`str`, *optional*): hash of that target's architecture config; generate() warns when
            the drafter runs with a target whose fingerprint differs.
    """

    model_type = BLOCK_DRAFTER_TYPE

    vocab_size: int = 129280
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 2
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_dropout: float = 0.0
    block_size: int = 16
    reducer: str = "inherited_gate"
    conditioning: str = "pre_collapse"
    target_layer_ids: list[int] | None = None
    target_model_type: str = "deepseek_v4"
    hc_lowrank: int | None = None
    markov_rank: int = 0
    context_window: int | None = None
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None

    def __post_init__(self, **kwargs):
        self._check_fields()
        super().__post_init__(**kwargs)

    @property
    def num_conditioning_layers(self) -> int:
        """How many target residuals (each `hc_mult` streams) are stacked on the stream axis of `target_hidden`."""
        return len(self.target_layer_ids) if self.conditioning == "intermediate" else 1

    def _check_fields(self) -> None:
        """Reject bad values at construction time, naming the field and what it accepts."""
        choices = {"reducer": REDUCERS, "conditioning": CONDITIONINGS, "target_model_type": TARGET_MODEL_TYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        positive += ("num_key_value_heads", "head_dim", "max_position_embeddings", "hc_mult")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        for name in ("rms_norm_eps", "hc_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)!r}.")
        window = self.context_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"`context_window` must be a positive integer or None, got {window!r}.")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"`block_size` must be an integer >= 2 (anchor plus drafts), got {self.block_size!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if self.target_model_type in GATED_RESIDUAL_TARGETS and self.reducer == "inherited_gate":
            if not isinstance(self.hc_lowrank, int) or self.hc_lowrank < 1:
                raise ValueError(
                    f"`hc_lowrank` must be a positive integer for a {self.target_model_type} target's inherited gate, "
                    f"got {self.hc_lowrank!r}; `from_target` copies the target's."
                )
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 0:
            raise ValueError(
                f"`markov_rank` must be an integer >= 0 (0: no Markov or confidence head), got {self.markov_rank!r}."
            )
        if not 0 <= self.attention_dropout < 1:
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {self.attention_dropout!r}.")
        self._check_target_layer_ids()

    def _check_target_layer_ids(self) -> None:
        ids = self.target_layer_ids
        if self.conditioning == "pre_collapse":
            if ids is not None:
                raise ValueError(
                    "`target_layer_ids` is only used with `conditioning='intermediate'`; leave it None for "
                    "'pre_collapse'."
                )
            return
        if ids is None:
            raise ValueError(
                "`target_layer_ids` is required with `conditioning='intermediate'` (a list of distinct target layer "
                "indices >= 0); `HyperDFlashForDrafting.from_target` picks a spread when none is given."
            )
        valid = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        if not ids or not valid or len(set(ids)) != len(ids):
            raise ValueError(f"`target_layer_ids` must be a non-empty list of distinct integers >= 0, got {ids!r}.")


HyperDFlashConfig.register_for_auto_class()
