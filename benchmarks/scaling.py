"""How the default drafter's tau grows with its training data, its training steps and its depth, on the shipped pair.

    python benchmarks/scaling.py --stages data                          # the nested reply sets (seconds)
    python benchmarks/scaling.py --stages train --runs p400-s500        # training runs, one thread each, resumable
    python benchmarks/scaling.py --stages eval report                   # tau at T=0 and T=1; the table and the plot

Data: one set of the target's own replies, `--replies` (default `runs/scale/replies`): greedy and T=1 replies to the
first 8,000 ShareGPT train prompts of at most 600 characters, as this command writes them (resumable, 16 prompts a
batch):

    hyperdflash train --output-dir runs/scale/replies_job --data-dir runs/scale/replies --num-prompts 8000 \\
        --max-prompt-chars 600 --max-new-tokens 128 --generation-batch-size 16 --mixed-length-batches \\
        --temperature 0 1 --total-steps 1 --eval-prompts 0

Its first 1,600 prompts are the shipped drafters' prompts. The teacher's prompts that it leaves out (the data stage
writes them) are answered the same way, for later runs:

    hyperdflash train --output-dir runs/scale/teacher_job --data runs/scale/teacher_prompts.jsonl \
        --data-dir runs/scale/teacher_replies --max-new-tokens 128 --generation-batch-size 16 \
        --mixed-length-batches --temperature 0 1 --total-steps 1 --eval-prompts 0

The data stage writes `runs/scale/data-N`, the replies to
the first N prompts, so the sets are nested.

Runs (`RUNS`): the shipped default's recipe (`configs/reference_drafter_hyperdflash.json`: the hybrid recipe, block
8, batch 4, lr 1e-3, seed 0), changing only the number of prompts, the steps and the layers. Training leaves out the
replies to prompts that repeat a held-out one, as every `hyperdflash train` does. A run with `cycle` repeats its
warmup and cosine decay every `cycle` steps (`--cycle-steps`) and saves the drafter at each cycle's end: its first
cycle is the drafter a run of that length trains, bit for bit, and the later points continue from it. A run with
`equal_time_to` gets the steps that take the named run's wall time at its first cycle, from a short probe of both
depths' training speed, side by side.

Eval: `hyperdflash eval` on the 20 held-out chat prompts, T=0 and T=1, 128 new tokens, one thread, every step
verifying the drafter's whole block (the constant schedule) with no chains copied from the context: the drafter's own
tau. The baseline is the default drafter shipped before this curve (1,600 prompts, 2,000 steps, 2 layers), read from
git at `BEFORE_COMMIT`; the default shipped now is the point `SHIPPED_NOW`. Seeded evaluations repeat exactly, so a
point evaluated in another run pairs with the baseline prompt by prompt: the report gives each point's tau over the
baseline's with a paired bootstrap interval over prompts (`evaluation.paired`).

Report: `runs/scale/report.md` (the table) and `--plot` (default `docs/scaling.png`): tau at T=0 and T=1 against the
tokens trained on (steps x 4 sequences x the mean sequence length of the run's weighted data), one line per data
size, the deeper drafter marked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from hf_hyperdflash.evaluation.options import DRAFTER_ONLY  # noqa: E402
from hf_hyperdflash.evaluation.paired import paired_tau_ratio  # noqa: E402
from hf_hyperdflash.evaluation.runner import MethodResult  # noqa: E402
from hf_hyperdflash.modeling.draft_options import CONSTANT_SCHEDULE  # noqa: E402
from hf_hyperdflash.prompts import load_prompts  # noqa: E402
from hf_hyperdflash.reference.teacher import train_prompts  # noqa: E402
from hf_hyperdflash.sharegpt import repeats_held_out_prompt  # noqa: E402
from hf_hyperdflash.training.data import read_records  # noqa: E402

ROOT = Path("runs/scale")
CONFIG = Path("configs/reference_drafter_hyperdflash.json")
TEMPERATURES = ("0", "1")
REPLY_WEIGHTS = {"0": 6, "1": 1}  # the hybrid recipe's: each greedy reply six times an epoch, each sampled one once
BATCH = 4
BEFORE = "shipped-before"
BEFORE_COMMIT = "ab59465"  # the last commit shipping the 1,600-prompt default
TODAY = {"prompts": 1600, "steps": 2000, "layers": 2}  # what that drafter trained on
SHIPPED_NOW = "p8000-s4000@4000"  # the point `configs/reference_drafter_hyperdflash.json` trains, shipped since
PROBE_STEPS = 40
BAR = 1.15  # issue 72: the shipped default's tau is to reach 1.15x the one before's, at T=0 and at T=1
REPLY_PROMPTS = 8000  # the reply set's prompts


@dataclass(frozen=True)
class Run:
    prompts: int
    steps: int
    layers: int = 2
    cycle: int = 0
    equal_time_to: str | None = None  # a 2-layer run: take its first cycle's wall time


RUNS = {
    "p400-s500": Run(prompts=400, steps=500),  # a quarter of today's data and steps
    "p8000-s4000": Run(prompts=8000, steps=4000, cycle=2000),  # 5x the data; today's steps, then twice them
    "p1600-s4000": Run(prompts=1600, steps=4000, cycle=2000),  # today's data: the shipped point again, then 2x steps
    "p8000-l4-s1224": Run(prompts=8000, steps=1224, layers=4),  # depth 4 at the steps of a probe run one depth
    # after the other, which came to 0.7x the 2-layer run's wall time (now probed side by side)
    "p8000-l4": Run(prompts=8000, steps=0, layers=4, equal_time_to="p8000-s4000"),  # depth 4 at equal wall time
}


def teacher_prompts(path: Path) -> int:
    """Write the prompts the teacher answered (`reference.teacher.train_prompts`) that the reply set leaves out
    (longer than 600 characters, or not the first user turn `load_prompts` takes) and that repeat no held-out prompt,
    one JSONL record each, for `hyperdflash train --data PATH`; returns how many."""
    answered = {messages[-1]["content"] for messages in load_prompts("sharegpt", "train", REPLY_PROMPTS, 600)}
    kept = [text for _, text in train_prompts(4096) if text not in answered and not repeats_held_out_prompt(text)]
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in kept))
    return len(kept)


def data_stage(replies: Path) -> None:
    """`data-N` for every N a run needs (the records of the first N prompts at each temperature), and the teacher's
    prompts not answered yet."""
    teacher = ROOT / "teacher_prompts.jsonl"
    if not teacher.exists():
        print(f"{teacher}: {teacher_prompts(teacher)} of the teacher's 4,096 prompts")
    for prompts in sorted({run.prompts for run in RUNS.values()}):
        for temperature in TEMPERATURES:
            out = ROOT / f"data-{prompts}" / f"temperature-{temperature}" / "shard-000.jsonl"
            if out.exists():
                continue
            records = [r for r in read_records(replies / f"temperature-{temperature}") if r["index"] < prompts]
            if sorted(r["index"] for r in records) != list(range(prompts)):
                print(
                    f"data-{prompts}: {replies} lacks T={temperature} replies to some of its first {prompts} prompts"
                )
                break
            out.parent.mkdir(parents=True, exist_ok=True)
            records.sort(key=lambda record: record["index"])
            out.write_text("".join(json.dumps(record) + "\n" for record in records))
        else:
            print(f"data-{prompts}: ready")


def _train_command(run: Run, steps: int, out: Path) -> list[str]:
    command = [sys.executable, "-m", "hf_hyperdflash.training.command", "--config", str(CONFIG)]
    command += ["--target-dtype", "float32", "--output-dir", str(out), "--eval-prompts", "0"]
    command += ["--data-dir", str(ROOT / f"data-{run.prompts}"), "--num-prompts", str(run.prompts)]
    command += ["--total-steps", str(steps), "--num-layers", str(run.layers)]
    return command + (["--cycle-steps", str(run.cycle)] if run.cycle else [])


def _one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _probe_speed_ratio(prompts: int, deep: int, shallow: int) -> float:
    """How many steps of the `deep`-layer drafter take the time of one of the `shallow`-layer one: both probed side
    by side (one thread each, so under the same load) for `PROBE_STEPS` steps on the same batches; the median over
    the trainer's log windows (the first, which holds the start-up, left out) of their tokens/s ratio."""
    outs = {layers: ROOT / "probe" / f"layers-{layers}" for layers in (deep, shallow)}
    probes = []
    for layers, out in outs.items():
        shutil.rmtree(out, ignore_errors=True)
        command = _train_command(Run(prompts, 0, layers), PROBE_STEPS, out)
        probes.append(subprocess.Popen(command, env=_one_thread()))
    if any(probe.wait() for probe in probes):
        raise SystemExit("A speed probe failed; its output is above.")
    speeds = {
        layers: [
            json.loads(line)["tokens_per_second"] for line in (out / "run" / "log.jsonl").read_text().splitlines()
        ]
        for layers, out in outs.items()
    }
    ratios = sorted(d / s for d, s in zip(speeds[deep][1:], speeds[shallow][1:], strict=True))
    return ratios[len(ratios) // 2]


def _steps(name: str, run: Run) -> int:
    """`run.steps`, or the steps of equal wall time to `run.equal_time_to`'s first cycle (probed, then kept)."""
    if run.equal_time_to is None:
        return run.steps
    saved = ROOT / name / "equal_time_steps.json"
    if saved.exists():
        return json.loads(saved.read_text())["steps"]
    paired = RUNS[run.equal_time_to]
    ratio = _probe_speed_ratio(run.prompts, run.layers, paired.layers)
    steps = round((paired.cycle or paired.steps) * ratio)
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"steps": steps, "speed_ratio": ratio}, indent=1))
    return steps


