"""The evaluation report: a paper-style Markdown table per setting, a JSON file with everything, an acceptance plot.

Markdown columns: tau (mean accepted length per verify step, bonus token included), acceptance at each draft
position k (the share of steps that drafted position k whose drafts were all accepted up to k), drafts sent to
verification per decoding step, the share of steps that skipped drafting (the adaptive schedule) and the share of
verify steps whose drafts were copied from the context (`draft_from_context`), target forwards
per generated token, then the speed of the method's later calls, those after its first in the setting: median tokens/s
and speedup (median over prompts of tokens/s over plain decoding's); "1st call" is the first call's speedup over
plain decoding's first call (it pays the warm-up); and lossless (greedy outputs token-identical to plain decoding,
N/N prompts). A second table gives the tau ratios of the pairs in `run["tau_ratios"]` with paired bootstrap intervals
over prompts; a third compares by speed on the same prompts: each method's speedup with its interval, each drafter's
default schedule against its others, the tau-ratio pairs of single methods and the --speed-ratio pairs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from pathlib import Path

import torch
import transformers

from .harness import SettingResult
from .paired import PairedRatio, paired_speed_ratio, paired_tau_ratio, pool_members, pooled, schedule_pairs
from .runner import PLAIN_CONTROL, MethodResult, finite_or_none

REPORT_FILES = {"markdown": "report.md", "json": "results.json", "plot": "acceptance.png"}


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_description() -> dict[str, str | int | None]:
    """What the timings ran on: CPU model and cores, torch threads, GPU, library versions."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "available_cores": available,
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _number(value: float, pattern: str = "{:.2f}") -> str:
    return "–" if value is None or math.isnan(value) else pattern.format(value)


def _lossless(result: MethodResult) -> str:
    if not result.compared:
        return "n/a (sampled)"
    mark = "" if result.lossless == result.compared else " ✗"
    return f"{result.lossless}/{result.compared}{mark}"


