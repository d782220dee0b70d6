"""Saved drafters load through `drafting.py`, the module that installs the generate() integration.

transformers' `save_pretrained` copies a model's own file and its relative imports, and points `auto_map` at that
file. A drafter's modeling file does not import the integration (models sit below generation), so the saved folder
also gets `drafting.py` and what it imports, and `auto_map["AutoModel"]` names the class through it: loading the
folder with `trust_remote_code=True` then installs the integration, in a process that never installed this library.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files

ENTRY_MODULE = Path(__file__).with_name("drafting.py")


def point_auto_map_at_entry(save_directory: str | os.PathLike, class_name: str) -> None:
    """Copy the entry module and its relative imports into `save_directory`; `AutoModel` loads `class_name` from it."""
    folder = Path(save_directory)
    for source in [ENTRY_MODULE, *map(Path, get_relative_import_files(str(ENTRY_MODULE)))]:
        shutil.copyfile(source, folder / source.name)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("auto_map", {})["AutoModel"] = f"{ENTRY_MODULE.stem}.{class_name}"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class RemoteCodeMixin:
    """`save_pretrained` writes a folder whose remote code installs the integration when the drafter class loads."""

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if (Path(save_directory) / "config.json").exists():  # only the main process writes (multi-process saves)
            point_auto_map_at_entry(save_directory, type(self).__name__)
        return result