def train_stage(names: list[str]) -> None:
    """Each named run at one thread, in turn; a finished run is skipped, an interrupted one resumes. `timing.json`
    keeps when the run first started (a snapshot's wall time is its file's time since then) and its seconds in all."""
    for name in names:
        run, out = RUNS[name], ROOT / name
        if (out / "drafter" / "config.json").exists():
            continue
        if not (ROOT / f"data-{run.prompts}" / "temperature-1" / "shard-000.jsonl").exists():
            raise SystemExit(f"No data-{run.prompts} yet: run the data stage once the replies are complete.")
        steps = _steps(name, run)
        timing_path = out / "timing.json"
        out.mkdir(parents=True, exist_ok=True)
        timing = (
            json.loads(timing_path.read_text()) if timing_path.exists() else {"started": time.time(), "seconds": 0}
        )
        timing_path.write_text(json.dumps({**timing, "steps": steps}))
        started = time.perf_counter()
        subprocess.run(_train_command(run, steps, out), check=True, env=_one_thread())
        timing["seconds"] += time.perf_counter() - started
        timing_path.write_text(json.dumps({**timing, "steps": steps}))


def points() -> dict[str, tuple[Path, dict]]:
    """Every drafter to evaluate, the runs' snapshots as soon as they are saved: name -> (its folder, what it trained
    on and in how many minutes)."""
    found = {BEFORE: (_drafter_shipped_before(), {**TODAY, "minutes": None})}
    for name, run in RUNS.items():
        out = ROOT / name
        if not (out / "timing.json").exists():
            continue
        timing = json.loads((out / "timing.json").read_text())
        saved = {int(path.name.rsplit("-", 1)[1]): path for path in out.glob("drafter-step-*")}
        if (out / "drafter" / "config.json").exists():
            saved[timing["steps"]] = out / "drafter"
        for step, path in sorted(saved.items()):
            minutes = ((path / "model.safetensors").stat().st_mtime - timing["started"]) / 60
            found[f"{name}@{step}"] = (
                path,
                {"prompts": run.prompts, "steps": step, "layers": run.layers, "minutes": minutes},
            )
    return found


