"""The transformers surface the runtime touches beyond its stable public API, in one place.

Supported: transformers 5.23 to 5.25 (`TESTED_RANGE`). 5.24 renamed the cache argument and output field from
`past_key_values` to `cache`, keeping the old name as a deprecated alias. 5.25 decides whether assisted decoding may
run from the cache (`Cache.is_croppable`, checked after the prefill) instead of the model's `_is_stateful`, and rolls
linear-attention layers back itself (`activate_past_recording(recurrent_states_to_keep=...)`). Every private name
below is pinned by a test in `tests/test_transformers_internals.py`, run on every supported version in CI, and
`check_internals()` checks, before a call decodes anything, that each one is still there:

- `GenerationMixin.generate` signature: wrapped once, bound to find the assistant
  (test_generate_signature_has_what_the_wrapper_binds)
- `GenerationMixin._get_candidate_generator`: replaced for one call on the target instance (`call_scope.methods`)
  (test_assisted_decoding_builds_the_candidate_generator_with_keywords_only)
- `GenerationMixin._get_stopping_criteria`: wrapped for one call on the target instance, to stop per token
  (test_generate_builds_the_stopping_criteria_once_with_keywords_only)
- generate()'s rule for a mask it infers from padding tokens (`_prepare_attention_mask_for_generation`), which
  `integration.masks_padding` restates (test_masks_padding_is_the_rule_generate_infers_a_mask_by)
- `CandidateGenerator.model_kwargs_overrides`: feeds only the uncached part of the prompt on the first forward
  (test_generation.py::test_continuing_from_a_returned_cache_matches_plain_decoding)
- `CandidateGenerator.requires_model_outputs`: our generator receives each verify forward's outputs
  (test_assisted_decoding_passes_model_outputs_when_the_generator_asks_for_them)
- `update_candidate_strategy(input_ids, new_logits, n_matches)`: accepted drafts per step, for the stats
  (test_assisted_decoding_reports_matches_to_the_generator)
- before 5.25, `PreTrainedModel._is_stateful`: a class attribute read from the instance; lifted for one call on the
  target instance (`call_scope.lifted_stateful_guard`) (test_stateful_guard_is_checked_on_the_instance); from 5.25,
  `outputs.cache.is_croppable` after the prefill (test_assisted_decoding_checks_the_cache_is_croppable)
- from 5.25, `LinearAttentionLayer` past recording: `crop(-n)` restores `recurrent_states_history[-n]`, so a verify
  forward of `n + 1` tokens must keep `n + 1` states (`target_linear_attention.py`)
  (test_linear_attention_layers_restore_the_recorded_state_n_back)
- from 5.25, `LinearAttentionCacheLayerMixin.crop` (transformers 5.25.0 `cache_utils.py`) cuts every one of a layer's
  `number_of_states` conv windows by `conv_kernel_size[i]`, `None` for a state the layer never filled (Qwen4-Exp's
  PLE states on a linear layer without PLE), and raises `TypeError`: replaced process-wide by a crop of the filled
  states (`target_linear_attention.install_crop_of_present_states`)
  (tests/test_config_space.py::test_the_stock_crop_still_needs_the_fix_for_states_a_layer_never_filled)
- `dynamic_module_utils.get_relative_import_files`: what a saved drafter's entry module imports (`remote_code.py`)
  (test_relative_import_files_follows_the_entry_modules_imports)
- `GenerationMixin._prepare_generation_config`: the merged config, to refuse bad requests before any work
  (test_prepare_generation_config_returns_the_merged_config_and_model_kwargs)
- `generation.utils._speculative_sampling`: verifies sampled drafts against our q
  (test_speculative_sampling_is_a_module_function_fed_the_drafters_logits)
- `Cache.crop` / `activate_past_recording` calls in `_assisted_decoding`: how the target is rewound
  (test_assisted_decoding_rewinds_through_the_cache_api)
- the input of `model.hc_head` (`DeepseekV4HyperHead`): the pre-collapse residual the drafter reads
  (test_hc_head_collapses_the_pre_collapse_residual)
- `DeepseekV4HCACache` / `DeepseekV4CSACache` state and hooks: what the rewindable cache intercepts
  (tests/test_rewindable_cache.py)
- `DeepseekV4IndexerScorer.forward`: returns ranks with ties broken by position (`indexer_ties.py`), the same
  selection while `DeepseekV4Indexer.forward` uses the scores only to mask them and take their `topk`
  (test_deepseek_v4_indexer_uses_its_scores_only_to_mask_and_select)
- `HYV4Indexer.forward` and the GLM-5-Next and Qwen4-Exp indexers': run with `topk` breaking ties by position, which
  covers their selection while they pick entries with `topk` alone (test_indexers_select_entries_only_with_topk)
- `DeepseekV4Attention` calling its compressor positionally, and HCA's block bias (none for one token, by position id
  for more): rebuilt for verify rows by `compressed_visibility.py`
  (test_attention_calls_its_compressor_with_positional_arguments,
  test_one_token_hca_forward_sees_every_compressed_entry_and_longer_ones_mask_by_position)
- `generation.utils._split_model_outputs(outputs, new_outputs, cur_len, added_len, is_decoder_attention=...)`:
  replaced for one call (`call_scope.functions`) by `output_split.split_per_token`
  (test_assisted_decoding_splits_attentions_with_the_decoder_attention_flag)
- before 5.25, GLM-5-Next's and Qwen4-Exp's linear-attention forwards: call their delta-rule kernels by module name
  with query/key/value/g/beta/initial_state and store the state last (`cache_linear_attention.py`)
  (test_linear_attention_forwards_call_their_kernels_by_module_name); `LinearAttentionLayer` conv and recurrent
  state methods (tests/test_linear_attention_cache.py)
- `pipelines.base.load_assistant_model(model, assistant_model, assistant_tokenizer)`, called by name from
  `Pipeline.__init__`: wrapped by the library (`hf_hyperdflash/pipeline_assistants.py`) so a pipeline takes a
  drafter by path (test_pipelines_load_a_named_assistant_through_load_assistant_model)
- a model spread by transformers' parallel plans has its `_device_mesh` set (`rank_agreement.spread_group`), and
  `_speculative_sampling` returns `(valid_tokens, n_matches)` (`agreed_steps.rank_zero_verdict`)
  (test_a_spread_model_carries_its_device_mesh_and_sampled_verdicts_come_back_as_tokens_and_a_count)
- the cache argument's name, `CACHE_ARGUMENT` below (test_cache_argument_is_the_installed_versions)
"""

