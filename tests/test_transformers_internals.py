"""The transformers internals the runtime relies on (listed in `modeling/transformers_compat.py`) are
still there and still behave as assumed, on every supported transformers version (CI runs this on 5.23, 5.24 and
5.25; `pytest -m compat` runs it, with the generation tests, against whatever version is installed).

Speculative decoding runs inside transformers' own `_assisted_decoding`, with our candidate generator swapped in
per call, and the drafter conditions on the input of the target's `model.hc_head`. A transformers release that
renames, reorders or reroutes any of these must fail here, by name, rather than in a puzzling generation test.
"""

import ast
import copy
import inspect
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import transformers.generation.utils as generation_utils
import transformers.pipelines.base as pipeline_base
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import DynamicCache, GenerationConfig, GenerationMixin
from transformers.cache_utils import LinearAttentionLayer
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import GenerationMode
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4HCACompressor,
    DeepseekV4HyperHead,
    DeepseekV4Indexer,
    DeepseekV4PreTrainedModel,
)

import hf_hyperdflash.modeling
from hf_hyperdflash.modeling import candidate_generator, integration, transformers_compat
from hf_hyperdflash.modeling.indexer_ties import INDEXER_CLASSES, SCORER_CLASSES
from hf_hyperdflash.modeling.transformers_compat import STOCK_LINEAR_ATTENTION_ROLLBACK, TESTED_RANGE
from hf_hyperdflash.testing import tiny_deepseek_v4, tiny_glm5_next

pytestmark = pytest.mark.compat
STATEFUL_GUARD = "_is_stateful" in vars(DeepseekV4PreTrainedModel)  # before 5.25: the model, not its cache, says
PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def _called_name(call: ast.Call) -> str | None:
    """`name` for `name(...)` and for `<something>.name(...)`."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Every call of `name` (a function or a method) inside `node`."""
    return [call for call in ast.walk(node) if isinstance(call, ast.Call) and _called_name(call) == name]


def _keywords(call: ast.Call) -> set[str]:
    return {keyword.arg for keyword in call.keywords}


ASSISTED_DECODING = ast.parse(textwrap.dedent(inspect.getsource(GenerationMixin._assisted_decoding)))


def test_transformers_version_is_inside_the_pinned_range():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "transformers"]
    assert pin.specifier.contains(transformers.__version__), f"transformers {transformers.__version__} vs {pin}"
    first, last = TESTED_RANGE  # the range the runtime warns outside of is the pin
    major, minor = map(int, last.split("."))
    assert str(pin.specifier) == ",".join(sorted([f"<{major}.{minor + 1}", f">={first}.0"]))


def test_generate_signature_has_what_the_wrapper_binds():
    original = GenerationMixin.generate.__wrapped__  # the integration wraps generate once
    parameters = inspect.signature(original).parameters
    assert {"inputs", "generation_config", "assistant_model", "kwargs"} <= set(parameters)
    assert parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    assert inspect.signature(GenerationMixin.generate) == inspect.signature(original)


def test_cache_argument_is_the_installed_versions():
    """5.24 renamed the cache argument and output field to `cache`; the runtime passes whichever this version takes."""
    expected = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"
    assert transformers_compat.CACHE_ARGUMENT == expected
    for function in (GenerationMixin.prepare_inputs_for_generation, create_sliding_window_causal_mask):
        assert expected in inspect.signature(function).parameters
    model = tiny_deepseek_v4()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the name we pass must not be a deprecated alias
        outputs = model(torch.tensor([[5, 17, 33]]), **{expected: DynamicCache(config=model.config)}, use_cache=True)
    assert isinstance(getattr(outputs, expected), DynamicCache)


def test_assisted_decoding_builds_the_candidate_generator_with_keywords_only():
    """Our per-instance factory is a plain function: it only works if every argument comes by keyword."""
    (call,) = _calls(ASSISTED_DECODING, "_get_candidate_generator")
    assert isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
    assert not call.args
    assert {"generation_config", "logits_processor"} <= _keywords(call)


