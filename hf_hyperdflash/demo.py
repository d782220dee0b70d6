"""The quick-start job: one reply from the shipped reference pair, with and without the drafter.

Prints both texts (they must be identical), tau and the measured speedup (median over repeats,
plain and speculative runs interleaved so machine noise hits both alike).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers load when the demo runs, not when `hyperdflash --help` builds its parser
    import torch
    from transformers import PreTrainedModel

DEFAULT_PROMPT = "Write a short guide on how to make a good cup of coffee at home."
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_REPEATS = 3
# `time hyperdflash demo` at the defaults on an idle 2-core CPU (torch's default threads): 12.5-16.4 s in all over
# four runs, of which about 6 s import torch and transformers and load the models; the rest is decoding, which
# scales with tokens x repeats.
MEASURED_SECONDS = {"total": 13.0, "load": 6.0}


def expected_duration(max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, repeats: int = DEFAULT_REPEATS) -> str:
    """What the demo does and about how long it takes on a small CPU, e.g. for a line printed before it starts."""
    decoding = MEASURED_SECONDS["total"] - MEASURED_SECONDS["load"]
    seconds = MEASURED_SECONDS["load"] + decoding * max_new_tokens * repeats / (
        DEFAULT_MAX_NEW_TOKENS * DEFAULT_REPEATS
    )
    runs = f"{repeats} repeat{'' if repeats == 1 else 's'}"
    return f"{max_new_tokens} tokens x {runs}, plain and speculative; about {seconds:.0f} s on 2 CPU cores"


def load_reference_pair(drafter: str = "auto") -> tuple:
    """(tokenizer, target, drafter, drafter_name) in float32 on CPU; `auto` picks the best shipped drafter."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from . import reference
    from .modeling.strict_loading import check_drafter_path

    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32).eval()
    candidates = [drafter] if drafter != "auto" else ["hyperdflash", "mtp"]
    for name in candidates:
        try:
            path = reference.mtp_path() if name == "mtp" else reference.drafter_path(name)
        except FileNotFoundError:
            if drafter != "auto":
                raise
            continue
        check_drafter_path(path)  # a shipped drafter without its weights is an incomplete install, said in one line
        model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
        return tokenizer, target, model, name
    raise FileNotFoundError("No reference drafter is shipped with this installation.")


@dataclass
class DemoResult:
    plain_text: str
    speculative_text: str
    identical: bool
    tau: float
    copied_share: float
    speedup: float
    plain_seconds: float
    speculative_seconds: float
    new_tokens: int


def _timed(fn) -> tuple[float, torch.Tensor]:
    from .modeling.generation_stats import synchronized_clock  # waits for queued CUDA kernels

    start = synchronized_clock()
    out = fn()
    return synchronized_clock() - start, out


@dataclass
class Comparison:
    """Plain and speculative greedy decoding of one prompt, timed interleaved (medians over repeats)."""

    plain: torch.Tensor
    speculative: torch.Tensor
    plain_seconds: float
    speculative_seconds: float
    tau: float
    copied_share: float  # of the verify steps, those whose drafts were copied from the context

    @property
    def identical(self) -> bool:
        return bool((self.plain.shape == self.speculative.shape) and (self.plain == self.speculative).all())

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.speculative_seconds


def compare_decoding(
    target: PreTrainedModel, drafter: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, repeats: int
) -> Comparison:
    """Warm up, then alternate plain and speculative runs so that machine noise hits both alike."""
    input_ids = input_ids.to(target.device)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False)
    plain_times, spec_times = [], []
    target.generate(input_ids, max_new_tokens=4, do_sample=False)  # warm-up
    target.generate(input_ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    for _ in range(repeats):
        seconds, plain = _timed(lambda: target.generate(input_ids, **settings))
        plain_times.append(seconds)
        seconds, speculative = _timed(lambda: target.generate(input_ids, assistant_model=drafter, **settings))
        spec_times.append(seconds)
    return Comparison(
        plain=plain.cpu(),
        speculative=speculative.cpu(),
        plain_seconds=statistics.median(plain_times),
        speculative_seconds=statistics.median(spec_times),
        tau=drafter.last_generation_stats.mean_accepted_length,
        copied_share=_copied_share(drafter.last_generation_stats),
    )


def _copied_share(stats) -> float:
    steps = len(stats.accepted_per_step)
    return stats.copied_steps / steps if steps else 0.0


def run_demo(
    tokenizer,
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompt: str = DEFAULT_PROMPT,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    repeats: int = DEFAULT_REPEATS,
    thinking: bool = False,
) -> DemoResult:
    messages = [{"role": "user", "content": prompt}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=thinking, return_tensors="pt", return_dict=True
    )["input_ids"]
    result = compare_decoding(target, drafter, input_ids, max_new_tokens, repeats)
    prompt_length = input_ids.shape[1]
    return DemoResult(
        plain_text=tokenizer.decode(result.plain[0, prompt_length:], skip_special_tokens=True),
        speculative_text=tokenizer.decode(result.speculative[0, prompt_length:], skip_special_tokens=True),
        identical=result.identical,
        tau=result.tau,
        copied_share=result.copied_share,
        speedup=result.speedup,
        plain_seconds=result.plain_seconds,
        speculative_seconds=result.speculative_seconds,
        new_tokens=int(result.plain.shape[1] - prompt_length),
    )
