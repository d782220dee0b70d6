"""Report files: Markdown tables per setting, strict JSON with every number, the acceptance plot."""

import json

import pytest

from hf_hyperdflash.evaluation.harness import Setting, SettingResult
from hf_hyperdflash.evaluation.report import REPORT_FILES, machine_description, tau_ratios, write_report
from hf_hyperdflash.evaluation.runner import FirstCall, MethodResult


def _result(name: str, accepted: list[int], proposed: list[int], lossless: int = 2, compared: int = 2) -> MethodResult:
    result = MethodResult(name=name, prompts=2, compared=compared, lossless=lossless)
    result.num_draft_tokens = max(proposed, default=0)
    result.accepted_per_step, result.proposed_per_step = accepted, proposed
    result.new_tokens = sum(accepted) + len(accepted) if accepted else 40
    result.target_forwards = len(accepted) if accepted else 40
    result.tokens_per_second, result.speed_ratios = [20.0, 30.0], [1.0, 1.0] if not accepted else [1.5, 2.5]
    result.first_call = FirstCall(15.0, 1.0 if not accepted else 0.75, tau=result.tau)
    half = len(accepted) // 2  # the first prompt's steps, then the second's
    result.runs = [
        {"accepted_drafts": sum(part), "verify_steps": len(part)} for part in (accepted[:half], accepted[half:])
    ]
    return result


