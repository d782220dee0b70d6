"""The shape of the code: `modeling/` at the top is `hf_hyperdflash.modeling` (the runtime and the Hub remote code),
its imports follow the remote-code rule and run one way (configs <- models <- generation), and the library's
commands do not import each other."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hf_hyperdflash
import hf_hyperdflash.modeling

ROOT = Path(__file__).parents[1]
RUNTIME_DIR = ROOT / "modeling"
RUNTIME_MODULES = {path.stem for path in RUNTIME_DIR.glob("*.py")} - {"__init__"}


def _relative_imports(path: Path) -> set[str]:
    """The sibling modules `path` imports (`from .name import ...` or `from . import name`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            names |= {node.module} if node.module else {alias.name for alias in node.names}
    return names


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _relative_imports(RUNTIME_DIR / f"{name}.py")
    return seen - {module}


def test_the_top_level_modeling_folder_is_what_imports_as_hf_hyperdflash_modeling():
    assert Path(hf_hyperdflash.modeling.__file__).resolve() == (RUNTIME_DIR / "__init__.py").resolve()


def test_no_stray_modeling_folder_inside_the_library_shadows_the_mapped_one():
    """A leftover `hf_hyperdflash/modeling/` (even a `__pycache__` alone, after moving the folder) is found by
    Python's path finder before the package-dir mapping, as an empty namespace package."""
    stray = Path(hf_hyperdflash.__file__).parent / "modeling"
    assert not stray.exists(), f"delete {stray}: it shadows {RUNTIME_DIR} (hf_hyperdflash.modeling)"


def test_remote_code_imports_are_flat_and_relative():
    """transformers copies remote code by basename and resolves only `from .name import`: no subpackages, no
    imports from the library around it."""
    for path in RUNTIME_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name}: `from {'.' * node.level}{node.module or ''}` leaves the folder"
                assert node.module is None or node.module in RUNTIME_MODULES, (path.name, node.module)
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert not (node.module or "").startswith("hf_hyperdflash"), f"{path.name} imports the library"


def test_layers_run_one_way():
    """Configs import no model; models import no generation module; only `drafting.py` installs the integration,
    and nothing in the runtime imports `drafting.py`."""
    configs = {name for name in RUNTIME_MODULES if name.startswith("configuration_")}
    models = {name for name in RUNTIME_MODULES if name.startswith("modeling_")}
    generation = {"integration", "candidate_generator", "draft_policy", "request_checks", "drafting", "call_scope"}
    for config in configs:
        assert _closure(config) <= {"draft_options", "target_architecture"}, config
    for model in models:
        assert not _closure(model) & (generation - {"call_scope"}), model
    for name in RUNTIME_MODULES - {"drafting"}:
        assert "drafting" not in _relative_imports(RUNTIME_DIR / f"{name}.py"), name
    installers = [
        path.name
        for path in RUNTIME_DIR.glob("*.py")
        if any(line.startswith("install_generate_integration()") for line in path.read_text().splitlines())
    ]
    assert installers == ["drafting.py"], installers  # the one module-level call


@pytest.mark.slow
def test_importing_a_config_loads_no_adapter_cache_model_or_other_family():
    """A fresh interpreter imports both drafter configs: no target adapter, cache, drafter model or generation
    module of the runtime, no other family's transformers modeling, and generate() stays stock."""
    script = """
import sys
import hf_hyperdflash.modeling.configuration_deepseek_v4_mtp
import hf_hyperdflash.modeling.configuration_hyperdflash
from transformers import GenerationMixin
loaded = sorted(m for m in sys.modules if m.startswith(("hf_hyperdflash", "transformers.models.")))
print("\\n".join(loaded))
print("wrapped" if hasattr(GenerationMixin.generate, "_hyperdflash_integration") else "stock")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    *loaded, generate = result.stdout.split()
    runtime = {name.removeprefix("hf_hyperdflash.modeling.") for name in loaded if name.startswith("hf_hyperdflash.")}
    light = {"configuration_deepseek_v4_mtp", "configuration_hyperdflash", "draft_options", "target_architecture"}
    assert runtime == light | {"hf_hyperdflash.modeling"}
    families = {name.split(".")[2] for name in loaded if name.startswith("transformers.models.")}
    assert families <= {"auto", "deepseek_v4"}, families
    family_modeling = [name for name in loaded if name.startswith("transformers.models.") and ".modeling_" in name]
    assert family_modeling <= ["transformers.models.auto.modeling_auto"], family_modeling  # transformers' own
    assert generate == "stock"


def test_library_commands_do_not_import_each_other_or_the_cli():
    """`cli.py` imports the commands when they run; the commands import neither it nor each other, and training and
    evaluation share target loading (`loading.py`) instead of importing each other."""
    library = ROOT / "hf_hyperdflash"

    def imports(path: Path) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                found.add("." * node.level + module)
        return found

    for package, other in (("training", "evaluation"), ("evaluation", "training")):
        for path in (library / package).glob("*.py"):
            found = imports(path)
            assert not any(name.startswith(("..cli", f"..{other}")) for name in found), (path.name, found)


@pytest.mark.parametrize(
    "imports",
    [
        "import hf_hyperdflash",  # then the runtime's import installs the integration over the library's stand-in
        "from hf_hyperdflash.modeling import HyperDFlashForDrafting",
    ],
)
@pytest.mark.slow
def test_importing_the_library_before_transformers_still_takes_over_generate(imports):
    """`import hf_hyperdflash` as a script's first line: transformers' first `generate()` loads the runtime, so
    prompt lookup on a stateful V4 target (refused by stock transformers) decodes as plain decoding does, and so
    does a drafter, whichever of the library and the runtime was imported first."""
    script = f"""{imports}
import torch
from hf_hyperdflash.modeling import HyperDFlashForDrafting
from hf_hyperdflash.testing import tiny_deepseek_v4
target = tiny_deepseek_v4(seed=0)
prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
drafter = HyperDFlashForDrafting.from_target(target, block_size=4).eval()
drafted = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter)  # the first generate()
plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
lookup = target.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
print(torch.equal(plain, lookup) and torch.equal(plain, drafted))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "True"
