"""Steps that verify a chain copied from the context (`context_copy.py`): the index, the chooser, and exact decoding
with copied chains on every family and drafter kind, one row and batches."""

import random

import pytest
import torch
from test_batched import CASES, PAD, built_targets, drafter_for, left_padded_batch, speculative  # noqa: F401
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_hyperdflash  # noqa: F401  (installs the generate() integration)
from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.datasets import load_prompt_set
from hf_hyperdflash.modeling.context_copy import LONGEST_SUFFIX, ChainChooser, SuffixIndex
from hf_hyperdflash.modeling.draft_policy import DraftCosts
from hf_hyperdflash.testing import new_drafter, scripted_copying

pytestmark = pytest.mark.compat  # runs generate()'s own preparation with its internals: `pytest -m compat`


def brute_force_continuation(tokens: list[int], length: int) -> tuple[list[int], int]:
    """What `SuffixIndex.continuation` must return, found by scanning every earlier position."""
    for n in range(min(LONGEST_SUFFIX, len(tokens)), 0, -1):
        for end in range(len(tokens) - 1, n - 1, -1):  # `end`: just after an earlier occurrence of the suffix
            if tokens[end - n : end] == tokens[-n:]:
                chain = tokens[end : end + length]
                while len(chain) < length:
                    chain.append(chain[len(chain) - (len(tokens) - end)])
                return chain, n
    return [], 0


def test_the_index_finds_the_most_recent_occurrence_of_the_longest_suffix():
    index = SuffixIndex()
    index.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert index.continuation(3) == ([9, 2, 6], 2)  # "6 7" last occurred before 9, not before 8
    index.extend([9])
    assert index.continuation(2) == ([2, 6], 3)  # now "6 7 9" matches, the longest suffix
    index.extend([4])
    assert index.continuation(2) == ([], 0)  # 4 never occurred before


def test_a_copy_that_reaches_the_end_repeats_the_stretch_it_copied():
    index = SuffixIndex()
    index.extend([1, 2, 3, 1, 2])
    assert index.continuation(6) == ([3, 1, 2, 3, 1, 2], 2)


def test_the_index_updated_step_by_step_matches_a_scan_of_every_position():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        index, fed = SuffixIndex(), 0
        while fed < len(tokens):
            step = rng.randrange(1, 5)
            index.extend(tokens[fed : fed + step])
            fed += step
            assert index.continuation(5) == brute_force_continuation(tokens[:fed], 5), tokens[:fed]


def test_the_chooser_copies_what_the_context_keeps_winning_and_stops_when_it_fails():
    chooser = ChainChooser(7, DraftCosts(draft_cost=0.5, verify_cost=0.1).step)
    assert chooser.copies_first(7, 3, 7) == 0  # a drafter not yet seen is tried first
    for _ in range(20):  # the drafter gets one token a step; the copy would have got all seven
        chooser.learn_drafter(0.3, [9] * 7, [1])
        chooser.learn_copy([1, 2, 3, 4, 5, 6, 7], 3, [1, 2, 3, 4, 5, 6, 7, 8])
    assert chooser.copies_first(7, 3, 7) == 7
    assert chooser.copy_acceptance(1, 2) == [0.5, 0.5]  # kept per length of the matched suffix: this one unseen
    for _ in range(40):  # now the copy misses its first token and the drafter gets all seven
        chooser.learn_copy([1, 2, 3], 3, [4])
        chooser.learn_drafter(0.9, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8])
    assert chooser.copies_first(7, 3, 7) == 0


def test_after_the_drafter_ran_its_first_confidence_decides():
    chooser = ChainChooser(7, DraftCosts(draft_cost=0.5, verify_cost=0.1).step)
    for _ in range(30):  # confident drafts are accepted far, unsure ones not at all; the copy wins three
        chooser.learn_drafter(0.95, [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8])
        chooser.learn_drafter(0.05, [9] * 7, [1])
        chooser.learn_copy([1, 2, 3, 9], 2, [1, 2, 3, 4])
    assert chooser.copies_after(0.95, 7, 4, 2) == 0
    assert chooser.copies_after(0.05, 7, 4, 2) > 0


