"""The device check: losslessness, tau and speedup of the shipped pair on one device, and with the target split.

    python benchmarks/gpu.py                  # a CUDA machine: bf16, then the target split over GPU and CPU
    python benchmarks/gpu.py --device cpu     # the small CPU version (CI runs it): fp32, split over CPU and disk
    python benchmarks/gpu.py --dtype float32 --no-split --schedules adaptive constant   # fp32 CUDA, both schedules

Two settings, each on held-out ShareGPT prompts with the shipped HyperDFlash drafter, plain and speculative greedy
decoding interleaved (medians over repeats):

- `single`: target and drafter on `--device` (bf16 on CUDA, fp32 on CPU);
- `split`: the target dispatched by accelerate with `device_map="auto"` and a `max_memory` that forces part of it
  off the first device (GPU -> CPU on CUDA; CPU -> disk offload with `--device cpu`), the drafter next to the
  target's last layer, where the captured residual lives.

Prints one JSON object: per setting `lossless` (share of prompts whose speculative output equals plain decoding's),
`tau`, `speedup` (median per-prompt ratio), the devices used, and top-level `lossless`, `tau`, `speedup` of the
single-device run. With several `--schedules`, the single-device setting runs once per draft schedule
(`single-constant` for the constant one). A CUDA run takes about 3 minutes (budget: under 8); the CPU version about 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference
from hf_hyperdflash.demo import compare_decoding
from hf_hyperdflash.modeling.draft_options import ADAPTIVE_SCHEDULE, SCHEDULES
from hf_hyperdflash.modeling.targets import get_target_adapter
from hf_hyperdflash.prompts import encode_prompt, load_prompts

SIZES = {
    "cuda": {"prompts": 8, "max_new_tokens": 128, "repeats": 3},
    "cpu": {"prompts": 2, "max_new_tokens": 48, "repeats": 2},
}


def measure(target, drafter, prompts: list[list[int]], max_new_tokens: int, repeats: int) -> dict:
    results = [compare_decoding(target, drafter, torch.tensor([p]), max_new_tokens, repeats) for p in prompts]
    return {
        "lossless": sum(r.identical for r in results) / len(results),
        "tau": statistics.mean(r.tau for r in results),
        "speedup": statistics.median(r.speedup for r in results),
    }


def load_drafter_for(target, dtype: torch.dtype):
    """The shipped HyperDFlash drafter, placed where the target's last layer (and so the captured residual) is."""
    device = get_target_adapter(target).feature_device
    return AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=dtype).to(device).eval()


def split_target(device: str, dtype: torch.dtype, offload_folder: str):
    """The target with its first layers on `device` (CUDA) or CPU, and the rest on CPU (CUDA) or disk (CPU)."""
    if device == "cuda":
        max_memory = {0: "12MB", "cpu": "8GB"}  # of the 22 MB bf16 target: the rest runs from CPU
    else:
        max_memory = {"cpu": "30MB"}  # of the 43 MB fp32 target: the last layers and the head go to disk
    return AutoModelForCausalLM.from_pretrained(
        reference.target_path(), dtype=dtype, device_map="auto", max_memory=max_memory, offload_folder=offload_folder
    ).eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--prompts", default="sharegpt", help="'sharegpt' (its held-out split) or a JSONL file of chats ('messages')"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--no-split", action="store_true", help="skip the split-target setting")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=[ADAPTIVE_SCHEDULE])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device here; run with --device cpu for the small CPU version.")
    size = SIZES[args.device]
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
    messages = load_prompts(args.prompts, "held_out", size["prompts"], max_chars=2000)
    prompts = [encode_prompt(tokenizer, m, enable_thinking=False) for m in messages]
    timing = {"max_new_tokens": size["max_new_tokens"], "repeats": size["repeats"]}
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": str(dtype)}

    target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=dtype).to(args.device).eval()
    drafter = load_drafter_for(target, dtype)
    names = ["single" if schedule == ADAPTIVE_SCHEDULE else f"single-{schedule}" for schedule in args.schedules]
    for name, schedule in zip(names, args.schedules, strict=True):
        drafter.generation_config.num_assistant_tokens_schedule = schedule
        report[name] = {"schedule": schedule, **measure(target, drafter, prompts, **timing)}
    del target
    if not args.no_split:  # the drafter's default schedule
        with tempfile.TemporaryDirectory() as offload_folder:
            target = split_target(args.device, dtype, offload_folder)
            devices = sorted({str(device) for device in target.hf_device_map.values()})
            if len(devices) < 2:
                raise RuntimeError(f"max_memory did not split the target: {target.hf_device_map}")
            drafter = load_drafter_for(target, dtype)
            report["split"] = {"devices": devices, **measure(target, drafter, prompts, **timing)}
    report |= {key: report[names[0]][key] for key in ("lossless", "tau", "speedup")}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
