"""How many tokens a verify could win from the drafter and from the context's own n-grams, greedy, on the shipped pair.

    python benchmarks/copy_bound.py                         # 20 held-out chat prompts and 20 copy-heavy ones
    python benchmarks/copy_bound.py --num-prompts 8 --max-new-tokens 64

For each prompt the target's greedy reply is decoded once; then every step is replayed on it, from the first reply
token on, with two sources of a chain of k = 7 tokens after the step's newest token:

- drafter: the shipped HyperDFlash drafter's block at that token (one drafter forward over the whole reply with an
  anchor at every position and the target's features of the positions before it, as in training; its Markov head
  drawn left to right), and its confidence head's confidence at each position;
- copy: the runtime's copied chain (`context_copy.SuffixIndex`): what followed the most recent earlier occurrence of
  the longest suffix (3, 2 or 1 tokens) of the prompt and reply so far.

A step accepts the chain's longest prefix that matches the greedy reply, plus the target's bonus token. Reported,
per prompt set, with tau pooled over its prompts' steps as the runtime counts it: tau of each source alone; the
hindsight bound (each step the source that is accepted further); and the runtime's chooser
(`context_copy.ChainChooser`, with the CPU cost model of the block drafter), which decides before the target sees
the step and also chooses how much of a copy to verify, and the same chooser as the constant schedule runs it
(expected tokens alone, after the drafter's forward); with the share of the bound's gain over the drafter each
reaches. Also the merged chain: the drafter's own, left to right, taking the copied token at each position while the
drafter ranks it among its top 16 (a path over its top-k, as DFlash2 chooses one), and the bound of the three.
A replay, not a timing: each step's cost is one verify forward either way.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.evaluation.datasets import load_prompt_set
from hf_hyperdflash.modeling.context_copy import ChainChooser, SuffixIndex
from hf_hyperdflash.modeling.context_copy import matched as accepted
from hf_hyperdflash.modeling.draft_options import BLOCK_DRAFTER_TYPE, DRAFT_COSTS_BY_DEVICE
from hf_hyperdflash.modeling.draft_policy import DraftCosts
from hf_hyperdflash.modeling.targets import get_target_adapter

DRAFTS = 7
COSTS = DraftCosts(**DRAFT_COSTS_BY_DEVICE["cpu"][BLOCK_DRAFTER_TYPE])  # what the runtime's chooser weighs on a CPU
TOP_K = 16  # a copied token joins the merged chain while the drafter ranks it among its top 16 (DFlash2's width)


def context_chains(truth: list[int], first: int) -> list[tuple[list[int], int]]:
    """The runtime's copied chain (`SuffixIndex.continuation`, `DRAFTS` long) and matched suffix at every anchor
    column from `first` on, over the prompt and reply up to the anchor."""
    index, chains = SuffixIndex(), []
    index.extend(truth[: first + 1])
    for column in range(first, len(truth) - 1):
        chains.append(index.continuation(DRAFTS))
        index.extend(truth[column + 1 : column + 2])
    return chains


def drafter_blocks(target, drafter, sequence: torch.LongTensor, first: int, chains: list) -> tuple[list, list, list]:
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
            merged_chain(drafter, logits[column - first], truth[column], chains[column - first][0])
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


# "chooser": the runtime's under the default schedule (the CPU cost model: it may copy without the drafter's forward,
# and verifies the prefix of a copy that pays); "chooser, whole blocks": under the constant schedule (no cost model:
# expected tokens alone, after the drafter's forward), the tau comparison
RULES = ("drafter", "copy", "bound", "chooser", "chooser, whole blocks", "merged", "bound of three")


def choose(chooser: ChainChooser, chain: list[int], suffix: int, confidences: list[float], drafts: int) -> tuple:
    """The runtime's two choices for one step: (copied drafts to verify, 0 for the drafter's; whether the drafter
    ran)."""
    copied = chooser.copies_first(len(chain), suffix, drafts)
    if copied:
        return copied, False
    return chooser.copies_after(confidences[0], drafts, len(chain), suffix), True


def replay(truth: list[int], first: int, blocks: list, confidences: list, merged: list, chains: list) -> dict:
    """Per way of choosing a step's chain, stepping along the greedy `truth` from column `first`: (tokens, verify
    steps), and (copied steps, verify steps)."""
    end = len(truth) - 1
    taus = {}
    for rule in RULES:
        chooser = ChainChooser(DRAFTS, None if rule.endswith("whole blocks") else COSTS.step)
        column, steps, copied_steps = first, 0, 0
        while column < end:
            room = end - column - 1  # drafts that leave room for the bonus token
            if room <= 0:  # the last token: a plain step, which no rule drafts for (nor counts, as the stats)
                column += 1
                continue
            right = truth[column + 1 : column + 1 + min(DRAFTS, room)]
            chain, suffix = chains[column - first]
            chain = chain[: len(right)]
            drafted = blocks[column - first][: len(right)]
            by_drafter, by_copy = accepted(drafted, right), accepted(chain, right)
            by_merged = accepted(merged[column - first][: len(right)], right)
            copied, ran = 0, True
            if rule.startswith("chooser"):
                copied, ran = choose(chooser, chain, suffix, confidences[column - first], len(right))
                gained = accepted(chain[:copied], right) if copied else by_drafter
            elif rule == "bound":
                copied, gained = (len(chain), by_copy) if by_copy > by_drafter else (0, by_drafter)
            elif rule == "bound of three":
                gained = max(by_drafter, by_copy, by_merged)
            else:
                gained = {"drafter": by_drafter, "copy": by_copy, "merged": by_merged}[rule]
                copied = len(chain) if rule == "copy" else 0
            known = truth[column + 1 : column + 2 + gained]
            chooser.learn_copy(chain, suffix, known)
            if ran:
                chooser.learn_drafter(confidences[column - first][0], drafted, known)
            copied_steps += bool(copied)
            column += gained + 1
            steps += 1
        taus[rule] = (column - first, steps)  # tokens and verify steps: tau pools them over prompts
        taus[f"{rule} copied"] = (copied_steps, steps)
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
               "chooser, whole blocks (copied, share)", "merged", "bound of three"]  # fmt: skip
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
            truth = sequence[0].tolist()
            chains = context_chains(truth, first)
            blocks, confidences, merged = drafter_blocks(target, drafter, sequence, first, chains)
            per_prompt.append(replay(truth, first, blocks, confidences, merged, chains))
        summary = {  # pooled over prompts, as the runtime's stats and `hyperdflash eval` pool tau
            key.replace(" copied", " copied share"): sum(taus[key][0] for taus in per_prompt)
            / sum(taus[key][1] for taus in per_prompt)
            for key in per_prompt[0]
        }
        gain = summary["bound"] - summary["drafter"]
        for rule in ("chooser", "chooser, whole blocks"):
            summary[f"{rule} bound share"] = (summary[rule] - summary["drafter"]) / gain if gain else 0.0
        summary["prompts"] = len(per_prompt)
        report["sets"][name] = summary
        print(
            f"| {name} ({len(per_prompt)}) | {summary['drafter']:.2f} | {summary['copy']:.2f} "
            f"| {summary['bound']:.2f} "
            + "".join(
                f"| {summary[rule]:.2f} ({summary[rule + ' copied share']:.0%}, {summary[rule + ' bound share']:.0%}) "
                for rule in ("chooser", "chooser, whole blocks")
            )
            + f"| {summary['merged']:.2f} | {summary['bound of three']:.2f} |",
            flush=True,
        )
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