def _method_table(results: list[MethodResult]) -> list[str]:
    positions = max((len(result.acceptance_per_position) for result in results), default=0)
    header = ["method", "k", "tau", *(f"acc@{k}" for k in range(1, positions + 1))]
    header += ["drafted/step", "skipped", "copied", "fwd/token", "tok/s", "speedup", "1st call", "lossless"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        acceptance = result.acceptance_per_position
        cells = [result.name, str(result.num_draft_tokens or "–"), _number(result.tau)]
        cells += [_number(acceptance[k]) if k < len(acceptance) else "–" for k in range(positions)]
        drafts = bool(result.proposed_per_step or result.skipped_steps)  # plain decoding, prompt lookup: no record
        cells += [_number(result.drafted_per_step) if drafts else "–"]
        cells += [_number(result.skipped_share, "{:.0%}") if drafts else "–"]
        cells += [_number(result.copied_share, "{:.0%}") if drafts else "–"]
        cells += [_number(result.forwards_per_token), _number(result.median_tokens_per_second, "{:.1f}")]
        cells += [_number(result.speedup, "{:.2f}x"), _number(result.first_call.speed_ratio, "{:.2f}x")]
        cells += [_lossless(result)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tau_ratios(result: SettingResult, pairs: list[tuple[str, str]]) -> list[PairedRatio]:
    """The paired tau ratio of each (numerator, denominator) pair in this setting; a side "a+b" pools methods."""
    by_name = {method.name: method for method in result.methods}

    def side(names: str) -> MethodResult:
        return pooled([by_name[name] for name in pool_members(names)])

    return [paired_tau_ratio(side(numerator), side(denominator)) for numerator, denominator in pairs]


def speed_comparisons(
    result: SettingResult, tau_ratio_pairs: list[tuple[str, str]], speed_pairs: list[tuple[str, str]] = ()
) -> list[PairedRatio]:
    """By speed on the same prompts: each speculative method over plain decoding (its speedup, with the interval
    that says whether it differs from 1.00x), each method's default schedule over its other schedules, then the
    tau-ratio pairs of single methods (a pooled side has no one speed per prompt), then `speed_pairs`."""
    plain, *speculative = result.methods
    by_name = {method.name: method for method in result.methods}
    pairs = schedule_pairs([method.name for method in result.methods])
    pairs += [
        pair for pair in tau_ratio_pairs if pair not in pairs and not any(len(pool_members(side)) > 1 for side in pair)
    ]
    pairs += [pair for pair in speed_pairs if pair not in pairs]
    speedups = [paired_speed_ratio(method, plain) for method in speculative]
    return speedups + [paired_speed_ratio(by_name[numerator], by_name[other]) for numerator, other in pairs]


def _ratio_table(ratios: list[PairedRatio], quantity: str = "tau") -> list[str]:
    lines = [f"| ratio | {quantity} ratio | {100 * ratios[0].confidence:g}% CI |", "|---|---|---|"]
    for ratio in ratios:
        interval = "–" if math.isnan(ratio.low) else f"{ratio.low:.2f}–{ratio.high:.2f}"
        lines.append(f"| {ratio.label} | {_number(ratio.ratio)} | {interval} |")
    return lines


def markdown_report(
    results: list[SettingResult],
    run: dict,
    ratios: list[list[PairedRatio]],
    speed_ratios: list[list[PairedRatio]],
) -> str:
    """The report as Markdown: how it was run, then per setting the method, tau-ratio and speed tables."""
    machine = run["machine"]
    drafters = ", ".join(f"{name} ({path})" for name, path in run["drafters"].items())
    lines = [
        "# HyperDFlash evaluation",
        "",
        f"Command: `{run['command']}`",
        "",
        f"Machine: {machine['cpu']}, {machine['logical_cores']} logical cores ({machine['available_cores']} "
        f"available), torch threads {machine['torch_threads']}, GPU {machine['gpu'] or 'none'}; "
        f"torch {machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}.",
        "",
        f"Target: {run['target']}. Native MTP: {run['mtp'] or 'none'}. Drafters: {drafters or 'none'}.",
        "",
        f"Methods: {', '.join(run['methods'])}. Up to {run['max_new_tokens']} new tokens, {run['repeats']} repeat(s) "
        f"per prompt and method, seed {run['seed']}, dtype {run['dtype']}, device {run['device']}.",
    ]
    if run["notes"]:
        lines += ["", "Notes:", *(f"- {note}" for note in run["notes"])]
    for result, setting_ratios, method_speed_ratios in zip(results, ratios, speed_ratios, strict=True):
        plain = result.methods[0]
        lines += ["", f"## {result.setting.label} ({plain.prompts} prompts)", "", *_method_table(result.methods)]
        if setting_ratios:
            lines += ["", "Paired tau ratios (BCa bootstrap interval over prompts, both methods resampled together):"]
            lines += ["", *_ratio_table(setting_ratios)]
        if method_speed_ratios:
            has_control = any(method.name == PLAIN_CONTROL for method in result.methods)
            lines += [
                "",
                "Speed on the same prompts, later calls: the median over prompts of one method's speed over the "
                "other's (over plain decoding: its speedup; then each default schedule over the drafter's others, "
                "and the tau-ratio pairs), "
                "with a percentile bootstrap interval over prompts"
                + (f" ({PLAIN_CONTROL}: plain decoding again, the run's timing noise)" if has_control else "")
                + ":",
            ]
            lines += ["", *_ratio_table(method_speed_ratios, quantity="speed")]
    failures = [f"{name} ({r.setting.label})" for r in results for name in r.not_lossless]
    verdict = f"NOT LOSSLESS: {', '.join(failures)}" if failures else "every greedy output equals plain decoding"
    lines += ["", f"Lossless check (T=0): {verdict}.", ""]
    return "\n".join(lines)


def _ratio_json(ratio: PairedRatio) -> dict:
    fields = dataclasses.asdict(ratio)
    return {key: finite_or_none(value) if isinstance(value, float) else value for key, value in fields.items()}


def results_json(
    results: list[SettingResult],
    run: dict,
    ratios: list[list[PairedRatio]],
    speed_ratios: list[list[PairedRatio]],
) -> dict:
    return {
        "run": run,
        "settings": [
            {
                "dataset": r.setting.dataset,
                "temperature": r.setting.temperature,
                "thinking": r.setting.thinking,
                "methods": [method.as_dict() for method in r.methods],
                "tau_ratios": [_ratio_json(ratio) for ratio in setting_ratios],
                "speed_ratios": [_ratio_json(ratio) for ratio in method_speed_ratios],
            }
            for r, setting_ratios, method_speed_ratios in zip(results, ratios, speed_ratios, strict=True)
        ],
    }


def plot_acceptance(results: list[SettingResult], path: Path) -> None:
    """Acceptance per draft position, one line per speculative method, one panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = min(len(results), 2)
    rows = math.ceil(len(results) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for axis, result in zip(axes.flat, results, strict=False):
        for method in result.methods:
            acceptance = method.acceptance_per_position
            if acceptance:
                axis.plot(
                    range(1, len(acceptance) + 1), acceptance, marker="o", label=f"{method.name} (τ={method.tau:.2f})"
                )
        axis.set(title=result.setting.label, xlabel="draft position k", ylabel="acceptance", ylim=(-0.02, 1.02))
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(results) :]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(results: list[SettingResult], run: dict, output_dir: str | Path) -> str:
    """Write report.md, results.json and acceptance.png to `output_dir`; return the Markdown."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    ratios = [tau_ratios(result, run["tau_ratios"]) for result in results]
    speeds = [speed_comparisons(result, run["tau_ratios"], run.get("speed_ratios", [])) for result in results]
    markdown = markdown_report(results, run, ratios, speeds)
    (output_dir / REPORT_FILES["markdown"]).write_text(markdown)
    data = results_json(results, run, ratios, speeds)
    (output_dir / REPORT_FILES["json"]).write_text(json.dumps(data, indent=1, allow_nan=False))
    plot_acceptance(results, output_dir / REPORT_FILES["plot"])
    return markdown
