"""benchmarks/depth.py at toy size, run the way the GPU plan runs it: the data here, run 1 (target), the replies here,
run 2 (the three drafters side by side) each returning what the device gives back (at most 8 files, 2 folders deep),
then the evaluation on CPU from those files alone; and the deadline that drops DSpark to save the other two."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from hf_hyperdflash.modeling.modeling_hyperdflash import spread_target_layers

pytestmark = pytest.mark.slow  # the depth plan's every stage at toy size (CI runs it)

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "depth.py"


def _depth(monkeypatch):
    """The script as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("depth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "depth", module)
    spec.loader.exec_module(module)
    return module


def _files(folder: Path) -> list[Path]:
    return [path.relative_to(folder) for path in folder.rglob("*") if path.is_file()]


def test_gpu_plan_at_toy_size_then_evaluation_from_the_returned_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what --device cpu sets, undone after the test
    depth = _depth(monkeypatch)
    out, returned = tmp_path / "depth", tmp_path / "returned"
    common = ["--device", "cpu", "--smoke", "--out", str(out)]
    assert depth.main([*common, "--stages", "data"]) == 0
    assert depth.main([*common, "--stages", "target", "--copy-to", str(returned / "run1")]) == 0
    assert depth.main([*common, "--stages", "replies"]) == 0
    run2 = ["--stages", "drafters", "--side-by-side", "--deadline", "500", "--copy-to", str(returned / "run2")]
    assert depth.main([*common, *run2]) == 0
    for run in ("run1", "run2"):
        files = _files(returned / run)
        assert len(files) <= 8 and all(len(path.parts) <= 3 for path in files), files
        assert {"results.json", "report.md"} <= {str(path) for path in files}
    trained = (out / "target" / "model.safetensors").stat().st_mtime_ns
    assert depth.main([*common, "--stages", "target"]) == 0
    assert (out / "target" / "model.safetensors").stat().st_mtime_ns == trained  # done already: not retrained

    weights = tmp_path / "weights"  # what a CPU session has after both runs: the returned files, nothing else
    shutil.copytree(returned / "run1", weights)
    shutil.copytree(returned / "run2", weights, dirs_exist_ok=True)
    evaluation = tmp_path / "evaluation"
    assert depth.main(["--device", "cpu", "--smoke", "--evaluate-only", str(weights), "--out", str(evaluation)]) == 0

    results = json.loads((evaluation / "results.json").read_text())
    target = results["target"]
    assert (target["layers"], target["steps"]) == (4, 3) and target["layer_types"] == depth.layer_types(4)
    assert target["held_out_perplexity"] > 1 and target["reference_4_layer_held_out_perplexity"] > 1
    assert results["drafters"]["vanilla_dflash"]["target_layer_ids"] == spread_target_layers(4, 2)
    assert results["drafters"]["hyperdflash"]["conditioning"] == "pre_collapse"
    assert results["drafters"]["dspark"]["target_layer_ids"] == [1, 2, 3]  # the stream-mean of the last three
    assert [record["step"] for record in results["drafters"]["hyperdflash"]["log"]] == [1, 2, 3]  # the curves
    setting = results["eval"]["results"]["settings"][0]
    methods = {method["name"]: method for method in setting["methods"]}
    for name in ("hyperdflash-constant", "vanilla_dflash-constant", "dspark-constant"):  # whole blocks every step
        assert methods[name]["compared"] == methods[name]["lossless"] == 2
        assert 0 < len(methods[name]["acceptance_per_position"]) <= 7  # block 8, cut to the 8 new tokens left
        assert methods[name]["tau"] >= 1
    pairs = [("hyperdflash-constant", f"{other}-constant") for other in ("vanilla_dflash", "dspark")]
    assert [(r["numerator"], r["denominator"], r["prompts"]) for r in setting["tau_ratios"]] == [
        (*p, 2) for p in pairs
    ]
    assert all(" / ".join(pair) in (evaluation / "report.md").read_text() for pair in pairs)
    for folder in ("target", "drafter_hyperdflash", "drafter_vanilla_dflash", "drafter_dspark"):
        with safe_open(weights / folder / "model.safetensors", "pt") as tensors:
            dtypes = {tensors.get_slice(name).get_dtype() for name in tensors.keys()}
        assert dtypes <= {"BF16", "I64", "I32"}, (folder, dtypes)  # integer buffers: the hash-MoE table


def test_the_deadline_drops_dspark_so_the_others_finish(tmp_path, monkeypatch):
    """Side by side with a deadline the step rates would pass, DSpark (slow here) is stopped and the others finish;
    its failure would drop it too, without stopping them."""
    depth = _depth(monkeypatch)
    popen = depth.subprocess.Popen
    pace = {"hyperdflash": 0.01, "dspark": 0.1}  # seconds per logged step: 1 s and 10 s for 100 steps

    def fake_training(command, **kwargs):
        out_dir = Path(command[command.index("--output-dir") + 1])
        name = out_dir.name
        script = (
            "import json, pathlib, time\n"
            f"run = pathlib.Path({str(out_dir / 'run')!r}); run.mkdir(parents=True, exist_ok=True)\n"
            f"for step in range(1, 101):\n    time.sleep({pace[name]})\n"
            "    with (run / 'log.jsonl').open('a') as log: log.write(json.dumps({'step': step}) + '\\n')\n"
        )
        if pace[name] is None:  # a training that fails
            script = "raise SystemExit(1)"
        return popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(depth.subprocess, "Popen", fake_training)
    monkeypatch.setattr(depth, "RATE_SETTLE_SECONDS", 1)
    arguments = {name: ["--output-dir", str(tmp_path / "work" / name)] for name in pace}
    seconds, dropped = depth.run_trainings(tmp_path, arguments, True, 100, deadline=4, expendable="dspark")
    assert dropped == ["dspark"] and set(seconds) == {"hyperdflash", "dspark"}
    assert depth.steps_done(tmp_path / "work" / "hyperdflash" / "run") == 100
    assert depth.steps_done(tmp_path / "work" / "dspark" / "run") < 100

    pace["dspark"] = None
    arguments = {name: ["--output-dir", str(tmp_path / "again" / name)] for name in pace}
    assert depth.run_trainings(tmp_path, arguments, True, 100, deadline=4, expendable="dspark")[1] == ["dspark"]
    assert depth.steps_done(tmp_path / "again" / "hyperdflash" / "run") == 100
    pace["hyperdflash"] = None  # any other training that fails stops the run
    arguments = {name: ["--output-dir", str(tmp_path / "third" / name)] for name in pace}
    with pytest.raises(SystemExit, match="training hyperdflash failed"):
        depth.run_trainings(tmp_path, arguments, True, 100, deadline=4, expendable="dspark")