def _first_table(markdown: str, header_start: str) -> tuple[list[str], dict[str, list[str]]]:
    """The header cells and the rows (by method) of the first table whose header starts with `header_start`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = line.split(" | ")
        rows[cells[0][2:]] = cells
    return lines[start].split(" | "), rows


@pytest.fixture
def results():
    greedy = [
        _result("plain", [], []),
        _result("mtp-k3", [3, 1, 0, 2], [3, 3, 3, 3]),
        _result("hyperdflash", [7, 5, 7], [7, 7, 7], lossless=1),
    ]
    sampled = [
        _result("plain", [], [], 0, 0),
        _result("mtp-k3", [2, 2], [3, 3], 0, 0),
        _result("hyperdflash", [3, 4], [7, 7], 0, 0),
    ]
    return [
        SettingResult(Setting("humaneval", 0.0, False), greedy),
        SettingResult(Setting("humaneval", 1.0, True), sampled),
    ]


RUN = {
    "command": "hyperdflash eval --output-dir out",
    "machine": machine_description(),
    "target": "tiny",
    "mtp": "runs/mtp",
    "drafters": {"hyperdflash": "runs/hdf"},
    "methods": ["plain", "mtp-k3", "hyperdflash"],
    "max_new_tokens": 16,
    "repeats": 1,
    "seed": 0,
    "dtype": "float32",
    "device": "cpu",
    "notes": ["skipped vanilla_dflash: the shipped reference vanilla_dflash is not installed"],
    "tau_ratios": [("hyperdflash", "mtp-k3")],
}


def test_markdown_has_a_row_per_method_and_flags_the_failure(results, tmp_path):
    markdown = write_report(results, RUN, tmp_path)
    assert markdown == (tmp_path / REPORT_FILES["markdown"]).read_text()
    assert "`hyperdflash eval --output-dir out`" in markdown and RUN["machine"]["cpu"] in markdown
    assert "- skipped vanilla_dflash" in markdown and "Drafters: hyperdflash (runs/hdf)." in markdown
    assert "## humaneval, T=0, non-thinking (2 prompts)" in markdown and "## humaneval, T=1, thinking" in markdown
    header, rows = _first_table(markdown, "| method | k |")
    assert header[3:10] == [f"acc@{k}" for k in range(1, 8)]
    assert list(rows) == ["plain", "mtp-k3", "hyperdflash"]
    assert rows["mtp-k3"][1:3] == ["3", "2.50"]  # k, tau = (6 + 4) / 4
    assert rows["mtp-k3"][3:7] == ["0.75", "0.50", "0.25", "–"]
    assert rows["hyperdflash"][-1] == "1/2 ✗ |" and rows["plain"][2] == "–"
    assert header[-3:] == ["speedup", "1st call", "lossless |"] and rows["mtp-k3"][-3:-1] == ["2.00x", "0.75x"]
    assert "n/a (sampled)" in markdown
    assert "NOT LOSSLESS: hyperdflash (humaneval, T=0, non-thinking)" in markdown
    _, ratios = _first_table(markdown, "| ratio |")
    # tau 7.33 / 2.50; a resample of two prompts is (1, 1): 8 / 3, (2, 2): 7 / 2, or a mix: the full ratio
    assert ratios["hyperdflash / mtp-k3"][1:3] == ["2.93", "2.67–3.50 |"]
    assert markdown.count("| ratio | tau ratio |") == 2  # one per setting
    _, speedups = _first_table(markdown, "| ratio | speed ratio |")  # each method's, with its interval
    assert list(speedups)[:2] == ["mtp-k3 / plain", "hyperdflash / plain"] and speedups["mtp-k3 / plain"][1] == "2.00"


def test_json_is_strict_and_complete(results, tmp_path):
    write_report(results, RUN, tmp_path)

    def no_nan(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    data = json.loads((tmp_path / REPORT_FILES["json"]).read_text(), parse_constant=no_nan)
    assert data["run"]["command"] == RUN["command"] and data["run"]["machine"]["torch_threads"] >= 1
    first = data["settings"][0]
    assert (first["dataset"], first["temperature"], first["thinking"]) == ("humaneval", 0.0, False)
    plain, mtp = first["methods"][:2]
    assert plain["tau"] is None
    expected_keys = {"name", "tau", "acceptance_per_position", "forwards_per_token", "tokens_per_second", "speedup"}
    expected_keys |= {"lossless", "compared", "accepted_per_step", "proposed_per_step", "runs"}
    assert expected_keys <= set(mtp)
    assert mtp["tau"] == 2.5 and mtp["speedup"] == 2.0
    assert mtp["first_call"] == {"tokens_per_second": 15.0, "speed_ratio": 0.75, "tau": 2.5}
    (ratio,) = first["tau_ratios"]
    assert (ratio["numerator"], ratio["denominator"], ratio["prompts"]) == ("hyperdflash", "mtp-k3", 2)
    assert ratio["ratio"] == pytest.approx((19 + 3) / 3 / 2.5) and ratio["low"] <= ratio["ratio"] <= ratio["high"]


def test_a_side_joined_with_plus_pools_its_methods(results):
    seed_1 = _result("hyperdflash_s1", [5, 3, 1, 1], [7, 7, 7, 7])
    setting = SettingResult(results[0].setting, [*results[0].methods, seed_1])
    (ratio,) = tau_ratios(setting, [("hyperdflash+hyperdflash_s1", "mtp-k3")])
    assert ratio.numerator == "hyperdflash+hyperdflash_s1" and ratio.prompts == 2
    assert ratio.ratio == pytest.approx((19 + 10 + 7) / 7 / 2.5)  # 29 drafts accepted over 7 verify steps


def test_each_method_and_each_schedule_of_a_drafter_is_compared_by_speed_on_the_same_prompts(results, tmp_path):
    constant = _result("mtp-k3-constant", [3, 3, 3, 3], [3, 3, 3, 3])
    constant.speed_ratios = [1.0, 2.0]  # mtp-k3: 1.5 and 2.5, so 1.5 and 1.25 per prompt
    greedy = SettingResult(results[0].setting, [*results[0].methods, constant])
    markdown = write_report([greedy], RUN | {"methods": [m.name for m in greedy.methods]}, tmp_path)
    assert "Speed on the same prompts" in markdown
    _, rows = _first_table(markdown, "| ratio | speed ratio |")
    speedups = ["mtp-k3 / plain", "hyperdflash / plain", "mtp-k3-constant / plain"]
    assert list(rows)[:4] == [*speedups, "mtp-k3 / mtp-k3-constant"] and rows["mtp-k3 / mtp-k3-constant"][1] == "1.38"
    *speedups, ratio, _ = json.loads((tmp_path / REPORT_FILES["json"]).read_text())["settings"][0]["speed_ratios"]
    assert (ratio["numerator"], ratio["denominator"]) == ("mtp-k3", "mtp-k3-constant")
    assert ratio["ratio"] == pytest.approx(1.375) and 1.25 <= ratio["low"] <= ratio["high"] <= 1.5
    speedup = speedups[2]  # the median of 1.0 and 2.0, plain decoding at 1.0 on both prompts
    assert speedup["ratio"] == pytest.approx(1.5) and 1.0 <= speedup["low"] <= speedup["high"] <= 2.0


def test_the_tau_ratio_pairs_are_compared_by_speed_too_unless_pooled(results, tmp_path):
    results[0].methods[1].speed_ratios = [1.0, 2.0]  # mtp-k3; hyperdflash: 1.5 and 2.5, so 1.5 and 1.25 per prompt
    seed_1 = _result("hyperdflash_s1", [5, 3, 1, 1], [7, 7, 7, 7])
    greedy = SettingResult(results[0].setting, [*results[0].methods, seed_1])
    pairs = [("hyperdflash", "mtp-k3"), ("hyperdflash+hyperdflash_s1", "mtp-k3")]
    markdown = write_report([greedy], RUN | {"tau_ratios": pairs}, tmp_path)
    _, rows = _first_table(markdown, "| ratio | speed ratio |")
    assert list(rows) == ["mtp-k3 / plain", "hyperdflash / plain", "hyperdflash_s1 / plain", "hyperdflash / mtp-k3"]
    assert rows["hyperdflash / mtp-k3"][1] == "1.38"  # the median of 1.5 and 1.25


def test_acceptance_plot_is_a_png(results, tmp_path):
    write_report(results, RUN, tmp_path)
    png = (tmp_path / REPORT_FILES["plot"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_machine_description_names_cpu_cores_and_threads():
    machine = machine_description()
    assert machine["cpu"] and machine["logical_cores"] >= 1 and machine["torch_threads"] >= 1
    assert {"gpu", "torch", "transformers", "python"} <= set(machine)
