"""Publish a drafter and use it the way a Hub user does: a fresh process, no `import hf_hyperdflash`.

    python examples/publish_and_load.py [FOLDER]

Saves the shipped HyperDFlash drafter with `save_pretrained` (weights, the runtime as remote code, a model card)
into FOLDER (default: a temporary folder, removed at the end), then starts a new Python process that loads it with
`trust_remote_code=True` and decodes with it. `drafter.push_to_hub("org/name")` uploads the same folder.
"""

import subprocess
import sys
import tempfile
import textwrap
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModel

from hf_hyperdflash import reference

with nullcontext(sys.argv[1]) if len(sys.argv) > 1 else tempfile.TemporaryDirectory() as parent:
    folder = Path(parent) / "hyperdflash-reference"
    drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), dtype=torch.bfloat16)
    drafter.save_pretrained(folder)
    print(f"saved to {folder}: {sorted(p.name for p in folder.iterdir())}")

    user_code = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(reference.tokenizer_path())!r})
        target = AutoModelForCausalLM.from_pretrained({str(reference.target_path())!r}, dtype=torch.float32)
        drafter = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32)
        messages = [{{"role": "user", "content": "What is speculative decoding?"}}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=48, do_sample=False)
        plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
        print("library imported:", "hf_hyperdflash" in sys.modules, "| drafter class from:", type(drafter).__module__)
        print("identical to plain decoding:", torch.equal(out, plain))
        print(drafter.last_generation_stats)
        """
    )
    subprocess.run([sys.executable, "-c", user_code], check=True)
