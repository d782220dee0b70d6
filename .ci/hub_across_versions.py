"""The Hub path across transformers versions: drafters saved under one supported version decode losslessly under
every other, with no import of the package.

    python .ci/hub_across_versions.py save ROOT    # save every family's tiny target and drafters under ROOT/<version>
    python .ci/hub_across_versions.py check ROOT   # decode every saved version's cases with the installed transformers

CI saves under each version it installs and checks all saved ones after each install, the newest again at the end.
"""

import json
import sys
import tempfile
from pathlib import Path

import transformers

from hf_hyperdflash.testing import DECODE_EVERY_PAIR, run_without_the_library, save_every_family


def check(root: Path) -> None:
    failures = []
    for saved in sorted(path for path in root.iterdir() if (path / "cases.json").exists()):
        cases = json.loads((saved / "cases.json").read_text())
        with tempfile.TemporaryDirectory() as workdir:
            output = run_without_the_library(Path(workdir), DECODE_EVERY_PAIR, json.dumps(cases))
        *results, status = json.loads(output.splitlines()[-1])
        if status["library_imported"]:
            failures.append(f"{saved.name}: the library was imported")
        for result in results:
            ok = result["identical"] and result["sampled_new_tokens"] == 24
            drafter = "/".join(Path(result["drafter"]).parts[-2:])
            print(
                f"saved under {saved.name}, run under {transformers.__version__}: {drafter} "
                f"{'identical to plain decoding' if result['identical'] else 'DIFFERS'}, T=1 call "
                f"{result['sampled_new_tokens']} new tokens"
            )
            if not ok:
                failures.append(f"{saved.name}: {drafter}")
    if failures:
        raise SystemExit(f"not lossless across versions: {failures}")


if __name__ == "__main__":
    command, root = sys.argv[1], Path(sys.argv[2])
    if command == "save":
        save_every_family(root / transformers.__version__)
    else:
        check(root)
