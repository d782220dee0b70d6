"""What one weights fingerprint (`rank_agreement.weights_fingerprint`, every speculative call on a spread target)
allocates beyond the model: the process's peak resident memory before and after, in a fresh process per model, with
the model's weights resident before (safetensors loads them memory-mapped from the file; reading a page the first
time makes it resident, which is the weights, not the fingerprint).

    python benchmarks/fingerprint_memory.py

Models: the shipped HyperDFlash drafter (bf16) and a stand-in with one 4096 x 4096 bf16 weight (32 MiB), where a
float64 copy of a weight would show as 128 MiB or more.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MEASURE = """
import json, resource, sys, torch
from torch import nn
from transformers import AutoModel
from hf_hyperdflash import reference
from hf_hyperdflash.modeling.rank_agreement import weights_fingerprint
torch.set_num_threads(1)
if sys.argv[1] == "drafter":
    model = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.bfloat16)
else:
    model = nn.Linear(4096, 4096, bias=False).to(torch.bfloat16)
size = sum(p.numel() * p.element_size() for p in model.parameters())
weights_fingerprint(nn.Linear(64, 64).to(torch.bfloat16))  # first-call allocations of the code, outside the measure
for parameter in model.parameters():  # page in weights loaded from a memory-mapped file, as a model that ran has them
    parameter.detach().sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights_fingerprint(model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model": sys.argv[1], "model_bytes": size, "extra_peak_bytes": after - before}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print("| model | weights (MiB) | extra peak memory (MiB) | share of the weights |")
    print("|---|---|---|---|")
    for model in ("drafter", "linear"):
        out = subprocess.run([sys.executable, "-c", MEASURE, model], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        share = row["extra_peak_bytes"] / row["model_bytes"]
        print(f"| {model} | {row['model_bytes'] / 2**20:.1f} | {row['extra_peak_bytes'] / 2**20:.2f} | {share:.3f} |")


if __name__ == "__main__":
    main()
