"""Does a deeper mHC target open the gap between HyperDFlash and vanilla DFlash? Step 1: grow the target.

    python benchmarks/deeper_target.py --out runs/deeper_target     # ~45 min, one thread; resumes

The reference target has 4 layers, so DFlash's layer rule conditions vanilla DFlash on layer 1 alone, two
layers below the final residual. This grows the trained 4-layer target into a deeper one by duplicating
layers (depth up-scaling; the default order 0,1,1,2,2,3 gives 6 layers, for which the rule picks layers 1 and 3)
and trains it on for `--steps` on the reference's packed rows. Then, as in docs/reference.md, "Build (rebuild the
reference)":

    hyperdflash train --config configs/ablations/hyperdflash.json --target runs/deeper_target/target \\
        --tokenizer runs/reference/tokenizer --data-dir runs/deeper_target/data \\
        --output-dir runs/deeper_target/hyperdflash
    (the same with configs/ablations/vanilla_dflash.json and --output-dir runs/deeper_target/vanilla_dflash)
    hyperdflash eval --output-dir runs/deeper_target/eval --target runs/deeper_target/target \\
        --tokenizer runs/reference/tokenizer --mtp none --drafter vanilla_dflash=... --drafter hyperdflash=... \\
        --datasets sharegpt --num-prompts 20 --temperatures 0 --modes non-thinking --repeats 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from hf_hyperdflash.reference.build import packed_chunks, train_language_model
from hf_hyperdflash.training.loop import LoopConfig


def grown(source: DeepseekV4ForCausalLM, order: list[int]) -> DeepseekV4ForCausalLM:
    """A target whose layer i is a copy of `source` layer `order[i]`; everything else is shared as is."""
    config = source.config.to_dict()
    config |= {
        "num_hidden_layers": len(order),
        "layer_types": [source.config.layer_types[i] for i in order],
        "mlp_layer_types": [source.config.mlp_layer_types[i] for i in order],
    }
    model = DeepseekV4ForCausalLM(type(source.config).from_dict(config)).float()
    state = {}
    for key, value in source.state_dict().items():
        if not key.startswith("model.layers."):
            state[key] = value
            continue
        layer = int(key.split(".")[2])
        for new, old in enumerate(order):
            if old == layer:
                state[key.replace(f"model.layers.{layer}.", f"model.layers.{new}.", 1)] = value
    model.load_state_dict(state, strict=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=Path("runs/reference/target"), help="trained 4-layer target")
    parser.add_argument("--reference-dir", type=Path, default=Path("runs/reference"), help="tokenizer, packed rows")
    parser.add_argument("--order", default="0,1,1,2,2,3", help="source layer of each new layer")
    parser.add_argument("--steps", type=int, default=1000, help="training steps after growing")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("runs/deeper_target"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if (args.out / "target" / "config.json").exists():
        print(f"already built: {args.out / 'target'}")
        return
    order = [int(i) for i in args.order.split(",")]
    source = DeepseekV4ForCausalLM.from_pretrained(args.source, dtype=torch.float32)
    bad = [i for i in order if not 0 <= i < source.config.num_hidden_layers]
    if bad or not order:
        raise ValueError(f"--order must list source layers 0..{source.config.num_hidden_layers - 1}, got {order}.")
    recorded = args.out / "order.json"  # a resumed run must continue the same growth
    if recorded.exists() and json.loads(recorded.read_text()) != order:
        raise ValueError(f"{args.out} holds a run grown with order {recorded.read_text()}; use another --out.")
    args.out.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(order))
    tokenizer = AutoTokenizer.from_pretrained(args.reference_dir / "tokenizer")
    chunks = packed_chunks(tokenizer, args.reference_dir / "target_chunks.pt")
    loop = LoopConfig(
        total_steps=args.steps, batch_size=4, learning_rate=1e-3, warmup_steps=50, checkpoint_every=100, seed=2
    )
    title = f"{len(order)}-layer target"
    model = train_language_model(grown(source, order), chunks, args.out / "target_run", loop, title)
    model.save_pretrained(args.out / "target")
    print(f"{title} ({', '.join(map(str, order))}) trained {args.steps} steps: {args.out / 'target'}")


if __name__ == "__main__":
    main()
