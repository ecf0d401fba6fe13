"""`rhizome up` (services/embedded/platform.py `up`) replaces a port of its own choosing
that another process takes between the pick and the daemon's bind; a port the user gave is
never replaced."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.embedded import platform
from services.embedded.platform import down, grpc_serving, up
from services.embedded.process import ManagedServer, PortTaken
from tests.ports import listening_on

pytestmark = pytest.mark.integration


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process's listener holds: what `up`'s pick loses to a taker."""
    with listening_on() as port:
        yield port


def _up(
    data_dir: Path, stores: tuple[ManagedServer, ...], **ports: int | None
) -> platform.PlatformState:
    etcd, mongo, es = stores
    return up(
        data_dir,
        etcd_url=etcd.url,
        mongodb_uri=mongo.url,
        elasticsearch_url=es.url,
        tls=platform.TlsChoice(plaintext=True),
        **ports,  # type: ignore[arg-type]
    )


@pytest.fixture
def stores(
    etcd_server: ManagedServer, mongo_server: ManagedServer, es_server: ManagedServer
) -> tuple[ManagedServer, ...]:
    return etcd_server, mongo_server, es_server


def test_a_rest_port_up_picked_and_lost_before_the_bind_is_replaced_and_remembered(
    tmp_path: Path,
    stores: tuple[ManagedServer, ...],
    held_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = platform.choose_port

    def pick(what: str, flag: str, *args: int | None) -> int:
        # The REST port `up` picks is taken before the daemon binds it.
        return held_port if flag == "--rest-port" else real(what, flag, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(platform, "choose_port", pick)
    state = _up(tmp_path, stores)
    try:
        assert state.ports["rest"] != held_port
        assert state.urls["rest"] == f"http://127.0.0.1:{state.ports['rest']}"
        assert grpc_serving(state.urls["api"])
        saved = platform.read_state(tmp_path)
        assert saved is not None and saved.ports["rest"] == state.ports["rest"]
        recipe = " ".join(saved.processes["api"]["argv"])
        assert f"--rest-address=127.0.0.1:{state.ports['rest']}" in recipe
    finally:
        down(tmp_path)


def test_a_rest_port_the_user_gave_is_not_replaced(
    tmp_path: Path,
    stores: tuple[ManagedServer, ...],
    held_port: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `up --rest-port N` refuses a port held before it starts; here it is taken after that
    # check, before the daemon binds it.
    monkeypatch.setattr(platform, "port_free", lambda port: True)
    with pytest.raises(PortTaken, match=rf"listen on \({held_port}\) is in use"):
        _up(tmp_path, stores, grpc_port=0, rest_port=held_port)
    down(tmp_path)
