"""Speculative decoding with a target spread over processes by transformers' own tensor and expert parallel plans.

    torchrun --nproc_per_node 8 -m hf_hyperdflash.distributed --target PATH --drafter hyperdflash=DIR
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank N --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m hf_hyperdflash.distributed --target PATH --drafter hyperdflash=DIR --parallel tp+ep

Every process loads the target with `from_pretrained(..., distributed_config=...)` (its TP plan, its EP plan, or
both) in `--dtype`, and the drafters whole on the target's device in its dtype (they are small: every rank keeps a
copy), and runs the same generate() calls. For each drafter (a saved drafter directory, or `prompt_lookup`), greedy
and at T=1, plain and speculative, interleaved: rank 0 prints tau, the speedup over the same distributed plain
decoding, whether greedy output was identical to it, and whether every rank got the same tokens (plain decoding is
seeded alike on every rank, as it has no agreement of its own; speculative calls are seeded differently per rank on
purpose: the package makes them agree). `--output FILE` writes the same as JSON. Without `--target`/`--drafter`: the
shipped reference pair. With GPUs the processes talk over NCCL, one GPU each; on CPU over gloo
(`torchrun --nproc_per_node 2` runs on one machine without a GPU). `--timeout` bounds how long a rank waits in a
collective (a rank that died inside the target's own collectives), in place of transformers' two hours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModel, PreTrainedModel
from transformers.distributed import DistributedConfig

from . import reference
from .loading import target_auto_class

PARALLEL_PLANS = ("tp", "ep", "tp+ep")
PROMPT_LOOKUP = "prompt_lookup"
PROMPT_LOOKUP_TOKENS = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def init_processes(timeout_s: float) -> None:
    """The process group of this `torchrun` job, before transformers would create one (with a two-hour timeout):
    NCCL with this process's GPU bound when there is one, else gloo; a collective waits at most `timeout_s`."""
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def distributed_config(parallel: str, group_size: int, replicas: int = 1) -> DistributedConfig:
    """transformers' settings for `parallel` over `group_size` processes per copy of the target, `replicas` copies
    (training: each copy's group sees its own batch): the family's tensor-parallel plan ("tp"), its expert-parallel
    plan ("ep", every other weight whole on each rank), or both (experts by EP, the rest by TP)."""
    if parallel not in PARALLEL_PLANS:
        raise ValueError(f"`parallel` must be one of {PARALLEL_PLANS}, got {parallel!r}.")
    sizes = {"tp_size": group_size, "dp_replicate_size": replicas}
    if parallel == "tp":
        return DistributedConfig(tp_plan="auto", **sizes)
    if parallel == "ep":
        return DistributedConfig(tp_plan={}, ep_size=group_size, **sizes)
    return DistributedConfig(tp_plan="auto", ep_size=group_size, **sizes)


