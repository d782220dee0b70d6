"""The API in a dozen lines: speculative decoding on the shipped reference pair, checked against plain decoding.

    python examples/quickstart.py

`hf_hyperdflash` is imported only to locate the shipped models; a drafter from the Hub or a saved folder needs no
import at all (see publish_and_load.py).
"""

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from hf_hyperdflash import reference

tokenizer = AutoTokenizer.from_pretrained(reference.tokenizer_path())
target = AutoModelForCausalLM.from_pretrained(reference.target_path(), dtype=torch.float32)
drafter = AutoModel.from_pretrained(reference.drafter_path("hyperdflash"), trust_remote_code=True, dtype=torch.float32)

messages = [{"role": "user", "content": "How do I make a good cup of coffee at home?"}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
plain = target.generate(**inputs, max_new_tokens=64, do_sample=False)
fast = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)

print(tokenizer.decode(fast[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print("identical to plain decoding:", torch.equal(plain, fast))
print(drafter.last_generation_stats)  # tau, acceptance per position, target forwards, new tokens, seconds
