"""tau and speedup of speculative decoding over the same distributed plain decoding, with the shipped reference
target spread over processes by transformers' tensor-parallel plan (2 CPU processes over gloo by default).

    python benchmarks/distributed.py                      # relaunches itself: torchrun --nproc_per_node 2
    python benchmarks/distributed.py --parallel tp+ep --prompts 8 --repeats 3
    python benchmarks/distributed.py --temperature 1

Per held-out ShareGPT prompt and shipped drafter (plus prompt lookup), plain and speculative calls at `--temperature`
alternate `--repeats` times (both sides barrier-synchronised across ranks, timed by rank 0's clock); the speedup of a
prompt is the median over its repeats of plain time over speculative time. Printed per drafter: tau (mean over
prompts), the median speedup over prompts with its 95% percentile bootstrap interval over prompts, how many greedy
outputs were identical to plain decoding on every rank (sampling: how many got the same tokens on every rank), and
what the ranks' agreement cost (`RankAgreement`): its collectives per decoding step and the share of the speculative
call's time spent in them (rank 0's clock, waiting for the other rank included; medians over prompts). Then, per
drafter, the same speculative calls with the agreement and without it (`without_agreement`: the ranks seeded alike
so they stay in step without it), interleaved: time with over time without, median over prompts with its interval.
A ratio whose interval holds 1.00 is a tie.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.distributed import (
    PARALLEL_PLANS,
    PROMPT_LOOKUP,
    compare,
    drafting_arguments,
    gather,
    generation_settings,
    init_processes,
    load_drafters,
    load_spread_target,
    timed_generate,
)
from hf_hyperdflash.evaluation.paired import median_with_interval
from hf_hyperdflash.modeling.rank_agreement import RankAgreement
from hf_hyperdflash.prompts import encode_prompt, load_prompts


def relaunch_under_torchrun(processes: int) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), *sys.argv]
    raise SystemExit(subprocess.run(command, check=False).returncode)


@contextmanager
def without_agreement():
    """Speculative calls as before the ranks agreed on anything: every `RankAgreement` a one-process one (no opening
    check, no per-step collective). The ranks stay in step only while they compute and draw alike (seeded alike)."""
    of = RankAgreement.__dict__["of"]
    RankAgreement.of = classmethod(lambda cls, model: cls(None))
    try:
        yield
    finally:
        RankAgreement.of = of


def agreement_cost(target, prompt, drafter, temperature: float, max_new_tokens: int, repeats: int, seed: int):
    """Speculative time with the agreement over time without it (medians over `repeats` interleaved pairs, every
    rank seeded alike); the drafters' whole copies of the target's head are made by the first call, with it."""
    settings = generation_settings(temperature, max_new_tokens) | drafting_arguments(drafter)
    agreed, alone = [], []
    for repeat in range(repeats):
        torch.manual_seed(seed + repeat)
        agreed.append(timed_generate(target, prompt, **settings)[1])
        torch.manual_seed(seed + repeat)
        with without_agreement():
            alone.append(timed_generate(target, prompt, **settings)[1])
    return statistics.median(agreed) / statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="processes torchrun starts (one node)")
    parser.add_argument("--parallel", choices=PARALLEL_PLANS, default="tp")
    parser.add_argument("--prompts", type=int, default=6, help="held-out ShareGPT prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampling at T")
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        relaunch_under_torchrun(args.processes)
    torch.set_num_threads(args.threads)
    init_processes(600)
    target = load_spread_target(reference.target_path(), args.parallel)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    specs = [f"{kind}={reference.drafter_path(kind)}" for kind in reference.DRAFTER_KINDS]
    specs += [f"mtp={reference.mtp_path()}", f"dspark={reference.dspark_path()}", PROMPT_LOOKUP]
    drafters = load_drafters(specs, target)
    prompts = [encode_prompt(tokenizer, m, False) for m in load_prompts("sharegpt", "held_out", args.prompts)]
    rows = {name: [] for name in drafters}
    costs = {name: [] for name in drafters}
    for index, prompt in enumerate(prompts):
        for name, drafter in drafters.items():
            ids = torch.tensor([prompt])
            settings = (args.temperature, args.max_new_tokens, args.repeats)
            rows[name].append(compare(target, ids, drafter, *settings, seed=index))
            costs[name].append(agreement_cost(target, ids, drafter, *settings, seed=index))
    # greedy: identical to plain decoding on every rank; sampling: every rank got rank 0's tokens
    check = "identical" if args.temperature == 0 else "ranks_agree"
    agreeing = "identical on every rank" if args.temperature == 0 else "same tokens on every rank"
    every_rank = {name: gather([r[check] for r in results]) for name, results in rows.items()}
    identical = {name: sum(all(flags) for flags in zip(*ranks, strict=True)) for name, ranks in every_rank.items()}
    if dist.get_rank() == 0:
        runs = f"{dist.get_world_size()} processes, {len(prompts)} prompts, T={args.temperature:g}, reference pair"
        print(f"{args.parallel} over {runs}")
        print(
            f"| method | tau | speedup over distributed plain decoding | {agreeing} "
            "| agreement collectives per step | time in agreement |"
        )
        print("|---|---|---|---|---|---|")
        for name, results in rows.items():
            taus = [r["tau"] for r in results if r["tau"] is not None]
            tau = f"{statistics.fmean(taus):.2f}" if taus else "-"
            median, low, high = median_with_interval([r["speedup"] for r in results])
            cost = "| - | - |"
            if results[0]["agreement_collectives"] is not None:
                collectives = statistics.median(r["agreement_collectives"] for r in results)
                cost = f"| {collectives:.2f} | {100 * statistics.median(r['agreement_share'] for r in results):.1f}% |"
            speedup = f"{median:.2f}x ({low:.2f}-{high:.2f})"
            print(f"| {name} | {tau} | {speedup} | {identical[name]}/{len(results)} {cost}")
        print("\n| method | speculative time with the agreement over time without it |")
        print("|---|---|")
        for name, ratios in costs.items():
            median, low, high = median_with_interval(ratios)
            print(f"| {name} | {median:.3f} ({low:.3f}-{high:.3f}) |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
