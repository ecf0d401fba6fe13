"""The lazy registry every plug-in point uses."""

from __future__ import annotations

import pytest

from contract.registry import Registry, UnknownName


class Oops(ValueError):
    pass


def test_lazy_entries_are_imported_on_first_get_and_unknown_names_list_the_known() -> None:
    reg: Registry[object] = Registry("codec", error=Oops)
    reg.register("json", "json:dumps")
    reg.register("repr", repr)
    import json

    assert reg.get("json") is json.dumps and reg.get("repr") is repr
    assert reg.names() == ["json", "repr"] and "json" in reg
    with pytest.raises(
        Oops, match=r"unknown codec 'yaml'; choose one of the registered: json, repr"
    ):
        reg.get("yaml")
    with pytest.raises(ValueError, match="module:attr"):
        reg.register("bad", "no-colon")


def test_loader_runs_once_before_the_first_lookup_and_order_can_be_kept() -> None:
    calls: list[int] = []
    reg: Registry[int] = Registry("number", load=lambda: calls.append(1), ordered=True)
    reg.register("two", 2)
    reg.register("one", 1)
    assert reg.names() == ["two", "one"] and calls == [1]
    assert reg.get("one") == 1 and calls == [1]
    with pytest.raises(UnknownName):
        reg.get("three")
