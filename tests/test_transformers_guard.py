"""What a user on a transformers outside the tested range sees: one warning for a newer release (a Hub user who loads a
drafter's remote code never installed our pin), and a named error, before any decoding, when an internal the runtime
relies on is gone; never an AttributeError from inside transformers' loop, never a silent fallback to plain
decoding."""

import warnings

import pytest
import torch
import transformers
import transformers.generation.utils as generation_utils

from hf_hyperdflash import HyperDFlashForDrafting
from hf_hyperdflash.modeling import integration, transformers_compat
from hf_hyperdflash.testing import tiny_deepseek_v4

pytestmark = pytest.mark.compat
TESTED = "5.23.x to 5.25.x"


def _warnings_on_loading_the_runtime(monkeypatch, version: str, loads: int = 3) -> list[warnings.WarningMessage]:
    """The warnings of loading the runtime `loads` times (the library, remote-code folders) under `version`."""
    monkeypatch.setattr(transformers, "__version__", version)
    monkeypatch.delattr(transformers, transformers_compat._WARNED_UNTESTED, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(loads):
            integration.install_generate_integration()
    return [w for w in caught if "hf-hyperdflash" in str(w.message)]


def test_a_newer_transformers_warns_once_naming_the_tested_range(monkeypatch):
    (warning,) = _warnings_on_loading_the_runtime(monkeypatch, "5.26.0.dev0")
    assert TESTED in str(warning.message) and "5.26.0.dev0" in str(warning.message)
    assert "transformers<5.26" in str(warning.message)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.1", "5.25.0"])
def test_a_tested_transformers_does_not_warn(monkeypatch, version):
    assert not _warnings_on_loading_the_runtime(monkeypatch, version)


@pytest.mark.parametrize(
    ("owner", "name"),
    [(generation_utils, "_split_model_outputs"), (transformers.GenerationMixin, "_get_candidate_generator")],
)
def test_a_missing_internal_fails_by_name_before_decoding(monkeypatch, owner, name):
    target = tiny_deepseek_v4()
    drafter = HyperDFlashForDrafting.from_target(target, block_size=4).eval()
    forwards = []
    target.register_forward_hook(lambda *_: forwards.append(1))
    monkeypatch.delattr(owner, name)
    with pytest.raises(RuntimeError, match=rf"`[\w.]+\.{name}`.*{TESTED}"):
        target.generate(torch.tensor([[5, 17, 33, 9]]), max_new_tokens=4, do_sample=False, assistant_model=drafter)
    assert not forwards  # refused before the prefill
