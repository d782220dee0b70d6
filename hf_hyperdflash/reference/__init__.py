"""The reference model set shipped inside the package (trained here, see `hf_hyperdflash.reference.build`).

Each function returns a local directory that the usual `from_pretrained` calls load offline:
`AutoTokenizer.from_pretrained(tokenizer_path())`, `AutoModelForCausalLM.from_pretrained(target_path())`,
`AutoModel.from_pretrained(mtp_path(), trust_remote_code=True)`.
"""

from __future__ import annotations

from pathlib import Path

from .. import _load_runtime

_load_runtime()  # the shipped drafters carry no remote code: they load through the Auto classes registered here

ASSETS = Path(__file__).parent / "assets"
DRAFTER_KINDS = ("hyperdflash", "vanilla_dflash")


def _asset(name: str) -> Path:
    path = ASSETS / name
    if not (path / "config.json").exists() and not (path / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"The reference asset {name!r} is missing at {path}. Reinstall hf-hyperdflash, or rebuild it with "
            "`python -m hf_hyperdflash.reference.build`."
        )
    return path


def tokenizer_path() -> Path:
    return _asset("tokenizer")


def target_path() -> Path:
    return _asset("target")


def mtp_path() -> Path:
    return _asset("mtp")


def dspark_path() -> Path:
    """DSpark (DeepSeek's V4 block drafter) for the reference target: configs/reference_drafter_dspark.json."""
    return _asset("dspark")


def drafter_path(kind: str) -> Path:
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"Unknown drafter kind {kind!r}; choose one of {DRAFTER_KINDS}.")
    return _asset(f"drafter_{kind}")


__all__ = ["DRAFTER_KINDS", "drafter_path", "dspark_path", "mtp_path", "target_path", "tokenizer_path"]
