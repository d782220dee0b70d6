"""Rows of a batch that run ahead, stop, or draft alone: each exactly what it would be elsewhere.

- A row that stops inside a step whose drafts go past its stop is plain batched decoding's row: with an
  end-of-sequence id, padding from its stop on in its tokens, every step's logits and the returned cache; without one,
  its own tokens, as plain decoding feeds it.
- A left-padded row's drafts in a batch are its drafts alone, for every drafter kind (the real proposers: positions,
  masks and anchors of batched drafting).
- Every family decodes a batch exactly with its real block drafter (no stand-in proposer), and the shipped pair keeps
  rows ahead of the batch's shortest run.
"""

import pytest
import torch
from test_batched import FAMILIES, PAD, built_targets, drafter_for, left_padded_batch, speculative  # noqa: F401
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, StoppingCriteria

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import reference
from hf_hyperdflash.modeling.batched_drafting import DraftRequest, make_drafting
from hf_hyperdflash.modeling.candidate_generator import StepSchedule, TokenPicker
from hf_hyperdflash.modeling.draft_policy import ConstantDraftPolicy
from hf_hyperdflash.modeling.targets import get_target_adapter
from hf_hyperdflash.testing import OWN_DRAFTER_KINDS, assert_same_cache

pytestmark = pytest.mark.compat

NEW_TOKENS = 16
EVERY_OUTPUT = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}


def assert_same_steps(ours, theirs, tolerance: float = 1e-4) -> None:
    """The same tokens, and per new token the same scores and raw logits (every row, padding rows included)."""
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    for name in ("scores", "logits"):
        assert len(getattr(ours, name)) == len(getattr(theirs, name)), name
        for step, (a, b) in enumerate(zip(getattr(ours, name), getattr(theirs, name), strict=True)):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance, msg=f"{name} step {step}")


def plain_and_ours(target, inputs, reference_ids, **kwargs):
    """Plain batched decoding and ours (a HyperDFlash drafter whose drafts follow `reference_ids` exactly, so they
    go on past a row's stop), every output kept."""
    expected = target.generate(**inputs, pad_token_id=PAD, **EVERY_OUTPUT, **kwargs)
    drafter = drafter_for(target, "hyperdflash")
    got = speculative(target, "hyperdflash", drafter, reference_ids, inputs, corruption=0.0, **EVERY_OUTPUT, **kwargs)
    return expected, got


@pytest.mark.parametrize("family", ["deepseek_v4", "hy_v4", "glm5_next"])
def test_a_row_that_ends_inside_a_step_is_padding_from_its_end_on(targets, family):
    target = targets(family)
    inputs = left_padded_batch(target.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    free = target.generate(**inputs, pad_token_id=PAD, **greedy)
    eos = int(free[1, -NEW_TOKENS + 2])  # row 1's third new token: it ends inside the first drafted step
    expected, got = plain_and_ours(target, inputs, free, eos_token_id=eos, **greedy)
    assert (expected.sequences[1, -NEW_TOKENS + 3 :] == PAD).all()
    assert_same_steps(got, expected)
    assert_same_cache(got.past_key_values, expected.past_key_values)


class StopRow(StoppingCriteria):
    """Stops `row` once it holds `length` tokens."""

    def __init__(self, row: int, length: int):
        self.row, self.length = row, length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] >= self.length
        return done


@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next"])
def test_a_row_stopped_without_an_end_of_sequence_id_goes_on_with_its_own_tokens(family):
    target = FAMILIES[family](0).eval()
    target.generation_config.eos_token_id = None  # a generation with no end-of-sequence id at all
    target.config.get_text_config().eos_token_id = None
    inputs = left_padded_batch(target.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    free = target.generate(**inputs, pad_token_id=PAD, **greedy)
    criteria = [StopRow(0, inputs["input_ids"].shape[1] + 3)]
    expected, got = plain_and_ours(target, inputs, free, stopping_criteria=criteria, **greedy)
    assert torch.equal(expected.sequences, free)  # the stopped row went on with its own tokens
    assert_same_steps(got, expected)
    assert_same_cache(got.past_key_values, expected.past_key_values)


def batch_features(target, drafter, inputs: dict) -> torch.Tensor:
    """The target features the drafter reads, from a forward over the (padded) batch."""
    adapter = get_target_adapter(target)
    with adapter.capture(make_drafting(drafter, adapter, [0], 1).feature_layers) as capture, torch.no_grad():
        target(**inputs)
        return capture.features()


def drafts_of(target, drafter, inputs: dict, features: torch.Tensor, num_tokens: int):
    """The drafts batched drafting gives every row of `inputs` after its prompt, from the anchor of its last token."""
    adapter = get_target_adapter(target)
    padding = (inputs["attention_mask"] == 0).sum(dim=1).tolist()
    drafting = make_drafting(drafter, adapter, padding, max_draft=num_tokens)
    width = inputs["input_ids"].shape[1]
    request = DraftRequest(
        features=features,
        first_column=0,
        anchors=[width - 1] * len(padding),
        ids=inputs["input_ids"],
        drafting=[True] * len(padding),
        num_tokens=num_tokens,
        cache_length=width - 1,
        pick=TokenPicker(LogitsProcessorList(), do_sample=False),
        schedule=StepSchedule(ConstantDraftPolicy(num_tokens), whole_blocks=True),
        pad_id=PAD,
    )
    with torch.no_grad():
        return drafting.propose(request)


@pytest.mark.parametrize("kind", OWN_DRAFTER_KINDS)
def test_a_padded_rows_drafts_in_a_batch_are_its_drafts_alone(targets, kind):
    """Given the same target features (a V4 batch's own depend on its padding, as in plain batched decoding), each
    row drafts in the batch what it drafts alone: its positions, context and anchor are its own."""
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size, lengths=(9, 30, 17))
    features = batch_features(target, drafter_for(target, kind), inputs)
    batch = drafts_of(target, drafter_for(target, kind), inputs, features, num_tokens=4)
    for row in range(3):
        real = inputs["attention_mask"][row].bool()
        alone = {name: value[row : row + 1, real] for name, value in inputs.items()}
        single = drafts_of(target, drafter_for(target, kind), alone, features[row : row + 1, real], num_tokens=4)
        n = single.lengths[0]
        assert batch.lengths[row] == n > 0
        assert torch.equal(batch.tokens[row, :n], single.tokens[0, :n]), f"row {row}"
        torch.testing.assert_close(batch.logits[row, :n], single.logits[0, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_decodes_a_batch_exactly_with_its_real_block_drafter(targets, family):
    target = targets(family)
    inputs = left_padded_batch(target.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": PAD}
    expected = target.generate(**inputs, **greedy)
    got = target.generate(**inputs, assistant_model=drafter_for(target, "hyperdflash"), **greedy)
    assert torch.equal(got, expected)


def test_rows_of_the_shipped_pair_keep_what_they_verified():
    """Real prompts, the shipped drafter, whole blocks: exact, and rows commit more per step than the batch's shared
    cache advances (its shortest accepted run), which is all a row would keep if rows were cut back to it."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path(), padding_side="left")
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    chats = [
        [{"role": "user", "content": text}]
        for text in (
            "Name three colors.",
            "Write a haiku about rain.",
            "How do I sort a list in Python?",
            "What is the capital of France?",
        )
    ]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    greedy = {"max_new_tokens": 40, "do_sample": False}
    expected = target.generate(**inputs, **greedy)
    assert torch.equal(target.generate(**inputs, assistant_model=drafter, **greedy), expected)
    stats = drafter.last_generation_stats
    assert stats.row_tau > stats.mean_accepted_length
