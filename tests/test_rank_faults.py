"""Ranks that cannot drift or hang: per-rank differences injected after the shared state on a tiny DeepSeek-V4
spread by its TP plan over 2 processes (gloo), for one prompt and for a batch (`tests/distributed_faults.py`). Every
rank gets the same tokens, or every rank raises the same error within seconds; no launch runs past its time limit.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_hyperdflash.testing import free_port, new_drafter, tiny_deepseek_v4

pytestmark = pytest.mark.slow

RANK_SCRIPT = Path(__file__).parent / "distributed_faults.py"
LAUNCH_LIMIT_S = 600
MAX_TIME_TOKENS = 64  # distributed_faults.py
FAILS_WITHIN_S = 20  # an error on one rank reaches the other this fast (the process group would wait 60 s)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("faults")
    target = tiny_deepseek_v4(seed=3)
    target.save_pretrained(root / "target")
    drafter = new_drafter(target, "hyperdflash", block_size=4)
    drafter.generation_config.num_assistant_tokens_schedule = "constant"  # every step drafts
    drafter.save_pretrained(root / "hyperdflash")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launch += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command = [*launch, str(RANK_SCRIPT), str(root), str(root)]
    run = subprocess.run(command, capture_output=True, timeout=LAUNCH_LIMIT_S)
    assert run.returncode == 0, run.stderr.decode()[-4000:]
    return [json.loads((root / f"rank-{rank}.json").read_text()) for rank in range(2)]


LAYOUTS = ["one prompt", "batch"]


def both(ranks: list[dict], case: str, layout: str) -> tuple[dict, dict]:
    return ranks[0]["cases"][case][layout], ranks[1]["cases"][case][layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_random_stream_that_moves_on_one_rank_changes_no_token(ranks, layout):
    first, second = both(ranks, "random stream moves on", layout)
    assert first["tokens"] == second["tokens"] == ranks[0]["cases"]["sampled"][layout]["tokens"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafts_that_differ_on_one_rank_mid_call_are_rank_zeros_everywhere(ranks, layout):
    first, second = both(ranks, "drafts differ, shipped pair", layout)
    assert first["tokens"] == second["tokens"] == ranks[0]["cases"]["plain, shipped pair"][layout]["tokens"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafts_that_differ_on_one_rank_leave_every_rank_rank_zeros_schedule_and_stats(ranks, layout):
    """Rank 1's drafter is confident otherwise (the default, adaptive schedule): every rank's schedule still learns
    from rank 0's confidences, so both skip and verify alike and report the same stats."""
    first, second = both(ranks, "drafts differ, shipped pair", layout)
    assert first["stats"] == second["stats"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_verdict_that_differs_at_the_last_step_raises_on_every_rank(ranks, layout):
    """No step after the last would compare the ranks' tokens: a final check does."""
    for outcome in both(ranks, "verdict differs at the last step", layout):
        assert "hold different tokens" in outcome["error"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_drafter_set_to_another_length_on_one_rank_raises_on_every_rank(ranks, layout):
    for outcome in both(ranks, "drafter length", layout):
        assert outcome["error"].startswith("ValueError") and "drafter settings" in outcome["error"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_drafter_fault_on_one_rank_raises_the_same_error_on_every_rank_within_seconds(ranks, layout):
    first, second = both(ranks, "drafter fault", layout)
    assert first["error"] == second["error"]
    assert "rank 1: IndexError: injected drafter fault" in first["error"]
    assert max(first["seconds"], second["seconds"]) < FAILS_WITHIN_S


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_slower_rank_under_max_time_stops_with_the_others(ranks, layout):
    first, second = both(ranks, "slower rank under max_time", layout)
    assert first["tokens"] == second["tokens"]
    plain = ranks[0]["cases"]["plain"][layout]["tokens"]
    prompt_width = len(plain[0]) - 16
    assert len(first["tokens"][0]) < prompt_width + MAX_TIME_TOKENS  # the time ran out
    for row, tokens in zip(plain, first["tokens"], strict=True):
        common = min(len(row), len(tokens))
        assert tokens[:common] == row[:common]  # greedy up to there


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_ranks_decode_on_after_every_case(ranks, layout):
    for rank in ranks:
        assert rank["cases"]["greedy"][layout]["tokens"] == rank["cases"]["plain"][layout]["tokens"]
        assert rank["cases"]["decodes after"][layout]["tokens"] == rank["cases"]["plain"][layout]["tokens"]
