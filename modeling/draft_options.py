"""The names and defaults drafting is configured by, in one place (no imports: the command line reads them too).

Drafters are recognised by their config's `model_type`; the draft schedule is
`drafter.generation_config.num_assistant_tokens_schedule`, as in transformers' assisted decoding, and so is its
`assistant_confidence_threshold`. Like transformers' `heuristic` / `heuristic_transient` pair, a schedule without the
`_transient` suffix keeps what it learned for the drafter's next call, and its `_transient` twin starts afresh.
"""

BLOCK_DRAFTER_TYPE = "hyperdflash"  # HyperDFlash and vanilla DFlash: one forward drafts a block
MTP_DRAFTER_TYPE = "deepseek_v4_mtp"  # DeepSeek-V4's native MTP module: one forward per drafted token
DRAFTER_TYPES = (BLOCK_DRAFTER_TYPE, MTP_DRAFTER_TYPE)

# Each step verifies the drafts that maximise expected tokens per second, and skips drafting where it does not pay.
# What it learned (confidence-to-acceptance calibration, step costs, whether drafting pays) is kept on the drafter for
# its next call with the same target and decoding setting; never saved.
ADAPTIVE_SCHEDULE = "adaptive"
ADAPTIVE_TRANSIENT_SCHEDULE = "adaptive_transient"  # the same, learning from nothing in every call
# transformers' own: the draft length grows by 2 after a step whose drafts were all accepted and shrinks by 1
# otherwise; kept on `generation_config.num_assistant_tokens` for the next call (the `_transient` one restores it)
HEURISTIC_SCHEDULE = "heuristic"
HEURISTIC_TRANSIENT_SCHEDULE = "heuristic_transient"
CONSTANT_SCHEDULE = "constant"  # each step verifies `num_assistant_tokens` drafts
SCHEDULES = (
    ADAPTIVE_SCHEDULE,
    ADAPTIVE_TRANSIENT_SCHEDULE,
    HEURISTIC_SCHEDULE,
    HEURISTIC_TRANSIENT_SCHEDULE,
    CONSTANT_SCHEDULE,
)
# A chat session makes many calls with one drafter: carried over, a call starts from the calibration and costs its
# predecessors learned, and a drafter that does not pay is not probed again in every call; short calls gain most
# (docs/results.md, "Adaptive draft length"). "adaptive_transient" repeats a call's
# draft lengths, and so its sampled tokens under a fixed seed, only as far as its timings repeat.
DEFAULT_SCHEDULE = ADAPTIVE_SCHEDULE

DEFAULT_MTP_DEPTH = 3  # drafts per step of a native MTP drafter, V4's reference setting
# The deepest a schedule that grows the draft length ("heuristic") takes a native MTP drafter: transformers' stock
# assistants have no such limit, but a call sizes its rollback history for its longest draft. V4's MTP has its
# drafts at depth 4 accepted 8% of the time (docs/results.md), so depth 8 is already far past paying.
MAX_MTP_DEPTH = 8
# Target positions a new drafter attends to before each anchor: every window from 64 to 1,024 beats the whole context
# on long held-out conversations, and 512 also edges it on the main prompts (docs/results.md).
DEFAULT_CONTEXT_WINDOW = 512
