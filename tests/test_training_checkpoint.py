"""Checkpoint saves across processes: no process deletes what another one has already written."""

import json
from pathlib import Path

from hf_hyperdflash.training.loop import LoopConfig, _save_checkpoint


class MainProcessWithAFastPeer:
    """The main process's view of a two-process save in which the other process is always ahead.

    Once a barrier opens, the peer immediately writes its random states into the directory being saved,
    before the main process runs its next line: the interleaving that made the two-process CI run flaky.
    """

    is_main_process = True

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.saving_to: Path | None = None

    def save_state(self, output_dir: str) -> None:
        self.saving_to = Path(output_dir)
        self.saving_to.mkdir(parents=True, exist_ok=True)
        (self.saving_to / "random_states_0.pkl").write_text("main")

    def wait_for_everyone(self) -> None:
        if self.saving_to is None:  # the first barrier: the peer starts its own save_state right away
            self.saving_to = self.run_dir / "checkpoint.tmp"
            self.saving_to.mkdir(parents=True, exist_ok=True)
            (self.saving_to / "random_states_1.pkl").write_text("peer")


def test_a_leftover_partial_save_is_cleared_before_any_process_writes(tmp_path):
    leftover = tmp_path / "checkpoint.tmp"
    leftover.mkdir()
    (leftover / "random_states_1.pkl").write_text("from an interrupted save")

    _save_checkpoint(MainProcessWithAFastPeer(tmp_path), tmp_path, step=4, config=LoopConfig(total_steps=4))

    checkpoint = tmp_path / "checkpoint"
    assert (checkpoint / "random_states_0.pkl").read_text() == "main"
    assert (checkpoint / "random_states_1.pkl").read_text() == "peer", "the peer's random states were deleted"
    assert json.loads((checkpoint / "loop_state.json").read_text())["step"] == 4
    assert not leftover.exists()