def test_assisted_decoding_passes_model_outputs_when_the_generator_asks_for_them():
    branches = [
        node
        for node in ast.walk(ASSISTED_DECODING)
        if isinstance(node, ast.If) and getattr(node.test, "attr", None) == "requires_model_outputs"
    ]
    calls = [call for branch in branches for statement in branch.body for call in _calls(statement, "get_candidates")]
    assert len(calls) == 1, "expected one get_candidates call under `if candidate_generator.requires_model_outputs`"
    (call,) = calls
    assert [arg.id for arg in call.args] == ["input_ids"]
    assert _keywords(call) == {"model_kwargs", "model_outputs", "is_first_iteration", "n_last_matches"}
    ours = inspect.signature(candidate_generator.SpeculativeCandidateGenerator.get_candidates).parameters
    assert _keywords(call) <= set(ours)
    assert CandidateGenerator.requires_model_outputs is False  # the attribute our generator overrides


def test_generate_builds_the_stopping_criteria_once_with_keywords_only():
    """Our per-instance `_get_stopping_criteria` wraps the list generate() builds and hands to the decoding loop."""
    generate_source = ast.parse(textwrap.dedent(inspect.getsource(GenerationMixin.generate.__wrapped__)))
    (call,) = _calls(generate_source, "_get_stopping_criteria")
    assert isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
    assert not call.args and {"generation_config", "stopping_criteria"} <= _keywords(call)
    (check,) = [c for c in _calls(ASSISTED_DECODING, "stopping_criteria")]
    assert [arg.id for arg in check.args] == ["input_ids", "scores"]  # called once per step, after appending


def test_greedy_and_sampling_dispatch_to_the_classs_sample_with_what_the_batched_loop_takes():
    """A batched speculative call replaces the target's `_sample` for the call (`batched_decoding.py`): generate()
    must look it up on the class and call it with the prepared batch; the loop's helpers take what it passes."""
    from hf_hyperdflash.modeling.batched_decoding import BatchedSpeculativeLoop

    assert generation_utils.GENERATION_MODES_MAPPING[GenerationMode.GREEDY_SEARCH] == "_sample"
    assert generation_utils.GENERATION_MODES_MAPPING[GenerationMode.SAMPLE] == "_sample"
    generate_source = inspect.getsource(GenerationMixin.generate.__wrapped__)
    assert "getattr(type(self), GENERATION_MODES_MAPPING[generation_mode])" in generate_source
    sample = list(inspect.signature(GenerationMixin._sample).parameters)
    assert sample[:5] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]
    assert list(inspect.signature(BatchedSpeculativeLoop.__call__).parameters)[2:6] == sample[1:5]
    assert {"input_ids", "generation_config", "model_kwargs"} <= set(
        inspect.signature(GenerationMixin._prefill).parameters
    )
    assert "num_new_tokens" in inspect.signature(GenerationMixin._update_model_kwargs_for_generation).parameters
    prepare = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert {"next_sequence_length", "is_first_iteration"} <= set(prepare)


@pytest.mark.parametrize(
    ("prompt", "pad", "eos"),
    [([5, 0, 7], 0, 2), ([5, 0, 7], 0, [2, 0]), ([5, 6, 7], 0, 2), ([5, 0, 7], None, 2), ([5, 0, 7], 0, None)],
)
def test_masks_padding_is_the_rule_generate_infers_a_mask_by(prompt, pad, eos):
    """Without an attention mask, generate() masks a prompt's padding tokens unless padding is an end-of-sequence
    token (or there is no padding token); `integration.masks_padding` must say when it does."""
    model = tiny_deepseek_v4()
    config, _ = model._prepare_generation_config(None, pad_token_id=pad, eos_token_id=eos)
    input_ids = torch.tensor([prompt])
    prepared = copy.deepcopy(config)
    model._prepare_special_tokens(prepared, kwargs_has_attention_mask=False, device=input_ids.device)
    mask = model._prepare_attention_mask_for_generation(input_ids, prepared, {})
    assert integration.masks_padding(input_ids, config) == (not bool(mask.all()))


def test_assisted_decoding_reports_matches_to_the_generator():
    """`last_generation_stats` counts accepted drafts reported by `update_candidate_strategy`."""
    (call,) = _calls(ASSISTED_DECODING, "update_candidate_strategy")
    assert [arg.id for arg in call.args] == ["input_ids", "new_logits", "n_matches"]


@pytest.mark.skipif(not STATEFUL_GUARD, reason="from 5.25 the cache says whether it rolls back")
def test_stateful_guard_is_checked_on_the_instance():
    """We lift the guard for one call and one instance through a descriptor on the class that defines
    `_is_stateful` (`call_scope.lifted_stateful_guard`), so generate() must read it from the instance."""
    assert "self._is_stateful" in inspect.getsource(GenerationMixin._validate_generation_mode)
    assert "_is_stateful" in vars(DeepseekV4PreTrainedModel) and DeepseekV4PreTrainedModel._is_stateful is True