def _drafter_shipped_before() -> Path:
    """The 1,600-prompt default as `BEFORE_COMMIT` shipped it, written out of git once."""
    out = ROOT / BEFORE
    if not (out / "model.safetensors").exists():
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            blob = f"{BEFORE_COMMIT}:hf_hyperdflash/reference/assets/drafter_hyperdflash/{name}"
            (out / name).write_bytes(subprocess.run(["git", "show", blob], check=True, capture_output=True).stdout)
    return out


def _method(point: str) -> str:
    """The eval's name for a point run under the constant schedule without the context's chains."""
    return f"{point}-{CONSTANT_SCHEDULE}{DRAFTER_ONLY}"


def eval_stage(num_prompts: int) -> None:
    """One `hyperdflash eval` run of the points not evaluated yet."""
    pending = {name: path for name, (path, _) in points().items() if not (ROOT / "eval" / name).exists()}
    if not pending:
        return
    out = ROOT / "eval" / "pending"
    command = [
        sys.executable,
        "-m",
        "hf_hyperdflash.cli",
        "eval",
        "--output-dir",
        str(out),
        "--datasets",
        "sharegpt",
        "--num-prompts",
    ]
    command += [str(num_prompts), "--temperatures", "0", "1", "--modes", "non-thinking", "--repeats", "1"]
    command += ["--threads", "1", "--schedules", "constant", "--context-drafts", "off", "--mtp", "none"]
    command += ["--dspark", "none", "--no-reference-drafters"]
    for name, path in pending.items():
        command += ["--drafter", f"{name}={path}"]
    subprocess.run(command, check=True)
    results = json.loads((out / "results.json").read_text())
    for name in pending:  # one file per point: its method at each temperature
        kept = {f"{s['temperature']:g}": _method_result(s, _method(name)) for s in results["settings"]}
        (ROOT / "eval" / name).mkdir(parents=True)
        (ROOT / "eval" / name / "tau.json").write_text(json.dumps(kept))
    shutil.rmtree(out)


def _method_result(setting: dict, method: str) -> dict:
    found = next(m for m in setting["methods"] if m["name"] == method)
    return {key: found[key] for key in ("tau", "lossless", "compared", "prompts", "acceptance_per_position", "runs")}


