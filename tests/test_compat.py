"""Old import paths and names (before the package was arranged in layers) keep working for one
release, each with a DeprecationWarning that names the new home."""

from __future__ import annotations

import importlib
import sys

import pytest

import tf_sparsify
from tf_sparsify.compat import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_gives_the_new_module_and_warns(old):
    sys.modules.pop(old, None)  # imported before: import it again
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]


def test_renamed_and_moved_names_warn_and_resolve():
    from tf_sparsify.compressors.base import MultiRoundMethod
    from tf_sparsify.core.state_views import StateViews

    with pytest.warns(DeprecationWarning, match="MultiRoundMethod"):
        assert tf_sparsify.compressors.MultiRoundExchange is MultiRoundMethod
    with pytest.warns(DeprecationWarning, match=r"core\.state_views"):
        assert importlib.import_module("tf_sparsify.core.state").StateViews is StateViews
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = tf_sparsify.compressors.Nothing


def test_the_public_api_is_where_it_was():
    for name in tf_sparsify.__all__:
        assert getattr(tf_sparsify, name) is not None
    assert tf_sparsify.theory.max_step_size(1.0, 0) == pytest.approx(1.0)