@pytest.mark.skipif(STATEFUL_GUARD, reason="before 5.25 the model's `_is_stateful` guards assisted decoding")
def test_assisted_decoding_checks_the_cache_is_croppable():
    """From 5.25 assisted decoding runs when the cache after the prefill is croppable: the rewindable V4 cache says so
    (its layers' stock classes do not), and so does plain decoding's on the families transformers rolls back."""
    assert "outputs.cache.is_croppable" in inspect.getsource(GenerationMixin._assisted_decoding)
    assert not hasattr(DeepseekV4PreTrainedModel, "_is_stateful")
    model = tiny_deepseek_v4()
    stock = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(3, 19)[None], **{transformers_compat.CACHE_ARGUMENT: stock})
    assert not stock.is_croppable
    from hf_hyperdflash.modeling.cache_deepseek_v4 import RewindableDeepseekV4Cache

    assert RewindableDeepseekV4Cache(model.config, max_draft=4).is_croppable


@pytest.mark.skipif(not STOCK_LINEAR_ATTENTION_ROLLBACK, reason="before 5.25 `cache_linear_attention.py` rolls back")
@pytest.mark.parametrize("keep_one_more", [False, True])
def test_linear_attention_layers_restore_the_recorded_state_n_back(keep_one_more):
    """5.25's `crop(-n)` after a forward of `n + 1` tokens restores the state after its first token only when `n + 1`
    states were recorded; with `n` (what assisted decoding asks for a draft of `n`) it restores the state before the
    forward. `LinearAttentionTarget.keep_states_for_draft` relies on both halves: the day transformers fixes its
    count, the first case fails here and the extra state can go."""
    model = tiny_glm5_next()
    prompt, block = torch.arange(3, 12)[None], torch.tensor([[40, 41, 42, 43]])
    argument = transformers_compat.CACHE_ARGUMENT

    def recurrent_states(cache):
        return [layer.recurrent_states[0].clone() for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]

    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model(prompt, **{argument: reference})
        model(block[:, :1], **{argument: reference})
        cache = DynamicCache(config=model.config)
        model(prompt, **{argument: cache})
        cache.activate_past_recording(recurrent_states_to_keep=block.shape[1] - 1 + keep_one_more)
        model(block, **{argument: cache})
        cache.crop(-(block.shape[1] - 1))
    pairs = zip(recurrent_states(cache), recurrent_states(reference), strict=True)
    restored = all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)
    assert restored == keep_one_more


def test_pipelines_load_a_named_assistant_through_load_assistant_model():
    """`pipeline(..., assistant_model="<drafter folder>")` works because the library wraps this module function."""
    original = inspect.unwrap(pipeline_base.load_assistant_model)
    assert list(inspect.signature(original).parameters) == ["model", "assistant_model", "assistant_tokenizer"]
    assert "load_assistant_model(" in inspect.getsource(pipeline_base.Pipeline.__init__)
    assert pipeline_base.load_assistant_model._loads_hyperdflash_drafters  # installed with the library


def test_relative_import_files_follows_the_entry_modules_imports():
    """Saving a drafter copies `drafting.py` and what it imports (`remote_code.py`), listed by this function."""
    entry = Path(hf_hyperdflash.modeling.__file__).with_name("drafting.py")
    names = {Path(path).name for path in get_relative_import_files(str(entry))}
    assert {"integration.py", "modeling_hyperdflash.py", "modeling_deepseek_v4_mtp.py", "call_scope.py"} <= names


def test_speculative_sampling_is_a_module_function_fed_the_drafters_logits():
    """Sampled drafts are verified against the `candidate_logits` our generator returns (the drafter's processed q);
    tests/test_sampling.py patches the module-level name to prove its chi-square test has power."""
    parameters = list(inspect.signature(generation_utils._speculative_sampling).parameters)
    assert parameters[:4] == ["candidate_input_ids", "candidate_logits", "candidate_length", "new_logits"]
    (call,) = _calls(ASSISTED_DECODING, "_speculative_sampling")
    assert isinstance(call.func, ast.Name)
    assert [arg.id for arg in call.args] == parameters[:4]


