"""What keeps the ranks of a spread target in step (`modeling/rank_agreement.py`), in one process: the fingerprints,
and the agreement over a real single-rank gloo group with a second rank's contribution brought in as the collective
would bring it. Real launches over 2 processes: `tests/test_distributed.py` and `tests/test_rank_faults.py` (slow)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from hf_hyperdflash import HyperDFlashForDrafting, reference
from hf_hyperdflash.modeling import rank_agreement
from hf_hyperdflash.modeling.rank_agreement import RankAgreement

REAL_ALL_REDUCE = dist.all_reduce


def test_a_weight_changed_anywhere_changes_the_drafters_fingerprint(target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    before = rank_agreement.weights_fingerprint(drafter)
    assert rank_agreement.weights_fingerprint(drafter) == before
    with torch.no_grad():
        list(drafter.parameters())[-1].view(-1)[3] += 1e-4
    assert rank_agreement.weights_fingerprint(drafter) != before


def test_an_input_fingerprint_sees_values_shape_and_dtype():
    prompt = torch.tensor([[5, 6, 7]])
    fingerprint = rank_agreement.tensor_fingerprint
    assert fingerprint(prompt) != fingerprint(prompt.flip(-1))
    assert fingerprint(prompt) != fingerprint(prompt[:, :2])
    pixels = torch.rand(1, 3, 4, 4)
    assert fingerprint(pixels.bfloat16()) != fingerprint(pixels.half())  # dtypes numpy cannot hold are read as bytes


def test_in_one_process_the_agreement_only_runs_what_it_is_given(target):
    agreement = RankAgreement.of(target)
    assert not agreement.spread and agreement.decides

    def no_fingerprints():
        raise AssertionError("one process computes no fingerprint")

    assert agreement.open_call(lambda: "plan", no_fingerprints) == "plan"
    assert torch.equal(agreement.decide("Drafting", lambda: torch.tensor([3, 4]), 2), torch.tensor([3, 4]))
    assert agreement.collectives == 0


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def with_second_rank(monkeypatch, gathered: object = None, reduced: torch.Tensor | None = None) -> None:
    """Make the collectives see a second rank: `gathered` is what it contributes to `all_gather_object`, `reduced`
    its packet in an all-reduce."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def gather(into, mine, group=None):
        into[:] = [mine, gathered]

    def reduce(packet, op=None, group=None):
        REAL_ALL_REDUCE(packet, op=op, group=group)
        packet.copy_(torch.maximum(packet, reduced))

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "all_reduce", reduce)


def test_the_opening_check_names_what_the_ranks_disagree_on(one_rank_group, monkeypatch):
    agreement = RankAgreement(one_rank_group)
    mine = {"prompts": "a", "drafter settings": "b"}
    assert agreement.open_call(lambda: 7, lambda: mine) == 7  # one rank agrees with itself
    with_second_rank(monkeypatch, gathered=(None, {**mine, "drafter settings": "c"}, None))
    with pytest.raises(ValueError, match="different drafter settings: every rank must"):
        agreement.open_call(lambda: 7, lambda: mine)


def test_a_check_failing_on_another_rank_raises_here_too(one_rank_group, monkeypatch):
    with_second_rank(monkeypatch, gathered=((1, "ValueError", "a bad option"), {}, None))
    with pytest.raises(RuntimeError, match="rank 1: ValueError: a bad option"):
        RankAgreement(one_rank_group).open_call(lambda: 7, dict)


def test_a_decision_is_rank_zeros_and_a_failure_or_parted_tokens_anywhere_stop_every_rank(one_rank_group, monkeypatch):
    agreement = RankAgreement(one_rank_group)
    state = torch.tensor([10, 99])
    decided = agreement.decide("Drafting", lambda: torch.tensor([2, 5, 6]), 3, state=state)
    assert decided.tolist() == [2, 5, 6] and agreement.collectives == 1

    lowest = torch.iinfo(torch.int64).min
    other = torch.tensor([0, 10, 99, -10, -99, lowest, lowest, lowest])  # rank 1 agrees; its values are not rank 0's
    with_second_rank(monkeypatch, reduced=other)
    assert agreement.decide("Drafting", lambda: torch.tensor([2, 5, 6]), 3, state=state).tolist() == [2, 5, 6]

    with_second_rank(monkeypatch, gathered=(1, "IndexError", "drafter broke"), reduced=torch.tensor([1, *other[1:]]))
    with pytest.raises(RuntimeError, match="Drafting failed on a rank .*rank 1: IndexError: drafter broke"):
        agreement.decide("Drafting", lambda: torch.tensor([2, 5, 6]), 3, state=state)

    with_second_rank(monkeypatch, gathered=None, reduced=other)  # a decision of the wrong size sends none
    with pytest.raises(RuntimeError, match="a decision of 2 values where 3 were agreed"):
        agreement.decide("Drafting", lambda: torch.tensor([5, 6]), 3, state=state)

    parted = torch.tensor([0, 11, 99, -11, -99, lowest, lowest, lowest])  # rank 1 holds another length
    with_second_rank(monkeypatch, reduced=parted)
    with pytest.raises(RuntimeError, match="hold different tokens"):
        agreement.decide("Drafting", lambda: torch.tensor([2, 5, 6]), 3, state=state)


def test_only_criteria_that_read_the_tokens_alone_stop_every_rank_alike(target):
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

    assert rank_agreement.stops_alike([MaxLengthCriteria(10), EosTokenCriteria(0)])
    assert not rank_agreement.stops_alike([MaxLengthCriteria(10), MaxTimeCriteria(1.0)])


class StopAtLength(StoppingCriteria):
    """A custom criterion (so a spread target's stops go through the agreement) that stops at `length` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


@pytest.fixture(scope="module")
def shipped_pair():
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), trust_remote_code=True).eval()
    return target, drafter


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_agreed_path_on_a_group_of_one_decodes_as_one_process(
    shipped_pair, one_rank_group, monkeypatch, rows, sampling
):
    """The spread path (drafts, verdicts and stops through the agreement; a custom criterion stopping inside a step
    makes the stops agreed) on a one-rank group gives one process's tokens: rank 0 keeps what it would have decided
    alone, draw for draw."""
    target, drafter = shipped_pair
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": text}] for text in ("How do tides work?", "Write a haiku about bees.")]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats[:rows]]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    stop = StoppingCriteriaList([StopAtLength(inputs["input_ids"].shape[1] + 21)])
    options = {"max_new_tokens": 32, "do_sample": sampling, "stopping_criteria": stop, "assistant_model": drafter}

    def decode() -> torch.Tensor:
        torch.manual_seed(5)
        return target.generate(**inputs, **options, pad_token_id=tokenizer.pad_token_id)

    alone = decode()
    assert alone.shape[1] == inputs["input_ids"].shape[1] + 21
    monkeypatch.setattr(target, "_device_mesh", init_device_mesh("cpu", (1,)), raising=False)
    assert RankAgreement.of(target).spread
    assert torch.equal(decode(), alone)
    stats = drafter.last_generation_stats
    assert stats.rank_collectives >= (2 if sampling else 1) * stats.decoding_steps  # every step went through it
