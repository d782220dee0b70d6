"""The transformers surface the runtime touches beyond its stable public API, in one place.

Supported: transformers 5.23 and 5.24 (5.24 renamed the cache argument and output field from
`past_key_values` to `cache`, keeping the old name as a deprecated alias). Every private name below is
pinned by a test in `tests/test_transformers_internals.py`, run on both versions in CI:

- `GenerationMixin.generate` signature: wrapped once, bound to find the assistant
  (test_generate_signature_has_what_the_wrapper_binds)
- `GenerationMixin._get_candidate_generator`: replaced for one call on the target instance (`call_scope.methods`)
  (test_assisted_decoding_builds_the_candidate_generator_with_keywords_only)
- `GenerationMixin._get_stopping_criteria`: wrapped for one call on the target instance, to stop per token
  (test_generate_builds_the_stopping_criteria_once_with_keywords_only)
- `GenerationMixin._get_logits_processor`: built once per generate() call on `self`; a stretched call hands the
  first stretch's list to the later ones (`stretches.py`) (test_generate_builds_the_logits_processors_once)
- generate()'s rule for a mask it infers from padding tokens (`_prepare_attention_mask_for_generation`), which
  `integration.masks_padding` restates (test_masks_padding_is_the_rule_generate_infers_a_mask_by)
- `CandidateGenerator.model_kwargs_overrides`: feeds only the uncached part of the prompt on the first forward
  (test_generation.py::test_continuing_from_a_returned_cache_matches_plain_decoding)
- `CandidateGenerator.requires_model_outputs`: our generator receives each verify forward's outputs
  (test_assisted_decoding_passes_model_outputs_when_the_generator_asks_for_them)
- `update_candidate_strategy(input_ids, new_logits, n_matches)`: accepted drafts per step, for the stats
  (test_assisted_decoding_reports_matches_to_the_generator)
- `PreTrainedModel._is_stateful`: a class attribute read from the instance; lifted for one call on the target
  instance (`call_scope.lifted_stateful_guard`) (test_stateful_guard_is_checked_on_the_instance)
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
- GLM-5-Next's and Qwen4-Exp's linear-attention forwards: call their delta-rule kernels by module name with
  query/key/value/g/beta/initial_state and store the state last (`cache_linear_attention.py`)
  (test_linear_attention_forwards_call_their_kernels_by_module_name); `LinearAttentionLayer` conv and recurrent
  state methods (tests/test_linear_attention_cache.py)
- `pipelines.base.load_assistant_model(model, assistant_model, assistant_tokenizer)`, called by name from
  `Pipeline.__init__`: wrapped by the library (`hf_hyperdflash/pipeline_assistants.py`) so a pipeline takes a
  drafter by path (test_pipelines_load_a_named_assistant_through_load_assistant_model)
- the cache argument's name, `CACHE_ARGUMENT` below (test_cache_argument_is_the_installed_versions)
"""

from __future__ import annotations

import inspect

from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model

# The keyword transformers' forward and generate() take the cache by ("cache" from 5.24 on).
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(DeepseekV4Model.forward).parameters else "past_key_values"
# Both spellings a user may pass to generate() (5.24 still accepts the old one, with a FutureWarning).
CACHE_ARGUMENTS = ("cache", "past_key_values")


def pop_user_cache(generate_kwargs: dict):
    """Remove the caller's cache from the generate() kwargs, whichever name it came under, and return it."""
    found = [generate_kwargs.pop(name) for name in CACHE_ARGUMENTS if name in generate_kwargs]
    return next((cache for cache in found if cache is not None), None)
