"""The names and defaults drafting is configured by, in one place (no imports: the command line reads them too).

Drafters are recognised by their config's `model_type`; the draft schedule is
`drafter.generation_config.num_assistant_tokens_schedule`, as in transformers' assisted decoding.
"""

BLOCK_DRAFTER_TYPE = "hyperdflash"  # HyperDFlash and vanilla DFlash: one forward drafts a block
MTP_DRAFTER_TYPE = "deepseek_v4_mtp"  # DeepSeek-V4's native MTP module: one forward per drafted token
DRAFTER_TYPES = (BLOCK_DRAFTER_TYPE, MTP_DRAFTER_TYPE)

ADAPTIVE_SCHEDULE = "adaptive"  # each step verifies the drafts that maximise expected tokens per second
CONSTANT_SCHEDULE = "constant"  # each step verifies `num_assistant_tokens` drafts
SCHEDULES = (ADAPTIVE_SCHEDULE, CONSTANT_SCHEDULE)
DEFAULT_SCHEDULE = ADAPTIVE_SCHEDULE  # never slower than plain decoding by more than its probes (docs/results.md)

DEFAULT_MTP_DEPTH = 3  # drafts per step of a native MTP drafter, V4's reference setting
# Target positions a new drafter attends to before each anchor: every window from 64 to 1,024 beats the whole context
# on long held-out conversations, and 512 also edges it on the main prompts (docs/results.md).
DEFAULT_CONTEXT_WINDOW = 512
