"""The `lopa.model` package: its names load on first use, each from its own module."""

from __future__ import annotations

import importlib

import pytest

import lopa.model


@pytest.mark.parametrize("name", lopa.model.__all__)
def test_every_exported_name_is_the_one_of_its_module(name: str) -> None:
    source = importlib.import_module(f"lopa.model.{lopa.model._SOURCES[name]}")
    assert getattr(lopa.model, name) is getattr(source, name)


def test_the_exports_and_their_sources_agree_and_a_missing_name_is_an_attribute_error() -> None:
    assert sorted(lopa.model.__all__) == sorted(lopa.model._SOURCES)
    with pytest.raises(AttributeError, match=r"lopa\.model.*no attribute 'DreamModle'"):
        lopa.model.DreamModle  # noqa: B018
