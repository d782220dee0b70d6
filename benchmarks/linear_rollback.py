"""What exact rollback of a linear-attention state costs, two ways, at each family's flagship head shapes.

Verification runs the block's k+1 tokens through the delta-rule kernel; the tokens after the first rejection must
then leave no trace in the recurrent state. Two ways to get the state after the accepted prefix:

- replay (what `cache_linear_attention.py` does): the verify forward runs the chunked kernel as usual; a rollback
  re-runs the one-token kernel over the accepted tokens from the forward's starting state ("replay by token"), or
  the chunked kernel over them ("chunked replay");
- per-token snapshots: the verify forward runs the kernel one token at a time, keeping the state after each, so a
  rollback only picks one.

Per step (one layer, CPU, fp32), the median time of the verify kernel plus the rollback, over every accepted length
0..k, against the chunked kernel alone. Both are exact; the cheaper one wins.

python benchmarks/linear_rollback.py [--block 8] [--repeats 20]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import transformers.models.glm5_next.modeling_glm5_next as glm5_next
import transformers.models.qwen4_exp.modeling_qwen4_exp as qwen4_exp
from transformers import Glm5NextConfig, Qwen4ExpTextConfig


def kernel_inputs(family: str, tokens: int, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Random kernel inputs `[1, S, heads, dim]` and a starting state at the family's flagship shapes."""
    if family == "GLM-5-Next (KDA)":
        config = Glm5NextConfig().text_config
        heads, key_dim, value_dim = config.linear_num_heads, config.linear_head_dim, config.linear_head_dim
        g = -F.softplus(torch.randn(1, tokens, heads, key_dim, generator=generator))  # per key dimension
    else:
        config = Qwen4ExpTextConfig()
        heads, key_dim, value_dim = (
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        g = -F.softplus(torch.randn(1, tokens, heads, generator=generator))  # per head
    inputs = {
        "query": torch.randn(1, tokens, heads, key_dim, generator=generator),
        "key": torch.randn(1, tokens, heads, key_dim, generator=generator),
        "value": torch.randn(1, tokens, heads, value_dim, generator=generator),
        "g": g,
        "beta": torch.rand(1, tokens, heads, generator=generator),
    }
    return inputs, torch.randn(1, heads, key_dim, value_dim, generator=generator)


KERNELS = {
    "GLM-5-Next (KDA)": (glm5_next.chunk_kimi_delta_attention, glm5_next.recurrent_kimi_delta_attention),
    "Qwen4-Exp (GatedDeltaNet)": (qwen4_exp.torch_chunk_gated_delta_rule, qwen4_exp.torch_recurrent_gated_delta_rule),
}


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _run(kernel, inputs: dict, state: torch.Tensor, first: int | None = None) -> torch.Tensor:
    """The state after the first `first` tokens (all when None), from `state`."""
    inputs = {name: t[:, :first] for name, t in inputs.items()}
    return kernel(**inputs, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)[1]


def _replay(chunk, replay_kernel, inputs: dict, state: torch.Tensor, accepted: int) -> None:
    _run(chunk, inputs, state)  # the verify forward
    if replay_kernel is chunk:
        if accepted:
            _run(chunk, inputs, state, accepted)  # the rollback, chunked
        return
    for i in range(accepted):  # the rollback, token by token
        state = _run(replay_kernel, {name: t[:, i : i + 1] for name, t in inputs.items()}, state)


def _snapshots(recurrent, inputs: dict, state: torch.Tensor) -> None:
    for i in range(inputs["query"].shape[1]):  # the verify forward, token by token; the rollback is a pick
        state = _run(recurrent, {name: t[:, i : i + 1] for name, t in inputs.items()}, state)


def measure(family: str, block: int, repeats: int) -> dict[str, float]:
    chunk, recurrent = KERNELS[family]
    times = {"chunked verify only": [], "replay by token": [], "chunked replay": [], "per-token snapshots": []}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        inputs, state = kernel_inputs(family, block, generator)
        for accepted in range(block + 1):
            times["chunked verify only"].append(_timed(_run, chunk, inputs, state))
            times["replay by token"].append(_timed(_replay, chunk, recurrent, inputs, state, accepted))
            times["chunked replay"].append(_timed(_replay, chunk, chunk, inputs, state, accepted))
            times["per-token snapshots"].append(_timed(_snapshots, recurrent, inputs, state))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=8, help="tokens per verify forward (drafts + 1)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one linear-attention layer, verify of {args.block} tokens, CPU fp32, medians over accepted lengths:")
    for family in KERNELS:
        result = measure(family, args.block, args.repeats)
        base = result["chunked verify only"]
        cells = ", ".join(f"{name} {value / base:.2f}x" for name, value in result.items())
        print(f"  {family}: {cells} (of the chunked verify alone)")


if __name__ == "__main__":
    main()
