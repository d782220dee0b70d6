"""Is speculative `generate()` lossless? Many prompts, greedy and sampled, two drafters, against plain `generate()`.

    python benchmarks/lossless.py [--target {auto,tiny}] [--prompts 50] [--max-new-tokens 48] [--seed 0]
                                  [--schedules adaptive constant] [--drafter DIR]

Target: the shipped reference target with held-out ShareGPT prompts in the chat format when it exists
(`--target auto`), else (or with `--target tiny`) the tiny random test target with random-token prompts. Prompt
lengths vary, and several exceed 4x the target's sliding window, so verify steps rewind sliding and compressed caches.

Drafters: an untrained HyperDFlash drafter (`from_target`, block 8: nearly every draft is rejected), or with
`--drafter DIR` a saved one (a trained drafter of the reference target: its drafts and the context's copied chains
are accepted as in use), and the same drafter with its proposals replaced by the test oracle
(`hf_hyperdflash.testing.OracleProposer`: the plain continuation, each token corrupted with probability
`--corruption`), so full, partial and zero acceptance all occur.
Each runs under every draft schedule in `--schedules`: "adaptive" (the default: draft length chosen per step, and
steps that skip drafting) and "constant" (every step drafts 7 tokens, so every verify path is exercised); each
drafter-schedule pair keeps its own learned schedule across its calls, as separate chat sessions would. The
script prints how often each outcome occurred, counted per verify step, and the share of steps that skipped drafting.

What "lossless" means in each printed line:
- greedy: the speculative output is token-identical to plain `target.generate()`, for every prompt;
- sampled, top_k=1: sampling with `do_sample=True, top_k=1` runs the speculative-sampling code path (drafts drawn
  from the drafter's q, rejection sampling, residual resampling) but is deterministic, so the output must again be
  token-identical to plain sampling, for every prompt;
- sampled, top_k=`--sample-top-k`: on `--sampled-prompts` prompts (shortest to longest), the exact joint
  distribution of the first `--sample-tokens` new tokens is enumerated from the target itself (the processed scores
  plain `generate()` reports, for every prefix in the top-k support; valid while the target's generation config has
  no length-dependent processor such as `min_new_tokens`), `--samples` speculative samples are drawn, and Pearson's
  chi-square test compares them. A prompt counts as lossless when p >= `--alpha` and no sample falls outside the
  support; the p-values are printed. At least 3 new tokens are needed: the first comes from the prefill, and
  generate() leaves no room for a draft in a 2-token generation.

Exits with status 1 if any line is not N/N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_hyperdflash import HyperDFlashForDrafting, reference
from hf_hyperdflash.evaluation.prompts import chat_prompt_ids, held_out_prompts
from hf_hyperdflash.evaluation.runner import Method, MethodResult, Session, drafting_settings
from hf_hyperdflash.modeling.draft_options import SCHEDULES
from hf_hyperdflash.testing import OracleProposer, chi_square_p_value, oracle_drafting, tiny_deepseek_v4

UNTRAINED, TRAINED, ORACLE = "untrained-hyperdflash", "trained-hyperdflash", "oracle"
SESSIONS: defaultdict[str, Session] = defaultdict(Session)  # by method: what its schedule kept between calls


def load_target(choice: str) -> tuple[PreTrainedModel, str]:
    if choice == "auto":
        try:
            path = reference.target_path()
        except FileNotFoundError:
            pass
        else:
            target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            return target, f"reference target ({path})"
    return tiny_deepseek_v4(seed=0), "tiny random test target (hf_hyperdflash.testing.tiny_deepseek_v4)"


def benchmark_prompts(target: PreTrainedModel, count: int, seed: int, is_reference: bool) -> list[torch.LongTensor]:
    """Held-out chat prompts for the reference target; for the tiny one, random tokens of lengths 2 .. 6x window."""
    if is_reference:
        tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
        return [chat_prompt_ids(tokenizer, prompt) for prompt in held_out_prompts(count)]
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(2, 6 * target.config.sliding_window, count).round().long()
    lengths = lengths[torch.randperm(count, generator=generator)]
    return [torch.randint(3, target.config.vocab_size, (1, int(n)), generator=generator) for n in lengths]


def method_names(schedules: list[str], drafter_name: str) -> list[str]:
    return [f"{drafter} ({schedule})" for schedule in schedules for drafter in (drafter_name, ORACLE)]


@contextmanager
def drafting(name: str, drafter, reference_ids: torch.LongTensor, corruption: float, seed: int):
    """The context a method runs in: its schedule and what that schedule kept from the method's earlier calls (the
    two drafters share one instance: the oracle must not inherit the untrained drafter's "drafting loses" or its
    heuristic draft length), and for the oracle its proposals (a corrupted `reference_ids`)."""
    kind, schedule = name.removesuffix(")").split(" (")
    with drafting_settings(Method(name, drafter, schedule=schedule), SESSIONS[name]):
        if kind == ORACLE:
            with oracle_drafting(OracleProposer(drafter.config.vocab_size, reference_ids, corruption, seed=seed)):
                yield
        else:
            yield


def outcome_counts(result: MethodResult) -> Counter:
    """Verify steps by outcome: every draft accepted, some, or none."""
    return Counter(
        "full" if accepted == proposed else "zero" if accepted == 0 else "partial"
        for accepted, proposed in zip(result.accepted_per_step, result.proposed_per_step, strict=True)
    )


def print_results(results: dict[str, MethodResult]) -> None:
    for name, result in results.items():
        outcomes = outcome_counts(result)
        print(
            f"  {name:<33} lossless {result.lossless}/{result.prompts}  tau {result.tau:.2f}  "
            f"verify steps: full {outcomes['full']}, partial {outcomes['partial']}, zero {outcomes['zero']}; "
            f"skipped drafting: {result.skipped_share:.0%} of steps"
        )


@torch.no_grad()
def token_identical_runs(target, drafter, prompts, settings: dict, args, desc: str) -> dict[str, MethodResult]:
    """Plain and speculative generate on every prompt; a prompt is lossless when the outputs are token-identical."""
    results = {name: MethodResult(name=name) for name in method_names(args.schedules, args.drafter_name)}
    for index, prompt in enumerate(tqdm(prompts, desc=desc)):
        plain = target.generate(prompt, **settings)
        for name, result in results.items():
            with drafting(name, drafter, plain, args.corruption, args.seed + index):
                speculative = target.generate(prompt, assistant_model=drafter, **settings)
            result.record(drafter.last_generation_stats)
            result.prompts += 1
            result.lossless += int(torch.equal(plain, speculative))
    return results


def eos_token_ids(target: PreTrainedModel) -> set[int]:
    eos = target.generation_config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


@torch.no_grad()
def exact_distribution(target, prompt: torch.LongTensor, settings: dict, num_tokens: int) -> dict[tuple, float]:
    """P(first `num_tokens` new tokens) over the support, from the processed scores plain generate() reports.

    A sequence ending in EOS is a leaf: generate() stops there.
    """
    eos = eos_token_ids(target)
    leaves, frontier = {}, {(): 1.0}
    for depth in range(num_tokens):
        next_frontier = {}
        for prefix, mass in frontier.items():
            input_ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long)], dim=1)
            out = target.generate(
                input_ids, max_new_tokens=1, output_scores=True, return_dict_in_generate=True, **settings
            )
            probs = out.scores[0][0].float().softmax(-1)
            for token in probs.nonzero().flatten().tolist():
                leaf = token in eos or depth == num_tokens - 1
                (leaves if leaf else next_frontier)[(*prefix, token)] = mass * float(probs[token])
        frontier = next_frontier
    return leaves


@torch.no_grad()
def distribution_test(target, drafter, name: str, prompt, settings: dict, args, result: MethodResult, bar) -> bool:
    """Draw `args.samples` speculative samples of the first tokens and test them against the exact distribution."""
    exact = exact_distribution(target, prompt, settings, args.sample_tokens)
    greedy = target.generate(prompt, max_new_tokens=args.sample_tokens, do_sample=False)
    counts = Counter()
    torch.manual_seed(args.seed)
    with drafting(name, drafter, greedy, args.corruption, args.seed):
        for _ in range(args.samples):
            out = target.generate(prompt, max_new_tokens=args.sample_tokens, assistant_model=drafter, **settings)
            counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
            result.record(drafter.last_generation_stats)
            bar.update(1)
    outside = sum(n for sequence, n in counts.items() if sequence not in exact)
    cells = list(exact)
    observed = torch.tensor([counts[c] for c in cells], dtype=torch.float64)
    p_value = chi_square_p_value(observed, torch.tensor([exact[c] for c in cells], dtype=torch.float64))
    bar.write(
        f"  {name:<33} {prompt.shape[1]:>4}-token prompt: {len(cells)} continuations, p = {p_value:.3f}, "
        f"samples outside the support: {outside}"
    )
    return p_value >= args.alpha and outside == 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["auto", "tiny"], default="auto", help="auto: the reference if shipped")
    parser.add_argument("--prompts", type=int, default=50, help="prompts for the token-identical checks")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="new tokens of the token-identical checks")
    parser.add_argument("--corruption", type=float, default=0.15, help="oracle: chance each hinted token is wrong")
    parser.add_argument("--sampled-prompts", type=int, default=4, help="prompts for the distribution test")
    parser.add_argument("--samples", type=int, default=400, help="speculative samples per prompt and drafter")
    parser.add_argument("--sample-tokens", type=int, default=4, help="new tokens whose joint law is tested (>= 3)")
    parser.add_argument("--sample-top-k", type=int, default=2, help="top_k of the distribution test (its support)")
    parser.add_argument("--alpha", type=float, default=1e-3, help="a prompt fails the distribution test if p < alpha")
    parser.add_argument("--seed", type=int, default=0, help="prompts, oracle corruption and sampling")
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=SCHEDULES,
        default=list(SCHEDULES),
        help="draft schedules, each drafter under each",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny target is fastest on 1)")
    parser.add_argument("--drafter", help="a saved drafter of the target, in place of an untrained one")
    args = parser.parse_args()
    args.drafter_name = TRAINED if args.drafter else UNTRAINED
    if args.sample_tokens < 3:
        parser.error("--sample-tokens must be >= 3: generate() has no room to draft in a 2-token generation.")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target, description = load_target(args.target)
    prompts = benchmark_prompts(target, args.prompts, args.seed, is_reference=description.startswith("reference"))
    torch.manual_seed(args.seed)
    if args.drafter:
        drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=torch.float32).eval()
    else:
        drafter = HyperDFlashForDrafting.from_target(target, block_size=8).eval()
    window, lengths = target.config.sliding_window, [p.shape[1] for p in prompts]
    print(f"target: {description}, sliding window {window}; drafter: {args.drafter or 'untrained, block 8'}")
    print(f"oracle corruption {args.corruption}")
    print(
        f"prompts: {len(prompts)}, {min(lengths)}..{max(lengths)} tokens (median {statistics.median(lengths):g}), "
        f"{sum(n > 4 * window for n in lengths)} longer than 4x the sliding window"
    )

    all_lossless = True
    modes = {
        "greedy": {"do_sample": False},
        "sampled, top_k=1": {"do_sample": True, "top_k": 1},
    }
    for mode, settings in modes.items():
        settings = {**settings, "max_new_tokens": args.max_new_tokens}
        results = token_identical_runs(target, drafter, prompts, settings, args, desc=mode)
        print(f"{mode}, {args.max_new_tokens} new tokens: token-identical to plain generate()")
        print_results(results)
        all_lossless &= all(r.lossless == r.prompts for r in results.values())

    settings = {"do_sample": True, "top_k": args.sample_top_k}
    by_length = sorted(prompts, key=lambda p: p.shape[1])
    count = min(args.sampled_prompts, len(prompts))
    chosen = [by_length[round(i * (len(prompts) - 1) / max(1, count - 1))] for i in range(count)]  # shortest..longest
    print(
        f"sampled, top_k={args.sample_top_k}: joint law of the first {args.sample_tokens} new tokens, {args.samples} "
        f"speculative samples per prompt vs the exact target distribution (Pearson chi-square, lossless if p >= "
        f"{args.alpha:g})"
    )
    results = {name: MethodResult(name=name) for name in method_names(args.schedules, args.drafter_name)}
    for name, result in results.items():
        with tqdm(total=len(chosen) * args.samples, desc=f"{name} samples") as bar:
            for prompt in chosen:
                result.prompts += 1
                result.lossless += distribution_test(target, drafter, name, prompt, settings, args, result, bar)
    print_results(results)
    all_lossless &= all(r.lossless == r.prompts for r in results.values())

    print("all lossless" if all_lossless else "NOT LOSSLESS")
    return 0 if all_lossless else 1


if __name__ == "__main__":
    sys.exit(main())