@cache
def _records(prompts: int, temperature: str) -> list[dict]:
    """The replies of `data-{prompts}` at one temperature, read once per report."""
    return read_records(ROOT / f"data-{prompts}" / f"temperature-{temperature}")


def _mean_sequence_tokens(prompts: int) -> float:
    """Mean tokens per training sequence of the first `prompts` prompts' replies, weighted as the recipe weights
    them."""
    total = count = 0
    for temperature, weight in REPLY_WEIGHTS.items():
        records = _records(prompts, temperature)
        total += weight * sum(len(record["input_ids"]) for record in records)
        count += weight * len(records)
    return total / count


def _reply_tokens(prompts: int) -> int:
    return sum(sum(record["loss_mask"]) for temperature in TEMPERATURES for record in _records(prompts, temperature))


def report_stage(plot: Path) -> str:
    trained = points()
    tau = {
        name: json.loads((ROOT / "eval" / name / "tau.json").read_text())
        for name in trained
        if (ROOT / "eval" / name / "tau.json").exists()
    }
    lines = [
        "| drafter | prompts | layers | steps | minutes | tokens trained on (M) | reply tokens in the data (k) | "
        "T=0 tau | over before | T=1 tau | over before | greedy identical |",
        "|" + "---|" * 12,
    ]
    rows = []
    for name, (_, what) in trained.items():
        if name not in tau:
            continue
        tokens = what["steps"] * BATCH * _mean_sequence_tokens(what["prompts"]) / 1e6
        minutes = "–" if what["minutes"] is None else f"{what['minutes']:.0f}"
        label = f"{name} (shipped)" if name == SHIPPED_NOW else name
        cells = [label, f"{what['prompts']:,}", str(what["layers"]), f"{what['steps']:,}", minutes, f"{tokens:.2f}"]
        cells.append(f"{_reply_tokens(what['prompts']) / 1e3:,.0f}")
        for temperature in TEMPERATURES:
            cells += [f"{tau[name][temperature]['tau']:.2f}", _over_before(tau, name, temperature)]
        cells.append(f"{tau[name]['0']['lossless']}/{tau[name]['0']['compared']}")
        lines.append("| " + " | ".join(cells) + " |")
        rows.append((name, what, tokens, tau[name]))
    table = "\n".join(lines)
    (ROOT / "report.md").write_text(table + "\n")
    _plot(rows, plot)
    print(table)
    return table


def _over_before(tau: dict, name: str, temperature: str) -> str:
    """The point's tau over the baseline's, with its paired bootstrap interval over prompts."""
    if name == BEFORE:
        return "–"
    kept, before = tau[name][temperature], tau[BEFORE][temperature]
    ratio = paired_tau_ratio(_as_result(name, kept), _as_result(BEFORE, before))
    return f"{ratio.ratio:.2f} ({ratio.low:.2f}-{ratio.high:.2f})"


def _as_result(name: str, kept: dict) -> MethodResult:
    return MethodResult(name=name, prompts=kept["prompts"], runs=kept["runs"])


def _plot(rows: list[tuple[str, dict, float, dict]], path: Path) -> None:
    """tau against the tokens trained on, one line per data size and depth, and the bar: 1.15x the baseline's tau."""
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for axis, temperature in zip(axes, TEMPERATURES, strict=True):
        for prompts in sorted({what["prompts"] for _, what, _, _ in rows}):
            for layers, marker in ((2, "o"), (4, "s")):
                line = sorted(
                    (tokens, kept[temperature]["tau"])
                    for _, what, tokens, kept in rows
                    if what["prompts"] == prompts and what["layers"] == layers
                )
                if line:
                    axis.plot(*zip(*line, strict=True), marker=marker, label=f"{prompts:,} prompts, {layers} layers")
        before = next(kept[temperature]["tau"] for name, _, _, kept in rows if name == BEFORE)
        axis.axhline(
            BAR * before, color="gray", linestyle="--", linewidth=1, label=f"{BAR}x the drafter shipped before"
        )
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("tokens trained on (M)")
        axis.set_ylabel("tau, whole blocks")
        axis.set_title(f"T={temperature}, held-out chat prompts")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", choices=["data", "train", "eval", "report"], required=True)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="Runs to train, in turn.")
    parser.add_argument("--replies", type=Path, default=ROOT / "replies")
    parser.add_argument("--num-prompts", type=int, default=20, help="Held-out chat prompts for tau.")
    parser.add_argument("--plot", type=Path, default=Path("docs/scaling.png"))
    args = parser.parse_args(argv)
    if "data" in args.stages:
        data_stage(args.replies)
    if "train" in args.stages:
        train_stage(args.runs)
    if "eval" in args.stages:
        eval_stage(args.num_prompts)
    if "report" in args.stages:
        report_stage(args.plot)


if __name__ == "__main__":
    main()
