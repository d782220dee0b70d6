"""One rank of `tests/test_rank_faults.py`, launched by `torchrun`: a tiny DeepSeek-V4 target (and the shipped
reference target, whose drafter drafts what it accepts) spread by its TP plan over 2 processes (gloo), and per-rank
differences injected after the shared state, for one prompt (transformers' assisted loop) and a left-padded batch
of two (the batched loop).

    torchrun --nproc_per_node 2 tests/distributed_faults.py MODELS_DIR OUT_DIR

Writes OUT_DIR/rank-N.json: per case and layout, the tokens each call returned or the error it raised, and how many
seconds it took. A collective waits at most `TIMEOUT_S` (the process group's timeout), so a case that parts the
ranks ends in an error instead of a hang.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModel

from hf_hyperdflash import reference
from hf_hyperdflash.distributed import init_processes, load_spread_target

TIMEOUT_S = 60
PROMPT = torch.tensor([[5, 17, 33, 9, 250, 11, 12, 40, 77, 3, 19, 23, 8, 101, 44, 6, 5, 17, 33, 9]])
LAYOUTS = {
    "one prompt": {"input_ids": PROMPT},
    "batch": {
        "input_ids": torch.cat([PROMPT, torch.cat([torch.zeros(1, 8, dtype=torch.long), PROMPT[:, 8:]], dim=1)]),
        "attention_mask": torch.cat([torch.ones(1, 20, dtype=torch.long), (torch.arange(20) >= 8).long()[None]]),
        "pad_token_id": 0,
    },
}
GREEDY = {"max_new_tokens": 16, "do_sample": False}
SAMPLING = {"max_new_tokens": 16, "do_sample": True}
FAULT_AT = 3  # the drafter forward that fails on rank 1
MAX_TIME_TOKENS = 64  # more than `max_time` leaves room for
SLOW_AT = 3  # the target forward after which rank 1 is slower


def outcome(call, drafter=None) -> dict:
    """The call's tokens or error and its seconds; with `drafter`, the stats it left there."""
    start = time.perf_counter()
    try:
        tokens = call().tolist()
    except Exception as error:  # recorded for the test to assert on
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - start}
    result = {"tokens": tokens, "seconds": time.perf_counter() - start}
    if drafter is not None:
        stats = drafter.last_generation_stats
        result["stats"] = [stats.accepted_per_step, stats.proposed_per_step, stats.skipped_steps]
    return result


class OnRankOne:
    """A hook on `module` that runs only on rank 1, removed on leaving."""

    def __init__(self, module, hook, pre: bool = False):
        self.module, self.hook, self.pre = module, hook, pre

    def __enter__(self):
        if dist.get_rank() == 1:
            register = self.module.register_forward_pre_hook if self.pre else self.module.register_forward_hook
            self.handle = register(self.hook)
        return self

    def __exit__(self, *exc):
        if dist.get_rank() == 1:
            self.handle.remove()


def draw(*_) -> None:
    torch.rand(1)


def run_layout(target, drafter, inputs: dict) -> dict[str, dict]:
    """Every case on `inputs` (one prompt, or a batch), in order: {case: outcome}."""
    rank = dist.get_rank()
    outcomes = {}

    def record(case: str, call) -> None:
        outcomes[case] = outcome(call)

    def generate(**options):
        return target.generate(**inputs, **options)

    record("plain", lambda: generate(**GREEDY))
    record("greedy", lambda: generate(**GREEDY, assistant_model=drafter))
    last_forward = drafter.last_generation_stats.target_forwards

    # Rank 1's target picks another token at the call's last forward only: the last step's verdict differs there
    forwards = []

    def other_last_token(module, inputs, output):
        forwards.append(1)
        if len(forwards) == last_forward:
            output.logits[..., 1] += 1e4
        return output

    with OnRankOne(target, other_last_token):
        record("verdict differs at the last step", lambda: generate(**GREEDY, assistant_model=drafter))

    # Rank 1's random stream moves on at every target forward, mid-call
    torch.manual_seed(7)
    record("sampled", lambda: generate(**SAMPLING, assistant_model=drafter))
    torch.manual_seed(7)
    with OnRankOne(target, draw):
        record("random stream moves on", lambda: generate(**SAMPLING, assistant_model=drafter))

    # Rank 1's drafter is set to draft another length
    length = drafter.generation_config.num_assistant_tokens
    if rank == 1:
        drafter.generation_config.num_assistant_tokens = 2
    record("drafter length", lambda: generate(**GREEDY, assistant_model=drafter))
    drafter.generation_config.num_assistant_tokens = length

    # Rank 1's drafter raises at its FAULT_AT-th forward
    calls = []

    def fault(module, inputs):
        calls.append(1)
        if len(calls) == FAULT_AT:
            raise IndexError("injected drafter fault")

    with OnRankOne(drafter, fault, pre=True):
        record("drafter fault", lambda: generate(**GREEDY, assistant_model=drafter))

    # Rank 1 is slower: after its SLOW_AT-th target forward it takes a second more than rank 0 to reach the stopping
    # check, so under `max_time` its clock runs out a step before rank 0's
    forwards = []

    def slow(*_):
        forwards.append(1)
        if len(forwards) == SLOW_AT:
            time.sleep(1.0)

    with OnRankOne(target, slow):
        options = {"max_new_tokens": MAX_TIME_TOKENS, "do_sample": False, "max_time": 0.8}
        record("slower rank under max_time", lambda: generate(**options, assistant_model=drafter))

    record("decodes after", lambda: generate(**GREEDY, assistant_model=drafter))
    return outcomes


def drafts_differ(target, drafter, inputs: dict) -> dict[str, dict]:
    """A trained drafter (the shipped pair, whose drafts the target accepts) drafts otherwise on rank 1 from its
    second forward on, mid-call: its hidden states are reversed, and with them its confidences."""
    forwards = []

    def reversed_states(module, inputs, output):
        forwards.append(1)
        if len(forwards) >= 2:
            output.last_hidden_state = output.last_hidden_state.flip(-1)
            output.residual = output.residual.flip(-1)
        return output

    plain = outcome(lambda: target.generate(**inputs, **GREEDY))
    with OnRankOne(drafter, reversed_states):
        differ = outcome(lambda: target.generate(**inputs, **GREEDY, assistant_model=drafter), drafter)
    return {"plain, shipped pair": plain, "drafts differ, shipped pair": differ}


def main(models: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    init_processes(TIMEOUT_S)
    target = load_spread_target(models / "target", "tp")
    drafter = AutoModel.from_pretrained(models / "hyperdflash", trust_remote_code=True).eval()
    rank = dist.get_rank()
    result = {"rank": rank, "cases": {}}
    shipped_target = load_spread_target(reference.target_path(), "tp")
    shipped_drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), trust_remote_code=True).eval()
    for layout, inputs in LAYOUTS.items():
        outcomes = run_layout(target, drafter, inputs) | drafts_differ(shipped_target, shipped_drafter, inputs)
        for case, case_outcome in outcomes.items():
            result["cases"].setdefault(case, {})[layout] = case_outcome
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
