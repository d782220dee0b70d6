"""What keeps the ranks of a spread target in step (`modeling/rank_agreement.py`), in one process: the fingerprints,
and the check that names what differs. Real launches over 2 processes: `tests/test_distributed.py` (slow)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hf_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.modeling import rank_agreement


def test_a_weight_changed_anywhere_changes_the_drafters_fingerprint(target):
    torch.manual_seed(0)
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4)
    before = rank_agreement.weights_fingerprint(drafter)
    assert rank_agreement.weights_fingerprint(drafter) == before
    with torch.no_grad():
        list(drafter.parameters())[-1].view(-1)[3] += 1e-4
    assert rank_agreement.weights_fingerprint(drafter) != before
    prompt = torch.tensor([[5, 6, 7]])
    assert rank_agreement.tensor_fingerprint(prompt) != rank_agreement.tensor_fingerprint(prompt.flip(-1))
    assert rank_agreement.tensor_fingerprint(prompt) != rank_agreement.tensor_fingerprint(prompt[:, :2])


def test_a_target_in_one_process_needs_no_agreement(target):
    assert rank_agreement.spread_group(target) is None
    rank_agreement.check_ranks_agree(target, lambda: {"prompts": "a"})  # no process group: nothing compared or raised


def test_the_check_names_what_the_ranks_disagree_on(target, monkeypatch, tmp_path):
    """One real (single-rank gloo) group, and a second rank's fingerprints as all_gather would bring them."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(target, "_device_mesh", init_device_mesh("cpu", (1,)), raising=False)
        assert rank_agreement.spread_group(target) is dist.group.WORLD
        mine = {"prompts": "a", "drafter weights": "b"}
        rank_agreement.check_ranks_agree(target, lambda: mine)  # one rank agrees with itself

        def gather(into, fingerprints, group=None):
            into[:] = [fingerprints, {**fingerprints, "drafter weights": "c"}]

        monkeypatch.setattr(dist, "all_gather_object", gather)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(rank_agreement, "spread_group", lambda model: dist.group.WORLD)
        with pytest.raises(ValueError, match="different drafter weights: every rank must"):
            rank_agreement.check_ranks_agree(target, lambda: mine)
    finally:
        dist.destroy_process_group()