def test_a_spread_model_carries_its_device_mesh_and_sampled_verdicts_come_back_as_tokens_and_a_count():
    """`rank_agreement`: a model transformers spreads gets `_device_mesh` (None otherwise), and
    `_speculative_sampling` returns `(valid_tokens, n_matches)`, which the assisted loop unpacks."""
    from transformers.distributed.mixin import DistributedMixin

    assert DistributedMixin._device_mesh is None
    assert "model._device_mesh = " in inspect.getsource(DistributedMixin.maybe_distribute_model)
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    assert "valid_tokens, n_matches = _speculative_sampling(" in source
    # `agreed_steps.agree_on_drafts` hands every sampled step to `_speculative_sampling` by giving it drafter logits
    assert "if do_sample and candidate_logits is not None:" in source


def test_prepare_generation_config_returns_the_merged_config_and_model_kwargs():
    model = tiny_deepseek_v4()
    parameters = inspect.signature(model._prepare_generation_config).parameters
    assert list(parameters)[0] == "generation_config" and parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    generation_config, model_kwargs = model._prepare_generation_config(None, num_beams=3, attention_mask="mask")
    assert isinstance(generation_config, GenerationConfig)
    assert generation_config.num_beams == 3 and model_kwargs == {"attention_mask": "mask"}
    assert model.generation_config.num_beams != 3  # a copy: the model's own config is untouched


def test_hc_head_collapses_the_pre_collapse_residual():
    model = tiny_deepseek_v4()
    config = model.config
    hc_head = model.model.hc_head
    assert isinstance(hc_head, DeepseekV4HyperHead)
    shapes = {name: tuple(p.shape) for name, p in hc_head.named_parameters()}
    assert shapes == {
        "hc_fn": (config.hc_mult, config.hc_mult * config.hidden_size),
        "hc_base": (config.hc_mult,),
        "hc_scale": (1,),
    }
    captured = []
    handle = hc_head.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([[5, 17, 33, 9, 250]])).logits
    finally:
        handle.remove()
    (residual,) = captured
    assert residual.shape == (1, 5, config.hc_mult, config.hidden_size)
    with torch.no_grad():  # the residual is all the model still needs: collapse, final norm, lm_head
        recomputed = model.lm_head(model.model.norm(hc_head(residual)))
    torch.testing.assert_close(recomputed, logits)


@pytest.mark.parametrize("name", ["crop", "activate_past_recording"])
def test_assisted_decoding_rewinds_through_the_cache_api(name):
    """The rewindable cache implements exactly these; transformers must still call them."""
    assert _calls(ASSISTED_DECODING, name)


def test_indexers_select_entries_only_with_topk():
    """`indexer_ties` replaces the `topk` an indexer's forward calls; that covers its selection only while nothing
    else in the forward picks entries (a version that sorted or arg-maxed the scores must fail here)."""
    for indexer in INDEXER_CLASSES:
        called = _selecting_calls(indexer, indexer.forward.__wrapped__)
        assert called is not None, f"{indexer.__name__}.forward no longer selects with topk"
        assert not called & {"sort", "argsort", "argmax", "kthvalue", "multinomial"}, indexer.__name__
        assert getattr(indexer.forward, "_hyperdflash_ties_by_position", False)  # installed on import