from __future__ import annotations

import inspect
import re
import warnings

import transformers
import transformers.generation.candidate_generator as candidate_generator
import transformers.generation.utils as generation_utils
from transformers import GenerationMixin
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4Model

# The transformers minor releases CI runs the whole suite or its compatibility subset on (pyproject.toml pins them).
TESTED_RANGE = ("5.23", "5.25")
_WARNED_UNTESTED = "_hyperdflash_warned_untested_version"

# The keyword transformers' forward and generate() take the cache by ("cache" from 5.24 on).
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(DeepseekV4Model.forward).parameters else "past_key_values"
# Both spellings a user may pass to generate() (5.24 still accepts the old one, with a FutureWarning).
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cached_length(cache) -> int:
    """The tokens `cache` holds, as an int: from 5.25 a hybrid cache answers with its first linear-attention layer's
    live counter, a tensor that later forwards and crops change in place."""
    return int(cache.get_seq_length())


def pop_user_cache(generate_kwargs: dict):
    """Remove the caller's cache from the generate() kwargs, whichever name it came under, and return it."""
    found = [generate_kwargs.pop(name) for name in CACHE_ARGUMENTS if name in generate_kwargs]
    return next((cache for cache in found if cache is not None), None)


# 5.25 rolls linear-attention layers back itself; before it, `cache_linear_attention.py` does.
STOCK_LINEAR_ATTENTION_ROLLBACK = (
    "recurrent_states_to_keep" in inspect.signature(LinearAttentionLayer.activate_past_recording).parameters
)

# Every internal the runtime reads or replaces, as (owner, attribute), by the versions that have it.
_INTERNALS = [
    (GenerationMixin, "_assisted_decoding"),
    (GenerationMixin, "_get_candidate_generator"),
    (GenerationMixin, "_get_stopping_criteria"),
    (GenerationMixin, "_prepare_generation_config"),
    (GenerationMixin, "_prepare_attention_mask_for_generation"),
    (GenerationMixin, "_sample"),
    (GenerationMixin, "_prefill"),
    (GenerationMixin, "_optimize_model_for_decode"),
    (GenerationMixin, "_update_model_kwargs_for_generation"),
    (candidate_generator, "_prepare_attention_mask"),
    (candidate_generator, "_prepare_position_ids"),
    (candidate_generator, "_prepare_token_type_ids"),
    (generation_utils, "_split_model_outputs"),
    (generation_utils, "_speculative_sampling"),
    (candidate_generator.CandidateGenerator, "requires_model_outputs"),
    (DeepseekV4CSACache, "store_compression_weights"),
    (DeepseekV4CSACache, "update_overlap_state"),
]


def _tested_versions() -> str:
    first, last = TESTED_RANGE
    return f"{first}.x to {last}.x"


def check_internals() -> None:
    """Raise, naming the internal and the versions known to work, if an internal the runtime relies on is gone: called
    before a speculative call decodes anything, so a changed transformers never fails inside its own loop."""
    for owner, name in _INTERNALS:
        if not hasattr(owner, name):
            raise RuntimeError(
                f"hf-hyperdflash relies on `{owner.__name__}.{name}`, which transformers {transformers.__version__} "
                f"no longer has. Speculative decoding with this drafter is known to work with transformers "
                f"{_tested_versions()}: install one of them (`pip install 'transformers>={TESTED_RANGE[0]},"
                f"<{_next_minor(TESTED_RANGE[1])}'`), or a newer hf-hyperdflash."
            )


def _minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "5.25.0" or "5.26.0.dev0"."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _next_minor(version: str) -> str:
    major, minor = _minor(version)
    return f"{major}.{minor + 1}"


def warn_if_untested() -> None:
    """Warn once per process when the installed transformers is newer than the tested range: a Hub user who loads a
    drafter's remote code never installed the package, nor its pin. The flag lives on transformers, so every copy of
    the runtime in the process (the library, one per remote-code folder) shares it."""
    newer = _minor(transformers.__version__) > _minor(TESTED_RANGE[1])
    if newer and not getattr(transformers, _WARNED_UNTESTED, False):
        setattr(transformers, _WARNED_UNTESTED, True)
        warnings.warn(
            f"hf-hyperdflash's drafters are tested with transformers {_tested_versions()}; this is "
            f"{transformers.__version__}. Each speculative call first checks the internals it uses, but if an output "
            f"looks wrong, install a tested version (`pip install 'transformers<{_next_minor(TESTED_RANGE[1])}'`).",
            UserWarning,
            stacklevel=2,
        )
