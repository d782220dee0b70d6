"""The built wheel ships `modeling/` as `hf_hyperdflash/modeling/` (every file), has no top-level `modeling`
package, and imports from outside the checkout once installed into an empty folder.

    python .ci/check_wheel.py dist/hf_hyperdflash-*.whl
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def main(wheel: str) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    runtime = sorted(path.name for path in (ROOT / "modeling").glob("*.py"))
    missing = [name for name in runtime if f"hf_hyperdflash/modeling/{name}" not in names]
    assert not missing, f"modeling/ files missing from the wheel: {missing}"
    top_level = {name.split("/")[0] for name in names}
    assert "modeling" not in top_level, f"the wheel installs a top-level `modeling` package: {sorted(top_level)}"
    with tempfile.TemporaryDirectory() as folder:
        site = Path(folder) / "site"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel], check=True
        )
        script = (
            "import hf_hyperdflash.modeling as m, hf_hyperdflash.modeling.drafting as d, sys; "
            f"assert m.__file__.startswith({str(site)!r}), m.__file__; print(m.__file__)"
        )
        env = {"PYTHONPATH": str(site), "PATH": ""}
        result = subprocess.run([sys.executable, "-c", script], cwd=folder, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    print(
        f"wheel check passed: {len(runtime)} modeling/ files under hf_hyperdflash/modeling/, no top-level modeling, "
        f"imports from {result.stdout.strip()}"
    )


if __name__ == "__main__":
    main(sys.argv[1])
