"""Speculative decoding on a target spread over processes by transformers' tensor or expert parallel plans (under
`torchrun`, one process per device, on one node or several): the ranks must agree on every token.

Every rank runs the same generate() and the target's forwards meet in collectives, so a rank that drafts, accepts,
samples or stops otherwise than the others desynchronises the job (shards of different sequences combined, or a
collective that waits forever). `RankAgreement` is what holds them together, and a no-op in one process:

- a call opens with one collective (`open_call`): every rank runs the call's checks and computes fingerprints of its
  inputs, settings and drafter; an error on any rank, or a fingerprint that differs, raises the same error on every
  rank; every rank then continues from rank 0's random state;
- what a step decides is decided on rank 0 and sent in one packed int64 tensor (`decide`): the drafts and their
  length before the verify forward, the verdict on them and the bonus token when sampling, the stop flags when a
  stopping criterion can differ per rank (`max_time`, a custom one). The packet travels by one all-reduce (MAX: the
  other ranks contribute the lowest int64), which also carries every rank's failure flag and a view of its sequence
  state (so ranks that parted raise instead of going on apart). Nothing is pickled per step; a failure, the rare
  path, gathers every rank's message and every rank raises the same error.

The ranks are those that run one copy of the target together (its tensor and expert parallel group); copies that
replicate it (`dp_replicate_size`, training) decode their own prompts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

T = TypeVar("T")
_NOT_MINE = torch.iinfo(torch.int64).min  # what a rank other than 0 puts in a decision: the MAX keeps rank 0's
# Criteria whose verdict is a function of the tokens alone: every rank holding the same tokens stops alike
TOKEN_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria)


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


class RankAgreement:
    """One generate() call's agreement between the ranks of a spread target (`group`; None: one process, where every
    method just runs what it is given)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        # What the agreement cost this call (benchmarks/distributed.py): collectives, and seconds spent in them
        self.collectives = 0
        self.seconds = 0.0

    @classmethod
    def of(cls, model: nn.Module) -> RankAgreement:
        return cls(spread_group(model))

    @property
    def spread(self) -> bool:
        return self.group is not None

    @property
    def decides(self) -> bool:
        """This process is the one whose decisions every rank keeps (rank 0 of the group, or the only process)."""
        return self.group is None or dist.get_rank(self.group) == 0

    @property
    def device(self) -> torch.device:
        """Where a packet must live for the group's backend (NCCL moves CUDA tensors only)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def open_call(self, prepare: Callable[[], T], fingerprints: Callable[[], dict[str, str]]) -> T:
        """Run the call's checks (`prepare`, whose result is returned) and compute `fingerprints()` on every rank, in
        one collective: if either raised on any rank, every rank raises the same error; if a fingerprint differs,
        every rank raises a `ValueError` naming it; else every rank continues from rank 0's random state. In one
        process: `prepare()` alone."""
        if not self.spread:
            return prepare()
        failure, prints, prepared = None, {}, None
        try:
            prints = fingerprints()
            prepared = prepare()
        except Exception as error:  # reaches every rank below
            failure = error
        state = _random_state() if self.decides else None
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (_described(failure), prints, state), group=self.group)
        self.collectives += 1
        _raise_failures("Checking the call", [entry[0] for entry in everyone], failure)
        differing = sorted(name for name in prints if len({entry[1].get(name) for entry in everyone}) > 1)
        if differing:
            raise ValueError(
                f"The {len(everyone)} processes running this spread target called generate() with different "
                f"{', '.join(differing)}: every rank must pass the same inputs and settings, and load the drafter "
                "from the same files (a drafter trained or changed on one rank only differs)."
            )
        _set_random_state(everyone[0][2])
        return prepared

    def decide(
        self,
        what: str,
        compute: Callable[[], torch.Tensor],
        size: int,
        state: torch.Tensor | None = None,
        everyone_computes: bool = True,
    ) -> torch.Tensor:
        """Rank 0's `compute()` (a 1-D int64 tensor of `size` values) on every rank, by one all-reduce. `compute`
        runs on every rank (or on rank 0 only, `everyone_computes=False`); if it raises on any rank, every rank
        raises the same error. `state`: a few int64 values that every rank must hold alike (sequence lengths, a
        digest of the tokens); if they differ, every rank raises. In one process: `compute()`."""
        if not self.spread:
            return compute()
        state = torch.zeros(0, dtype=torch.long) if state is None else state.to("cpu", torch.long).reshape(-1)
        failure, values = None, None
        if everyone_computes or self.decides:
            try:
                values = compute().to("cpu", torch.long).reshape(-1)
                if values.numel() != size:
                    raise RuntimeError(f"{what}: a decision of {values.numel()} values where {size} were agreed")
            except Exception as error:  # reaches every rank below
                failure = error
        mine = values if self.decides and failure is None else torch.full((size,), _NOT_MINE)
        start = time.perf_counter()
        packet = torch.cat([torch.tensor([int(failure is not None)]), state, -state, mine]).to(self.device)
        dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=self.group)
        packet = packet.cpu()
        self.collectives += 1
        self.seconds += time.perf_counter() - start
        if packet[0]:
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, _described(failure), group=self.group)
            _raise_failures(what, everyone, failure)
        n = state.numel()
        if not torch.equal(packet[1 : 1 + n], -packet[1 + n : 1 + 2 * n]):
            raise RuntimeError(
                f"{what}: the ranks of this spread target hold different tokens (something on one rank changed what "
                "it decoded outside the package's agreement); stopping every rank rather than decoding on apart."
            )
        return packet[1 + 2 * n :]

    def compare(self, what: str, state: torch.Tensor) -> None:
        """Every rank holds the same `state` (else every rank raises), with no decision: one collective."""
        self.decide(what, lambda: torch.zeros(0, dtype=torch.long), 0, state=state)

    def first_decides(self, what: str, action: Callable[[], T]) -> T:
        """`action()` on rank 0 (a picklable result), handed to every rank; an error there raises on every rank. For
        work done once per call by one process, such as reading and checking a shard."""
        if not self.spread:
            return action()
        failure, result = None, None
        if self.decides:
            try:
                result = action()
            except Exception as error:  # reaches every rank below
                failure = error
        shared = [(_described(failure), result)]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.collectives += 1
        _raise_failures(what, [shared[0][0]], failure)
        return shared[0][1]


def stops_alike(criteria) -> bool:
    """Every criterion is a function of the tokens, so ranks holding the same tokens stop alike without agreeing."""
    return all(isinstance(criterion, TOKEN_CRITERIA) for criterion in criteria)


def floats_as_int64(values: torch.Tensor | list[float]) -> torch.LongTensor:
    """Floats as the int64 bits of their float64 values, to travel in a decision's packet (`int64_as_floats`)."""
    return torch.as_tensor(values, dtype=torch.float64).cpu().reshape(-1).view(torch.int64)


