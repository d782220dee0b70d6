"""How often drafts are accepted when sampling at T=1: drafters, and a temperature on the drafter's q.

    python benchmarks/sampling_acceptance.py [--drafter NAME=DIR ...] [--q-temperatures 0 1 1.5 2 3] [--prompts 8]

Speculative sampling accepts a draft drawn from q with probability sum(min(p, q)) on average, so a q sharper than
the target's p (a drafter trained on greedy replies) loses acceptance at T=1. This prints, per drafter (default: the
shipped HyperDFlash drafter and native MTP) and per temperature applied to the drafter's logits before the
generation's processors (q -> softmax(logits / t); any q keeps sampling exact; t = 0 proposes the drafter's argmax with
a one-hot q, which keeps a block drafter's block coherent and is accepted with the target's probability of each
token), tau and the acceptance at each draft
position, on held-out ShareGPT prompts sampled at T=1 (top_k=0, top_p=1) with the constant schedule, and tau at T=0
for each drafter. Seeds are the prompt's index, so rows are comparable.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.modeling.candidate_generator import TokenPicker
from hf_hyperdflash.modeling.generation_stats import acceptance_per_position, mean_accepted_length
from hf_hyperdflash.prompts import encode_prompt, load_prompts


def acceptance(target, drafter, prompts, temperature: float, max_new_tokens: int) -> tuple[float, list[float]]:
    accepted, proposed = [], []
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if temperature else {}
    for index, prompt in enumerate(prompts):
        torch.manual_seed(index)
        target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, **sampling)
        accepted += drafter.last_generation_stats.accepted_per_step
        proposed += drafter.last_generation_stats.proposed_per_step
    return mean_accepted_length(accepted), acceptance_per_position(accepted, proposed)


PICK = TokenPicker.__call__  # unpatched


def argmax_one_hot(picker: TokenPicker, prefix: torch.LongTensor, logits: torch.Tensor):
    """The drafter's argmax after the generation's processors, proposed with q = 1 on it (q -> softmax(logits / 0))."""
    token, processed = PICK(TokenPicker(picker.logits_processor, do_sample=False), prefix, logits)
    return token, torch.full_like(processed, -torch.inf).scatter(-1, token, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", metavar="NAME=DIR", help="default: the shipped hyperdflash, mtp")
    parser.add_argument("--q-temperatures", type=float, nargs="+", default=[0.0, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafters = dict(d.split("=", 1) for d in args.drafter or [])
    drafters = drafters or {"hyperdflash": reference.drafter_path("hyperdflash"), "mtp": reference.mtp_path()}
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    chats = load_prompts("sharegpt", "held_out", args.prompts, max_chars=2000)
    prompts = [torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)]) for chat in chats]
    print(f"{args.prompts} held-out prompts, {args.max_new_tokens} new tokens, constant schedule")
    print("| drafter | T | q temperature | tau | acceptance per position |\n|---|---|---|---|---|")
    for name, path in drafters.items():
        drafter = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        tau, rates = acceptance(target, drafter, prompts, 0.0, args.max_new_tokens)
        print(f"| {name} | 0 | – | {tau:.2f} | {', '.join(f'{r:.2f}' for r in rates)} |")
        for q_temperature in args.q_temperatures:
            scaled = lambda self, prefix, logits, t=q_temperature: PICK(self, prefix, logits.float() / t)  # noqa: E731
            with mock.patch.object(TokenPicker, "__call__", scaled if q_temperature else argmax_one_hot):
                tau, rates = acceptance(target, drafter, prompts, 1.0, args.max_new_tokens)
            print(f"| {name} | 1 | {q_temperature:g} | {tau:.2f} | {', '.join(f'{r:.2f}' for r in rates)} |")


if __name__ == "__main__":
    main()
