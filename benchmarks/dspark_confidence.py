"""Does DSpark's confidence head cut the block where drafts would be rejected? A small DSpark trained on the shipped
reference target, decoded twice on held-out prompts: every step verifying the whole block ("constant"), and with the
adaptive schedule, whose confidence input for DSpark is the confidence head.

    python benchmarks/dspark_confidence.py [--output-dir runs/dspark_confidence] [--train-prompts 400]
        [--steps 400] [--stages 1] [--eval-prompts 20] [--max-new-tokens 128]

Trains (or resumes) with DeepSpec's objective (`hf_hyperdflash/training/dspark.py`) on the target's greedy replies to
ShareGPT train-split prompts, then prints, per schedule, over the drafted steps of all held-out prompts: drafts
verified per step, tokens per drafted step (tau: accepted drafts plus the bonus token) and the share of verified
drafts that were rejected; and the confidence head's calibration (mean confidence against the acceptance rate, per
position, under the constant schedule). Greedy outputs are checked against plain decoding.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import DeepseekV4DSparkForDrafting, reference
from hf_hyperdflash.modeling import candidate_generator
from hf_hyperdflash.prompts import encode_prompt, load_prompts
from hf_hyperdflash.training.data import generate_replies, load_examples
from hf_hyperdflash.training.loop import LoopConfig
from hf_hyperdflash.training.trainer import train_drafter


def train(target, tokenizer, args) -> DeepseekV4DSparkForDrafting:
    out = Path(args.output_dir)
    if (out / "drafter" / "config.json").exists():
        return DeepseekV4DSparkForDrafting.from_pretrained(out / "drafter", dtype=torch.float32).eval()
    prompts = load_prompts("sharegpt", "train", args.train_prompts, max_chars=600)
    generate_replies(target, tokenizer, prompts, out / "data", max_new_tokens=128, batch_size=16)
    torch.manual_seed(0)
    drafter = DeepseekV4DSparkForDrafting.from_target(
        target, num_hidden_layers=args.stages, dspark_noise_token_id=tokenizer.pad_token_id, dspark_markov_rank=64
    )
    loop = LoopConfig(total_steps=args.steps, batch_size=4, learning_rate=1e-3, warmup_steps=40, seed=0)
    drafter = train_drafter(drafter, target, load_examples(out / "data"), out / "run", loop, anchors_per_sequence=24)
    drafter.save_pretrained(out / "drafter")
    return drafter.eval()


def decode(target, drafter, prompts, schedule: str, max_new_tokens: int) -> dict[str, float]:
    """Per drafted step, pooled over prompts; greedy outputs checked against plain decoding."""
    drafter.generation_config.num_assistant_tokens_schedule = schedule
    proposed, accepted, confidences = [], [], []
    propose = candidate_generator.DSparkProposer.propose

    def recording(self, *args):
        draft = propose(self, *args)
        confidences.append(draft.confidences)
        return draft

    candidate_generator.DSparkProposer.propose = recording
    try:
        for prompt in prompts:
            plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            out = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, plain), "a greedy output differs from plain decoding"
            stats = drafter.last_generation_stats
            proposed += stats.proposed_per_step
            accepted += stats.accepted_per_step
    finally:
        candidate_generator.DSparkProposer.propose = propose
    rejected = sum(p - a for p, a in zip(proposed, accepted, strict=True))
    return {
        "drafted steps": len(proposed),
        "verified per step": statistics.mean(proposed),
        "tau": statistics.mean(a + 1 for a in accepted),
        "rejected share": rejected / sum(proposed),
        "confidences": confidences,
        "accepted": accepted,
    }


def calibration(result: dict) -> list[tuple[int, float, float]]:
    """Per position k: mean confidence of the drafts at k, and the rate at which they were accepted given the
    ones before were (under "constant" every step verifies every draft)."""
    rows = []
    drafted = [c for c in result["confidences"] if c]
    for k in range(max(len(c) for c in drafted)):
        reached = [(c[k], a > k) for c, a in zip(drafted, result["accepted"], strict=False) if len(c) > k and a >= k]
        if reached:
            rows.append((k + 1, statistics.mean(c for c, _ in reached), statistics.mean(ok for _, ok in reached)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="runs/dspark_confidence")
    parser.add_argument("--train-prompts", type=int, default=400)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--eval-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = train(target, tokenizer, args)
    chats = load_prompts("sharegpt", "held_out", args.eval_prompts, max_chars=2000)
    prompts = [torch.tensor([encode_prompt(tokenizer, chat, enable_thinking=False)]) for chat in chats]
    results = {schedule: decode(target, drafter, prompts, schedule, args.max_new_tokens) for schedule in SCHEDULES}
    print("| schedule | drafted steps | drafts verified per step | tau (tokens per drafted step) | rejected share |")
    print("|---|---|---|---|---|")
    for schedule, result in results.items():
        print(
            f"| {schedule} | {result['drafted steps']} | {result['verified per step']:.2f} | {result['tau']:.2f} | "
            f"{result['rejected share']:.2f} |"
        )
    print("\n| position | mean confidence | acceptance rate |\n|---|---|---|")
    for position, confidence, rate in calibration(results["constant"]):
        print(f"| {position} | {confidence:.2f} | {rate:.2f} |")


SCHEDULES = ("constant", "adaptive")

if __name__ == "__main__":
    main()
