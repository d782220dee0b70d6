"""One rank of `tests/test_distributed.py`, launched by `torchrun`: a tiny target spread by transformers' parallel
plan, every drafter saved beside it and stock prompt lookup.

    torchrun --nproc_per_node 2 tests/distributed_rank.py MODELS_DIR FAMILY PARALLEL OUT_DIR

Writes OUT_DIR/rank-N.json: per way of drafting, whether greedy output equals the same distributed plain decoding and
the sampled tokens (each rank seeded differently: the package must make them agree), for one prompt and for a
left-padded batch of two (the package's drafters); then what two mismatched calls
raised (a drafter changed on rank 1 only, a prompt that differs on rank 1) and whether the ranks decode on afterwards.
Where plain decoding itself fails (GLM-5-Next's TP plan), the error it raised and the one each way of drafting raised.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModel

from hf_hyperdflash.distributed import PROMPT_LOOKUP, drafting_arguments, load_spread_target

PROMPT = torch.tensor([[5, 17, 33, 9, 250, 11, 12, 40, 77, 3, 19, 23, 8, 101, 44, 6, 5, 17, 33, 9]])
# Two prompts, the second left-padded: batched speculative decoding on the spread target
BATCH = {
    "input_ids": torch.cat([PROMPT, torch.cat([torch.zeros(1, 8, dtype=torch.long), PROMPT[:, 8:]], dim=1)]),
    "attention_mask": torch.cat([torch.ones(1, 20, dtype=torch.long), (torch.arange(20) >= 8).long()[None]]),
    "pad_token_id": 0,
}
GREEDY = {"max_new_tokens": 12, "do_sample": False}
SAMPLING = {"max_new_tokens": 12, "do_sample": True}


def error_of(call) -> str | None:
    try:
        call()
    except Exception as error:  # recorded for the test to assert on
        return f"{type(error).__name__}: {error}"
    return None


def main(models: Path, family: str, parallel: str, out_dir: Path) -> None:
    torch.set_num_threads(1)
    target = load_spread_target(models / family / "target", parallel)
    rank = dist.get_rank()
    ways = {path.name: path for path in sorted((models / family).iterdir()) if path.name != "target"}
    drafters = {name: AutoModel.from_pretrained(path, trust_remote_code=True).eval() for name, path in ways.items()}
    drafters[PROMPT_LOOKUP] = PROMPT_LOOKUP
    result = {"rank": rank, "ways": {}}
    plain_error = error_of(lambda: target.generate(PROMPT, **GREEDY))
    if plain_error is not None:
        result["plain_error"] = plain_error
        for name, drafter in drafters.items():
            speculative = lambda d=drafter: target.generate(PROMPT, **GREEDY, **drafting_arguments(d))  # noqa: E731
            result["ways"][name] = {"error": error_of(speculative)}
    else:
        plain = target.generate(PROMPT, **GREEDY)
        for name, drafter in drafters.items():
            greedy = target.generate(PROMPT, **GREEDY, **drafting_arguments(drafter))
            torch.manual_seed(1000 * rank)
            sampled = target.generate(PROMPT, **SAMPLING, **drafting_arguments(drafter))
            result["ways"][name] = {"identical": torch.equal(greedy, plain), "sampled": sampled[0].tolist()}
            if name != PROMPT_LOOKUP:  # prompt lookup is transformers' own, one prompt at a time
                batched = target.generate(**BATCH, **GREEDY, assistant_model=drafter)
                torch.manual_seed(1000 * rank)
                batch_sampled = target.generate(**BATCH, **SAMPLING, assistant_model=drafter)
                result["ways"][name] |= {
                    "batch_identical": torch.equal(batched, target.generate(**BATCH, **GREEDY)),
                    "batch_sampled": batch_sampled.tolist(),
                }
        drafter = drafters["hyperdflash"]
        changed = AutoModel.from_pretrained(ways["hyperdflash"], trust_remote_code=True).eval()
        if rank == 1:
            with torch.no_grad():
                next(changed.parameters()).add_(1e-3)
        result["changed_drafter"] = error_of(lambda: target.generate(PROMPT, **GREEDY, assistant_model=changed))
        prompt = PROMPT if rank == 0 else PROMPT.flip(-1)
        result["other_prompt"] = error_of(lambda: target.generate(prompt, **GREEDY, assistant_model=drafter))
        after = target.generate(PROMPT, **GREEDY, assistant_model=drafter)
        result["decodes_after"] = torch.equal(after, plain)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]))
