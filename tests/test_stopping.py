"""Stopping criteria inside an accepted block: a speculative call stops on the very token plain decoding stops on.

An oracle drafter that is almost always right makes each verify step accept several tokens, so every stop below
falls inside a block, where transformers' own assisted loop would overshoot (it crops only for EOS and max_length).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_hyperdflash import HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling.transformers_compat import CACHE_ARGUMENT
from hf_hyperdflash.testing import OracleProposer, oracle_drafting

VOCAB = 512
PROMPT = torch.tensor([[5, 17, 33, 9, 250, 12, 77, 401, 3, 64, 128]])


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    return HyperDFlashForDrafting.from_target(target, block_size=8).eval()


@pytest.fixture(scope="module")
def plain(target):
    """The target's unstopped greedy continuation, which the oracle drafts from."""
    return target.generate(PROMPT, max_new_tokens=40, do_sample=False)


class StopAfter(StoppingCriteria):
    """Stops once `count` new tokens exist, and counts its calls (one per token in plain decoding)."""

    def __init__(self, count: int):
        self.count, self.calls = count, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT.shape[1] + self.count)


class StopOnToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class Recorder(BaseStreamer):
    def __init__(self):
        self.tokens: list[int] = []

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.tokens.append(-1)


def both(target, drafter, plain, **kwargs):
    """(plain, speculative) generate results with the same kwargs; the drafter is an oracle for `plain`."""
    expected = target.generate(PROMPT, max_new_tokens=40, do_sample=False, **kwargs)
    with oracle_drafting(OracleProposer(VOCAB, plain, corruption=0.0, seed=0)):
        got = target.generate(PROMPT, max_new_tokens=40, do_sample=False, assistant_model=drafter, **kwargs)
    return expected, got


@pytest.mark.parametrize("count", [1, 5, 9, 13])
def test_length_criterion_stops_inside_a_block(target, drafter, plain, count):
    expected, got = both(target, drafter, plain, stopping_criteria=StoppingCriteriaList([StopAfter(count)]))
    assert expected.shape[1] == PROMPT.shape[1] + count
    assert torch.equal(got, expected)
    assert max(drafter.last_generation_stats.accepted_per_step, default=0) >= 2 or count == 1
    assert drafter.last_generation_stats.new_tokens == count


def test_token_criterion_stops_on_the_same_token(target, drafter, plain):
    stop_token = int(plain[0, PROMPT.shape[1] + 10])
    expected, got = both(target, drafter, plain, stopping_criteria=StoppingCriteriaList([StopOnToken(stop_token)]))
    assert expected.shape[1] < plain.shape[1] and int(expected[0, -1]) == stop_token
    assert torch.equal(got, expected)


def test_criteria_are_called_once_per_token_as_in_plain_decoding(target, drafter, plain):
    plain_criterion, speculative_criterion = StopAfter(12), StopAfter(12)
    target.generate(PROMPT, max_new_tokens=40, stopping_criteria=StoppingCriteriaList([plain_criterion]))
    with oracle_drafting(OracleProposer(VOCAB, plain, corruption=0.0, seed=0)):
        target.generate(
            PROMPT,
            max_new_tokens=40,
            assistant_model=drafter,
            stopping_criteria=StoppingCriteriaList([speculative_criterion]),
        )
    assert speculative_criterion.calls == plain_criterion.calls == 12


def test_stop_strings_streamer_scores_and_cache_match_plain_decoding():
    """With the shipped byte-level tokenizer and target (stop strings need a tokenizer that decodes real text)."""
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    torch.manual_seed(1)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    messages = [{"role": "user", "content": "How do I make a good cup of coffee at home?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = prompt["input_ids"]
    full = target.generate(prompt, max_new_tokens=40, do_sample=False)
    stop = tokenizer.decode(full[0, prompt.shape[1] + 9]).strip()
    assert stop
    streams = [Recorder(), Recorder()]
    options = {"stop_strings": [stop], "tokenizer": tokenizer, "return_dict_in_generate": True, "output_scores": True}
    expected = target.generate(prompt, max_new_tokens=40, do_sample=False, streamer=streams[0], **options)
    with oracle_drafting(OracleProposer(len(tokenizer), full, corruption=0.0, seed=0)):
        got = target.generate(
            prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter, streamer=streams[1], **options
        )
    assert expected.sequences.shape[1] <= prompt.shape[1] + 10
    assert torch.equal(got.sequences, expected.sequences)
    assert max(drafter.last_generation_stats.accepted_per_step) >= 2
    assert streams[1].tokens == streams[0].tokens  # nothing past the stop reached the streamer
    assert len(got.scores) == len(expected.scores)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert getattr(got, CACHE_ARGUMENT).get_seq_length() == got.sequences.shape[1] - 1
