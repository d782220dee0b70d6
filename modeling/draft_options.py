"""The names and defaults drafting is configured by, in one place (no imports: the command line reads them too).

Drafters are recognised by their config's `model_type`; the draft schedule is
`drafter.generation_config.num_assistant_tokens_schedule`, as in transformers' assisted decoding, and so is its
`assistant_confidence_threshold`. As in transformers, `heuristic` keeps its draft length for the drafter's next call
and `heuristic_transient` starts afresh.
"""

BLOCK_DRAFTER_TYPE = "hyperdflash"  # HyperDFlash and vanilla DFlash: one forward drafts a block
MTP_DRAFTER_TYPE = "deepseek_v4_mtp"  # DeepSeek-V4's native MTP module: one forward per drafted token
# DeepSeek's DSpark for V4: one forward drafts a block; a Markov bias and a confidence per token, left to right
DSPARK_DRAFTER_TYPE = "deepseek_v4_dspark"
DRAFTER_TYPES = (BLOCK_DRAFTER_TYPE, MTP_DRAFTER_TYPE, DSPARK_DRAFTER_TYPE)

# Each step verifies the drafts with the most expected tokens per unit of cost, and drafting waits where it does not
# pay, by a cost model fixed for the call (DRAFT_COSTS_BY_DEVICE) and the tokens alone: a seeded call repeats.
ADAPTIVE_SCHEDULE = "adaptive"
# transformers' own: the draft length grows by 2 after a step whose drafts were all accepted and shrinks by 1
# otherwise; kept on `generation_config.num_assistant_tokens` for the next call (the `_transient` one restores it)
HEURISTIC_SCHEDULE = "heuristic"
HEURISTIC_TRANSIENT_SCHEDULE = "heuristic_transient"
CONSTANT_SCHEDULE = "constant"  # each step verifies `num_assistant_tokens` drafts
SCHEDULES = (ADAPTIVE_SCHEDULE, HEURISTIC_SCHEDULE, HEURISTIC_TRANSIENT_SCHEDULE, CONSTANT_SCHEDULE)
DEFAULT_SCHEDULE = ADAPTIVE_SCHEDULE
# The adaptive schedule's cost model, in plain decoding steps, by the target's device type and the drafter's kind:
# one drafter forward with the step's bookkeeping (`draft_cost`) and each draft a verify forward carries besides the
# token plain decoding feeds (`verify_cost`); a batched drafter's forward grows by `draft_row_cost` per row of a batch
# (a profiled batched call on the shipped pair: 0.49 of a plain batched step at batch 1 and 4, 0.82 at 16);
# a drafted position costs a batch of B rows `verify_cost` times `verify_growth` at B (interpolated over log B;
# measured with `benchmarks/verify_width_cost.py --batch-sizes 1 4 16 32 --repeats 15`: a forward 8 wide is 1.63x a
# plain step at batch 4, 2.61x at 16, 2.76x at 32); a drafter's `generation_config.draft_cost`, `.verify_cost` and
# `.draft_row_cost` override.
# "cpu": the shipped pair on this project's CPU (`benchmarks/draft_costs.py`); "cuda" (any other accelerator too):
# the block drafter on one H200 (`benchmarks/gpu.py`), native MTP and DSpark not measured there (docs/results.md,
# "Draft costs").
DRAFT_COSTS_BY_DEVICE = {
    "cpu": {
        BLOCK_DRAFTER_TYPE: {
            "draft_cost": 0.49,
            "verify_cost": 0.09,
            "draft_row_cost": 0.022,
            "verify_growth": ((4, 1.0), (16, 2.6), (32, 2.8)),
        },
        MTP_DRAFTER_TYPE: {"draft_cost": 0.33, "verify_cost": 0.09},
        DSPARK_DRAFTER_TYPE: {"draft_cost": 1.28, "verify_cost": 0.09},
    },
    "cuda": {
        BLOCK_DRAFTER_TYPE: {"draft_cost": 0.25, "verify_cost": 0.01},
        MTP_DRAFTER_TYPE: {"draft_cost": 0.25, "verify_cost": 0.01},
        DSPARK_DRAFTER_TYPE: {"draft_cost": 0.25, "verify_cost": 0.01},
    },
}

# `drafter.generation_config.draft_from_context` (default True): each step may verify a chain copied from the context
# (the prompt and the reply so far) instead of the drafter's (`context_copy.py`); False: the drafter's only
DRAFT_FROM_CONTEXT = "draft_from_context"

DEFAULT_MTP_DEPTH = 3  # drafts per step of a native MTP drafter, V4's reference setting
# The deepest a schedule that grows the draft length ("heuristic") takes a native MTP drafter: transformers' stock
# assistants have no such limit, but a call sizes its rollback history for its longest draft. V4's MTP has its
# drafts at depth 4 accepted 8% of the time (docs/results.md), so depth 8 is already far past paying.
MAX_MTP_DEPTH = 8
# Target positions a new drafter attends to before each anchor: every window from 64 to 1,024 beats the whole context
# on long held-out conversations, and 512 also edges it on the main prompts (docs/results.md).
DEFAULT_CONTEXT_WINDOW = 512