@pytest.fixture(scope="module")
def reference_pair():
    """The shipped target and HyperDFlash drafter, in fp32."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    return tokenizer, target, drafter


def test_a_reply_that_quotes_its_prompt_is_copied_and_stays_exact(reference_pair):
    """A copy-heavy task on the shipped pair: some steps verify the context's chain, and win more than one token."""
    tokenizer, target, drafter = reference_pair
    chat = load_prompt_set("copyedit", limit=2, max_chars=1500)[1]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**prompt, max_new_tokens=64, do_sample=False)
    assert torch.equal(target.generate(**prompt, assistant_model=drafter, max_new_tokens=64), plain)
    stats = drafter.last_generation_stats
    assert stats.copied_steps > 0 and stats.source_tau("context") > 2
    assert len(stats.accepted_by_source["drafter"]) + stats.copied_steps == len(stats.accepted_per_step)
    drafter.generation_config.draft_from_context = False
    try:
        assert torch.equal(target.generate(**prompt, assistant_model=drafter, max_new_tokens=64), plain)
    finally:
        drafter.generation_config.draft_from_context = None
    assert drafter.last_generation_stats.copied_steps == 0


def test_a_switch_that_is_not_a_bool_is_refused(target):
    drafter = new_drafter(target, "hyperdflash")
    drafter.generation_config.draft_from_context = "no"
    with pytest.raises(ValueError, match="draft_from_context"):
        target.generate(torch.tensor([[3, 4, 5]]), assistant_model=drafter, max_new_tokens=4)


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_copied_chains_are_exact_on_every_family_and_drafter_kind(targets, family, kind):
    """One row and a left-padded batch, each step copying or drafting by `scripted_copying`'s rotation."""
    target = targets(family)
    vocab = target.config.get_text_config().vocab_size
    greedy = {"max_new_tokens": 24, "do_sample": False}
    inputs = left_padded_batch(vocab)
    one_row = {"input_ids": inputs["input_ids"][1:2]}
    for batch in (one_row, inputs):
        expected = target.generate(**batch, pad_token_id=PAD, **greedy)
        drafter = drafter_for(target, kind)
        with scripted_copying():
            got = speculative(target, kind, drafter, expected, batch, **greedy)
        assert torch.equal(got, expected)
        stats = drafter.last_generation_stats
        assert stats.copied_steps > 0 and stats.accepted_by_source["drafter"]


@pytest.mark.parametrize("kind", ["hyperdflash_heads", "dspark"])
def test_a_drafter_whose_heads_cut_its_whole_block_leaves_the_choice_to_the_copy(targets, kind):
    """A confidence head that gives nothing a chance cuts the block before its first draft under the default
    schedule: the step then weighs the copy against the bonus token alone, one row and a batch."""
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    greedy = {"max_new_tokens": 24, "do_sample": False}
    for batch in ({"input_ids": inputs["input_ids"][1:2]}, inputs):
        expected = target.generate(**batch, pad_token_id=PAD, **greedy)
        drafter = new_drafter(target, kind)
        drafter.confidence = lambda residual, markov_embedding: residual.new_zeros(residual.shape[:-1]).float()
        with scripted_copying(choose=False):  # a chain at every step; the call's own chooser takes it or not
            got = target.generate(**batch, assistant_model=drafter, pad_token_id=PAD, **greedy)
        assert torch.equal(got, expected)
        assert drafter.last_generation_stats.copied_steps > 0


def test_a_seeded_sampled_call_with_copied_chains_repeats(targets):
    """The chooser decides from the tokens alone, so a seeded call copies at the same steps and samples the same."""
    target = targets("deepseek_v4")
    inputs = left_padded_batch(target.config.vocab_size)
    sampled = {"max_new_tokens": 24, "do_sample": True, "temperature": 1.5}
    for batch in ({"input_ids": inputs["input_ids"][1:2]}, inputs):
        drafter = new_drafter(target, "hyperdflash")
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            with scripted_copying(choose=False):  # the call's own chooser, with a chain at every step
                runs.append(target.generate(**batch, assistant_model=drafter, pad_token_id=PAD, **sampled))
            runs.append(drafter.last_generation_stats.accepted_by_source)
        assert torch.equal(runs[0], runs[2]) and runs[1] == runs[3]
        assert runs[1]["context"], "no step verified a copied chain"
