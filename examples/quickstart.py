"""The API in a dozen lines: speculative decoding on the shipped reference pair, checked against plain decoding.

python examples/quickstart.py
"""

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import hf_hyperdflash  # noqa: F401  (makes generate() understand HyperDFlash drafters)
from hf_hyperdflash import reference

tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32)
drafter_dir = reference.mtp_path()  # the native MTP; reference.drafter_path("hyperdflash") once shipped
drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True, dtype=torch.float32)

messages = [{"role": "user", "content": "What is speculative decoding?"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)
fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("identical to plain decoding:", torch.equal(plain, fast))
print("stats:", {k: v for k, v in drafter.last_generation_stats.items() if not k.endswith("_per_step")})