def int64_as_floats(packet: torch.LongTensor) -> torch.Tensor:
    return packet.contiguous().view(torch.float64)


class TokenDigest:
    """A running SHA-256 of the tokens each row of a call committed, in order, fed only what is new at each step. Its
    `state` travels in each step's collective and once after the last step, so ranks that hold different tokens (a
    verdict that differs on one rank) raise instead of returning different sequences."""

    def __init__(self):
        self.hash = hashlib.sha256()

    def add(self, rows: list[list[int]]) -> None:
        """Every row's newly committed tokens (an empty list: none)."""
        self.hash.update(repr(rows).encode())

    def state(self, lengths: list[int]) -> torch.Tensor:
        """The rows' lengths and 62 bits of the digest (so its negation fits an int64), as `decide` compares them."""
        value = int.from_bytes(self.hash.digest()[:8], "little") >> 2
        return torch.tensor([*lengths, value])


def _described(error: BaseException | None) -> tuple[int, str, str] | None:
    if error is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, type(error).__name__, str(error)


def _raise_failures(what: str, described: list, own: BaseException | None) -> None:
    """Raise on every rank what failed on some: the error as it is when every failing rank raised the same one
    (a settings check), else a `RuntimeError` naming the ranks and their errors."""
    failures = [entry for entry in described if entry is not None]
    if not failures:
        return
    kinds = {(kind, message) for _, kind, message in failures}
    if len(kinds) == 1 and len(failures) == len(described):
        kind, message = next(iter(kinds))
        error = ValueError(message) if kind == "ValueError" else RuntimeError(f"{what} failed: {kind}: {message}")
    else:
        details = "; ".join(f"rank {rank}: {kind}: {message}" for rank, kind, message in failures)
        error = RuntimeError(f"{what} failed on a rank of this spread target, so every rank stops: {details}")
    raise error from own


def _random_state() -> list:
    return [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None]


def _set_random_state(state: list) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def text_fingerprint(text: str) -> str:
    """A short digest of a text (serialised settings)."""
    return _digest(text.encode())


def tensor_fingerprint(tensor: torch.Tensor | None) -> str:
    """A short digest of an input tensor's shape, dtype and bytes (a prompt, a mask, pixel values)."""
    if tensor is None:
        return "none"
    digest = hashlib.sha256(repr((tuple(tensor.shape), str(tensor.dtype))).encode())
    _hash_bytes(digest, tensor)
    return digest.hexdigest()[:16]


_HASH_CHUNK = 1 << 20  # bytes of a tensor hashed at a time: what is copied off an accelerator at once, at most


def _hash_bytes(digest: hashlib._Hash, tensor: torch.Tensor) -> None:
    """Feed `tensor`'s bytes to `digest` as they lie in memory (a CPU tensor is read in place, without a copy; one
    on an accelerator comes over a chunk at a time)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, data.numel(), _HASH_CHUNK):
        chunk = data[start : start + _HASH_CHUNK]
        digest.update(chunk.cpu().numpy() if chunk.device.type != "cpu" else chunk.numpy())


def weights_fingerprint(model: nn.Module | None) -> str:
    """A digest of a model's parameter names, shapes, dtypes and bytes, read in place, and again only when a parameter
    changes (replaced, or written in place: its version moves), so every call can afford it; a weight that differs
    on one rank by a single bit changes it."""
    if model is None:
        return "none"
    parameters = list(model.named_parameters())
    state = [(name, id(p), p.data_ptr(), p._version) for name, p in parameters]
    cached = getattr(model, "_weights_fingerprint", None)
    if cached is not None and cached[0] == state:
        return cached[1]
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in parameters:
            digest.update(f"{name} {tuple(parameter.shape)} {parameter.dtype}".encode())
            _hash_bytes(digest, parameter)
    value = digest.hexdigest()[:16]
    model._weights_fingerprint = (state, value)
    return value
