"""How many tokens a verify could win from the drafter and from the context's own n-grams, greedy, on the shipped pair.

    python benchmarks/copy_bound.py                         # 20 held-out chat prompts and 20 copy-heavy ones
    python benchmarks/copy_bound.py --num-prompts 8 --max-new-tokens 64

For each prompt the target's greedy reply is decoded once; then every step is replayed on it, from the first reply
token on, with two sources of a chain of k = 7 tokens after the step's newest token:

- drafter: the shipped HyperDFlash drafter's block at that token (one drafter forward over the whole reply with an
  anchor at every position and the target's features of the positions before it, as in training; its Markov head
  drawn left to right), and its confidence head's confidence at each position;
- copy: the tokens that followed the most recent earlier occurrence of the longest suffix (3, 2 or 1 tokens) of the
  prompt and reply so far, as a suffix-match proposer drafts.

A step accepts the chain's longest prefix that matches the greedy reply, plus the target's bonus token. Reported,
per prompt set: tau of each source alone; the hindsight bound (each step the source that is accepted further); and
a chooser that decides before the target sees the step, from what it knows then: the drafter's expected tokens by its
confidences calibrated on the steps so far (`AcceptanceCalibration`), against the copy's by the acceptance its
matches of the same suffix length have had so far; with the share of the bound's gain over the drafter it reaches.
Also the merged chain: the drafter's own, left to right, taking the copied token at each position while the drafter
ranks it among its top 16 (a path over its top-k, as DFlash2 chooses one), and the bound of the three.
A replay, not a timing: each step's cost is one verify forward either way.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.datasets import load_prompt_set
from hf_hyperdflash.modeling.draft_policy import AcceptanceCalibration, expected_tokens
from hf_hyperdflash.modeling.targets import get_target_adapter

DRAFTS = 7
LONGEST_SUFFIX = 3
TOP_K = 16  # a copied token joins the merged chain while the drafter ranks it among its top 16 (DFlash2's width)


def copied_chain(tokens: list[int], length: int) -> tuple[list[int], int]:
    """What followed the most recent earlier occurrence of the longest suffix of `tokens` (at most `LONGEST_SUFFIX`
    tokens), up to `length` tokens, and the suffix's length (0: no earlier occurrence)."""
    for n in range(min(LONGEST_SUFFIX, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # `end`: just after an earlier occurrence
            if tokens[end - n : end] == suffix:
                return tokens[end : end + length], n
    return [], 0


def drafter_blocks(target, drafter, sequence: torch.LongTensor, first: int) -> tuple[list, list, list]:
    """The drafter's greedy chain, its confidences and its merged chain (`merged_chain`) at every anchor from column
    `first` on, from one forward."""
    adapter = get_target_adapter(target)
    with adapter.capture(None) as capture, torch.no_grad():
        target(sequence)
        features = capture.features()
    columns = sequence.shape[1]
    anchors = torch.arange(first, columns - 1)[None]
    with torch.no_grad():
        out = drafter(
            anchor_embeds=adapter.embed(sequence[:, first : columns - 1]).to(drafter.dtype),
            target_hidden=features.to(drafter.dtype),
            context_position_ids=torch.arange(columns)[None],
            anchor_position_ids=anchors,
        )
        block = drafter.config.block_size
        hidden = out.last_hidden_state.unflatten(1, (-1, block))[:, :, 1 : 1 + DRAFTS]  # [1, anchors, k, D]
        residual = out.residual.unflatten(1, (-1, block))[:, :, 1 : 1 + DRAFTS]
        logits = adapter.logits(hidden).float()[0]  # [anchors, k, V]
        previous, tokens, confidences = sequence[0, first : columns - 1], [], []
        for k in range(DRAFTS):  # the Markov head, left to right, every anchor at once
            bias, embedding = drafter.markov(previous)
            confidences.append(drafter.confidence(residual[0, :, k], embedding))
            previous = (logits[:, k] + bias).argmax(dim=-1)
            tokens.append(previous)
        truth = sequence[0].tolist()
        merged = [
            merged_chain(drafter, logits[column - first], truth[column], copied_chain(truth[: column + 1], DRAFTS)[0])
            for column in range(first, columns - 1)
        ]
    return torch.stack(tokens, 1).tolist(), torch.stack(confidences, 1).tolist(), merged


def merged_chain(drafter, logits: torch.Tensor, anchor: int, copied: list[int]) -> list[int]:
    """The drafter's chain, left to right with its Markov bias, taking the copied token at each position while the
    drafter ranks it among its `TOP_K` there (once it does not, the copy is left: what follows no longer lines up)."""
    chain, previous, following = [], anchor, True
    for k in range(logits.shape[0]):
        scores = logits[k] + drafter.markov(torch.tensor(previous))[0]
        following = following and k < len(copied) and copied[k] in scores.topk(TOP_K).indices.tolist()
        previous = copied[k] if following else int(scores.argmax())
        chain.append(previous)
    return chain


def accepted(chain: list[int], truth: list[int]) -> int:
    count = 0
    for drafted, right in zip(chain, truth, strict=False):
        if drafted != right:
            break
        count += 1
    return count


class Chooser:
    """Chooses a source before the step is verified, and learns from each verified step what the target's tokens
    tell of both sources: each is scored against the tokens the step verified (a source that matched all of them is
    known to be accepted that far, no further).

    `first_only`: judge the drafter by its first position's confidence alone, and by its running acceptance beyond
    it, so nothing drawn decides (what keeps sampling exact); else by every position's confidence."""

    def __init__(self, first_only: bool):
        self.first_only = first_only
        self.calibration = AcceptanceCalibration()
        self.drafter_rates = Rates()  # the drafter's acceptance past its first draft
        self.copy_rates: dict[int, Rates] = {}  # by the suffix length that matched

    def choose(self, confidences: list[float], chain: list[int], suffix: int) -> str:
        if self.first_only:
            first = self.calibration.probability(confidences[0])
            drafter = expected_tokens([first, *self.drafter_rates.rates(len(confidences))[1:]])[-1]
        else:
            drafter = expected_tokens([self.calibration.probability(c) for c in confidences])[-1]
        copy = expected_tokens(self.copy_rates.setdefault(suffix, Rates()).rates(len(chain)))[-1] if chain else 0.0
        return "copy" if copy > drafter else "drafter"

    def learn(self, confidences: list[float], drafted: list[int], chain: list[int], suffix: int, known: list[int]):
        by_drafter = accepted(drafted, known)
        self.calibration.update(confidences[:1], 1, by_drafter)
        self.drafter_rates.update(by_drafter, len(known), len(drafted))
        if chain:
            self.copy_rates.setdefault(suffix, Rates()).update(accepted(chain, known), len(known), len(chain))


class Rates:
    """P(draft j accepted | the ones before it were), per position, from a prior of one accept in two tries."""

    def __init__(self):
        self.accepted, self.tried = [1.0] * DRAFTS, [2.0] * DRAFTS

    def rates(self, length: int) -> list[float]:
        return [self.accepted[j] / self.tried[j] for j in range(length)]

    def update(self, count: int, known: int, length: int) -> None:
        """`count` drafts matched the `known` verified tokens; a miss inside them is a rejection."""
        for j in range(min(count + 1, known, length)):
            self.tried[j] += 1
            self.accepted[j] += j < count


RULES = ("drafter", "copy", "bound", "chooser", "chooser, first confidence", "merged", "bound of three")


def replay(truth: list[int], first: int, blocks: list, confidences: list, merged: list) -> dict[str, float]:
    """tau of each way of choosing a step's chain, stepping along the greedy `truth` from column `first`."""
    end = len(truth) - 1
    taus = {}
    for rule in RULES:
        chooser, column, steps, copied_steps = Chooser(first_only=rule.endswith("first confidence")), first, 0, 0
        while column < end:
            room = end - column - 1  # drafts that leave room for the bonus token
            if room <= 0:  # the last token: a plain step, which no rule drafts for (nor counts, as the stats)
                column += 1
                continue
            right = truth[column + 1 : column + 1 + min(DRAFTS, room)]
            chain, suffix = copied_chain(truth[: column + 1], min(DRAFTS, room))
            drafted = blocks[column - first][: len(right)]
            by_drafter, by_copy = accepted(drafted, right), accepted(chain, right)
            conf = confidences[column - first][: len(right)]
            by_merged = accepted(merged[column - first][: len(right)], right)
            if rule.startswith("chooser"):
                choice = chooser.choose(conf, chain, suffix)
            elif rule == "bound":
                choice = "copy" if by_copy > by_drafter else "drafter"
            elif rule == "bound of three":
                choice = max(("drafter", by_drafter), ("copy", by_copy), ("merged", by_merged), key=lambda x: x[1])[0]
            else:
                choice = rule if rule != "copy" or chain else "drafter"
            gained = {"copy": by_copy, "merged": by_merged}.get(choice, by_drafter)
            chooser.learn(conf, drafted, chain, suffix, truth[column + 1 : column + 2 + gained])
            copied_steps += choice == "copy"
            column += gained + 1
            steps += 1
        taus[rule] = (column - first) / steps
        taus[f"{rule} copied share"] = copied_steps / steps
    return taus


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", nargs="+", default=["sharegpt", "copyedit"])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.float32).eval()
    report = {"drafts": DRAFTS, "max_new_tokens": args.max_new_tokens, "sets": {}}
    columns = ["prompts", "drafter", "copy", "hindsight bound", "chooser (copied, share of the bound's gain)",
               "chooser on first confidences (copied, share)", "merged", "bound of three"]  # fmt: skip
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for name in args.sets:
        per_prompt = []
        for chat in load_prompt_set(name, limit=args.num_prompts, max_chars=1500):
            prompt = tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            with torch.no_grad():
                sequence = target.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
            first = prompt["input_ids"].shape[1]  # the reply's first token, which the prefill gives
            if sequence.shape[1] - first < 3:
                continue
            blocks, confidences, merged = drafter_blocks(target, drafter, sequence, first)
            per_prompt.append(replay(sequence[0].tolist(), first, blocks, confidences, merged))
        summary = {key: statistics.mean(taus[key] for taus in per_prompt) for key in per_prompt[0]}
        gain = summary["bound"] - summary["drafter"]
        for rule in ("chooser", "chooser, first confidence"):
            summary[f"{rule} bound share"] = (summary[rule] - summary["drafter"]) / gain if gain else 0.0
        summary["prompts"] = len(per_prompt)
        report["sets"][name] = summary
        print(
            f"| {name} ({len(per_prompt)}) | {summary['drafter']:.2f} | {summary['copy']:.2f} "
            f"| {summary['bound']:.2f} "
            + "".join(
                f"| {summary[rule]:.2f} ({summary[rule + ' copied share']:.0%}, {summary[rule + ' bound share']:.0%}) "
                for rule in ("chooser", "chooser, first confidence")
            )
            + f"| {summary['merged']:.2f} | {summary['bound of three']:.2f} |",
            flush=True,
        )
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