def load_spread_target(
    path: str | Path, parallel: str = "tp", dtype: torch.dtype | str = torch.float32, group_size: int | None = None
) -> PreTrainedModel:
    """The target at `path` spread by `parallel` over groups of `group_size` processes (default: all of this
    `torchrun` job's), one copy per group."""
    world_size = int(os.environ["WORLD_SIZE"])
    group_size = group_size or world_size
    if world_size % group_size:
        raise ValueError(
            f"{world_size} processes do not split into groups of {group_size}: pass a group size that divides the "
            "process count (--target-parallel-size)."
        )
    config = distributed_config(parallel, group_size, world_size // group_size)
    return target_auto_class(path).from_pretrained(path, dtype=dtype, distributed_config=config).eval()


def gather(value: object) -> list:
    """`value` from every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def drafting_arguments(drafter: PreTrainedModel | str) -> dict:
    if drafter == PROMPT_LOOKUP:
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    return {"assistant_model": drafter}


def timed_generate(target: PreTrainedModel, prompt: torch.Tensor, **kwargs) -> tuple[torch.Tensor, float]:
    dist.barrier()
    start = time.perf_counter()
    output = target.generate(prompt, **kwargs)
    dist.barrier()
    return output, time.perf_counter() - start


def generation_settings(temperature: float, max_new_tokens: int) -> dict:
    """Greedy at T=0, else sampling at `temperature` (with the target's own other sampling settings)."""
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return {"max_new_tokens": max_new_tokens, **sampling}


def compare(target, prompt, drafter, temperature: float, max_new_tokens: int, repeats: int, seed: int) -> dict:
    """Plain and speculative decoding of `prompt`, interleaved `repeats` times; every rank seeded `seed + rank`."""
    settings = generation_settings(temperature, max_new_tokens)
    plain_seconds, speculative_seconds, taus, agreement = [], [], [], []
    for repeat in range(repeats):
        torch.manual_seed(seed + repeat)  # alike on every rank: plain decoding has no agreement of its own
        plain, seconds = timed_generate(target, prompt, **settings)
        plain_seconds.append(seconds)
        torch.manual_seed(seed + repeat + 1000 * dist.get_rank())
        speculative, seconds = timed_generate(target, prompt, **settings, **drafting_arguments(drafter))
        speculative_seconds.append(seconds)
        if drafter != PROMPT_LOOKUP:
            stats = drafter.last_generation_stats
            taus.append(stats.mean_accepted_length)
            per_step = stats.rank_collectives / max(stats.decoding_steps, 1)
            agreement.append((per_step, stats.rank_agreement_seconds / seconds))
    sequences = gather(speculative[0].tolist())
    return {
        "identical": bool(torch.equal(plain, speculative)) if temperature == 0 else None,
        "ranks_agree": all(tokens == sequences[0] for tokens in sequences),
        "tau": statistics.median(taus) if taus else None,
        # the ranks' agreement: collectives per decoding step (the call's opening one included), and the share of
        # the call's time spent in them
        "agreement_collectives": statistics.median(c for c, _ in agreement) if agreement else None,
        "agreement_share": statistics.median(share for _, share in agreement) if agreement else None,
        "speedup": statistics.median(p / s for p, s in zip(plain_seconds, speculative_seconds, strict=True)),
    }


def load_drafters(specs: list[str], target: PreTrainedModel) -> dict:
    """The drafters named by `specs` (NAME=DIR, or prompt lookup), on the target's device in its dtype."""
    drafters = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if name == PROMPT_LOOKUP:
            drafters[name] = PROMPT_LOOKUP
        elif not path:
            raise ValueError(f"--drafter takes NAME=DIR (or {PROMPT_LOOKUP}), got {spec!r}.")
        else:
            drafter = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=target.dtype)
            drafters[name] = drafter.to(target.device).eval()
    return drafters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="Target directory or Hub id (default: the shipped reference target).")
    parser.add_argument(
        "--drafter", action="append", help=f"NAME=DIR, or {PROMPT_LOOKUP} (repeatable; default: the shipped drafters)."
    )
    parser.add_argument("--parallel", choices=PARALLEL_PLANS, default="tp", help="How the target is spread.")
    parser.add_argument(
        "--dtype", choices=DTYPES, help="Target and drafters (default: float32 on CPU, the checkpoint's with GPUs)."
    )
    parser.add_argument("--timeout", type=float, default=600, help="Seconds a rank waits in a collective at most.")
    parser.add_argument("--prompt-ids", default="5,17,33,9,250,11,12,40,77,3,19,23,8,101,44,6", help="Token ids.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=1, help="Interleaved plain/speculative pairs per drafter.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process.")
    parser.add_argument("--output", type=Path, help="Also write the results as JSON (rank 0).")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    init_processes(args.timeout)
    dtype = DTYPES[args.dtype or ("auto" if torch.cuda.is_available() else "float32")]
    target = load_spread_target(args.target or reference.target_path(), args.parallel, dtype)
    specs = args.drafter or [
        *(f"{kind}={reference.drafter_path(kind)}" for kind in reference.DRAFTER_KINDS),
        f"mtp={reference.mtp_path()}",
        f"dspark={reference.dspark_path()}",
        PROMPT_LOOKUP,
    ]
    drafters = load_drafters(specs, target)
    prompt = torch.tensor([[int(token) for token in args.prompt_ids.split(",")]], device=target.device)
    results = []
    for name, drafter in drafters.items():
        for temperature in args.temperatures:
            row = compare(target, prompt, drafter, temperature, args.max_new_tokens, args.repeats, args.seed)
            results.append({"drafter": name, "temperature": temperature, **row})
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} processes, {args.parallel}, {type(target).__name__} in {target.dtype}")
        for row in results:
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            print(
                f"{row['drafter']:>16} T={row['temperature']:g}: tau {tau}, speedup {row['speedup']:.2f}x, "
                f"identical to plain {row['identical']}, ranks agree {row['ranks_agree']}"
            )
        if args.output:
            args.output.write_text(json.dumps(results, indent=1))
    dist.barrier()  # every rank done with the group before any tears it down (a rank once aborted in gloo's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