def _selecting_calls(cls: type, method) -> set[str] | None:
    """What the function that selects entries calls: `method` if it calls `topk`, else the first method of `cls` it
    calls on `self` that does (5.25's Qwen4-Exp indexer selects in `_select_tokens`, inside the forward the tie-break
    wraps); None if none does."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    calls = [call for call in ast.walk(tree) if isinstance(call, ast.Call)]
    called = {_called_name(call) for call in calls}
    if "topk" in called:
        return called
    for call in calls:
        if isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == "self":
            helper = getattr(cls, call.func.attr, None)
            if inspect.isfunction(helper) and (found := _selecting_calls(cls, helper)) is not None:
                return found
    return None


def test_deepseek_v4_indexer_uses_its_scores_only_to_mask_and_select():
    """`indexer_ties` makes V4's indexer scorer return ranks: the same selection only while the indexer's forward
    uses what its scorer returns for nothing but masking it and its top-k (a version that also weighted the selected
    entries by score must fail here)."""
    forward = ast.parse(textwrap.dedent(inspect.getsource(DeepseekV4Indexer.forward)))
    (scores,) = [
        node.targets[0].id
        for node in ast.walk(forward)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _called_name(node.value) == "scorer"
    ]
    parents = {child: node for node in ast.walk(forward) for child in ast.iter_child_nodes(node)}
    uses = [node for node in ast.walk(forward) if isinstance(node, ast.Name) and node.id == scores]
    reads = [use for use in uses if isinstance(use.ctx, ast.Load)]
    assert reads
    for use in reads:
        attribute = parents[use]
        assert isinstance(attribute, ast.Attribute) and attribute.attr in {"topk", "masked_fill", "device"}, attribute
        if attribute.attr == "masked_fill":  # the masked scores replace the scores
            assignment = parents[parents[attribute]]
            assert isinstance(assignment, ast.Assign) and assignment.targets[0].id == scores
    for scorer in SCORER_CLASSES:
        assert getattr(scorer.forward, "_hyperdflash_ties_by_position", False)  # installed on import


def test_attention_calls_its_compressor_with_positional_arguments():
    """`compressed_visibility` reads (hidden_states, q_residual, position_ids, cache, layer_idx) from the args."""
    forward = ast.parse(textwrap.dedent(inspect.getsource(DeepseekV4Attention.forward)))
    (call,) = _calls(forward, "compressor")
    names = [getattr(arg, "id", None) for arg in call.args[:4]]
    assert names == ["hidden_states", "q_residual", "position_ids", transformers_compat.CACHE_ARGUMENT]
    assert len(call.args) == 5 and not call.keywords


def test_one_token_hca_forward_sees_every_compressed_entry_and_longer_ones_mask_by_position():
    """The two HCA behaviours `compressed_visibility` reconciles in verify forwards when position ids lag."""
    model = tiny_deepseek_v4(seed=0)
    layer_idx = model.config.layer_types.index("heavily_compressed_attention")
    compressor = model.model.layers[layer_idx].self_attn.compressor
    assert isinstance(compressor, DeepseekV4HCACompressor)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(3, 19)[None], **{transformers_compat.CACHE_ARGUMENT: cache})  # 16 tokens: 2 HCA entries
        hidden = torch.randn(1, 1, model.config.hidden_size)
        q_residual = torch.randn(1, 1, model.config.q_lora_rank)
        _, one_token_bias = compressor(hidden, q_residual, torch.tensor([[3]]), cache, layer_idx)
        lagging = torch.tensor([[4, 5]])  # positions 4, 5: before the first HCA window closes
        kv, bias = compressor(hidden.expand(1, 2, -1), q_residual.expand(1, 2, -1), lagging, cache, layer_idx)
    assert one_token_bias is None and kv.shape[2] == 2
    assert (bias == float("-inf")).all()  # exact: a mask filled with -inf, not computed


def test_assisted_decoding_splits_attentions_with_the_decoder_attention_flag():
    """`output_split.split_per_token` tells attentions from hidden states by `is_decoder_attention`."""
    calls = _calls(ASSISTED_DECODING, "_split_model_outputs")
    attention_calls = [call for call in calls if "is_decoder_attention" in _keywords(call)]
    assert attention_calls and all(len(call.args) == 4 for call in calls)
    # 5.25 adds `input_shape`, which `output_split` takes and leaves: the sequence axis is 1 in every family here
    assert all(_keywords(call) <= {"is_decoder_attention", "input_shape"} for call in calls)
    assert any(getattr(call.args[1], "attr", None) == "attentions" for call in attention_calls)


@pytest.mark.skipif(STOCK_LINEAR_ATTENTION_ROLLBACK, reason="from 5.25 transformers rolls these layers back itself")
@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp_text"])
def test_linear_attention_forwards_call_their_kernels_by_module_name(family):
    """`cache_linear_attention.recording_kernels` swaps the family's delta-rule kernels as module functions for one
    call, and replays them with the recorded inputs: the forward must look them up by name, with these inputs."""
    from hf_hyperdflash.modeling.targets import TARGET_FAMILIES

    adapter = TARGET_FAMILIES[family]
    module = adapter.kernel_module
    forward_class = next(
        cls for name, cls in vars(module).items() if name.endswith(("LinearAttention", "GatedDeltaNet"))
    )
    forward = ast.parse(textwrap.dedent(inspect.getsource(forward_class.forward)))
    for name in adapter.kernel_names:
        assert _calls(forward, name), f"{forward_class.__name__}.forward no longer calls {name}"
        parameters = inspect.signature(getattr(module, name)).parameters
        assert {"query", "key", "value", "g", "beta", "initial_state", "output_final_state"} <= set(parameters)
    assert _calls(forward, "update_recurrent_state")  # where the rewindable layer closes a forward
