"""Speculative decoding on a target spread over processes by transformers' tensor or expert parallel plans (under
`torchrun`, one process per device, on one node or several): the ranks must agree on every token.

Every rank runs the same generate() and the target's forwards meet in collectives, so a rank that drafts, accepts or
samples another token than the others desynchronises the job (wrong shards combined, or a collective that waits
forever). Given the same prompt, drafter and settings the ranks compute the same features, drafts and logits (a
tensor-parallel reduction hands every rank the same sum), so what can part them is what differs per process:

- before anything else, one collective compares fingerprints of the prompt, the settings and the drafter's weights
  (`check_ranks_agree`), and if they differ every rank raises the same `ValueError` (a rank raising alone would leave
  the others waiting in the target's first collective);
- one rank decides the randomness: rank 0's random state goes to every rank (`share_random_state`), and when
  sampling, rank 0's verdict on each step's drafts (transformers' `_speculative_sampling`) is the one every rank keeps
  (`rank_zero_verdict`).

The ranks are those that run one copy of the target together (its tensor and expert parallel group); copies that
replicate it (`dp_replicate_size`, training) decode their own prompts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def spread_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The processes that run one copy of a target spread by transformers (`from_pretrained(tp_plan=...)` or a
    `distributed_config`, which set its `_device_mesh` over them); None for a target in one process."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    spread = [dim for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    if len(spread) != 1:
        raise ValueError(
            f"This target is spread over a mesh of shape {tuple(mesh.shape)} inside one copy; speculative decoding "
            "keeps the ranks of one parallel dimension in step (tensor or expert parallel): use one of them."
        )
    return mesh.get_group(spread[0])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def text_fingerprint(text: str) -> str:
    """A short digest of a text (serialised settings)."""
    return _digest(text.encode())


def tensor_fingerprint(tensor: torch.Tensor | None) -> str:
    """A short digest of a small tensor's shape and values (a prompt, a mask)."""
    if tensor is None:
        return "none"
    data = tensor.detach().cpu().contiguous()
    return _digest(repr(tuple(data.shape)).encode() + data.numpy().tobytes())


_MOMENT_CHUNK = 1 << 14  # elements cast to float64 at a time: 256 KB in flight at most, whatever the model's size


def _moments(parameter: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares] of a parameter in float64, a chunk at a time (no float64 copy of the whole weight)."""
    flat = parameter.detach().reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _MOMENT_CHUNK):
        chunk = flat[start : start + _MOMENT_CHUNK].double()
        total += torch.stack([chunk.sum(), chunk.square().sum()])
    return total


def weights_fingerprint(model: nn.Module | None) -> str:
    """A digest of a model's parameter names, shapes and per-parameter sums and sums of squares (float64), computed
    a chunk at a time, and again only when a parameter changes (replaced, or written in place: its version moves), so
    every call can afford it; a weight that differs on one rank changes it."""
    if model is None:
        return "none"
    parameters = list(model.named_parameters())
    state = [(name, id(p), p.data_ptr(), p._version) for name, p in parameters]
    cached = getattr(model, "_weights_fingerprint", None)
    if cached is not None and cached[0] == state:
        return cached[1]
    with torch.no_grad():
        values = [_moments(p).cpu().tolist() for _, p in parameters]
    names = [(name, tuple(p.shape)) for name, p in parameters]
    digest = text_fingerprint(json.dumps([names, values]))
    model._weights_fingerprint = (state, digest)
    return digest


def check_ranks_agree(model: nn.Module, fingerprints: Callable[[], dict[str, str]]) -> None:
    """On a spread target: raise the same `ValueError` on every rank, naming what differs, if the ranks'
    `fingerprints()` differ; else give every rank rank 0's random state. A no-op in one process, which computes no
    fingerprint."""
    group = spread_group(model)
    if group is None:
        return
    fingerprints = fingerprints()
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, fingerprints, group=group)
    differing = sorted(name for name in fingerprints if len({ranks[name] for ranks in everyone}) > 1)
    if differing:
        raise ValueError(
            f"The {len(everyone)} processes running this spread target called generate() with different "
            f"{', '.join(differing)}: every rank must pass the same prompt and settings, and load the drafter from "
            "the same files (a drafter trained or changed on one rank only differs)."
        )
    share_random_state(group)


def share_random_state(group: dist.ProcessGroup) -> None:
    """Every rank continues from rank 0's random state (CPU, and the current CUDA device's), so whatever each rank
    samples from the same distributions, it samples the same."""
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def broadcast_from_rank_zero(group: dist.ProcessGroup, value: object) -> object:
    """The group's first process's `value` (any picklable object), on every process of the group."""
    shared = [value]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return shared[0]


def rank_zero_verdict(group: dist.ProcessGroup) -> Callable:
    """A replacement for transformers' `_speculative_sampling` (`call_scope.functions`): rank 0's accepted tokens and
    count, broadcast to every rank, whatever the others drew."""

    def verify(original: Callable, *args, **kwargs):
        valid_tokens, n_matches = original(*args, **kwargs)
        tokens, count = broadcast_from_rank_zero(group, (valid_tokens.cpu(), int(n_matches)))
        return tokens.to(valid_tokens.device), torch.as_tensor(count, device=n_matches.device)

    return verify
