"""`--guardians-per-host`: one option shared by `rhizomed` and `rhizome up`, refused
clearly when it is not a whole number, and handed to the LCM's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import services.daemon as daemon_module
from services.config import PlatformConfig
from services.hosting import DaemonContext
from services.lcm import hosting as lcm_hosting
from services.lcm.hosting import DEFAULT_GUARDIANS_PER_HOST, GUARDIANS_PER_HOST_ENV


class _Captured(Exception):
    """Raised by the stand-in daemon once it has the config `rhizomed` built."""


def _daemon_config(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str]) -> Any:
    """Run `rhizomed ARGS` up to building its Daemon; the PlatformConfig it got, or the
    click result when the command line was refused."""
    seen: list[PlatformConfig] = []

    def fake_daemon(config: PlatformConfig, standby: bool = False) -> None:
        seen.append(config)
        raise _Captured

    monkeypatch.setattr(daemon_module, "Daemon", fake_daemon)
    # The daemon exports the object store into os.environ: keep it out of this process.
    monkeypatch.setattr(daemon_module, "_export_object_store", lambda config: None)
    result = CliRunner().invoke(daemon_module.main, args, env=env)
    if seen:
        return seen[0]
    return result


@pytest.fixture
def data_dir(tmp_path: Path) -> list[str]:
    return ["--data-dir", str(tmp_path), "--services", "lcm"]


def test_rhizomed_takes_the_flag_and_the_variable(
    monkeypatch: pytest.MonkeyPatch, data_dir: list[str]
) -> None:
    unset = {GUARDIANS_PER_HOST_ENV: ""}  # "" is unset for click
    default = _daemon_config(monkeypatch, data_dir, unset).guardians_per_host
    assert default == DEFAULT_GUARDIANS_PER_HOST == 100
    zero = _daemon_config(monkeypatch, [*data_dir, "--guardians-per-host", "0"], unset)
    assert zero.guardians_per_host == 0  # a guardian process per job, as before
    flag = _daemon_config(monkeypatch, [*data_dir, "--guardians-per-host", "50"], unset)
    assert flag.guardians_per_host == 50
    env = _daemon_config(monkeypatch, data_dir, {GUARDIANS_PER_HOST_ENV: "7"})
    assert env.guardians_per_host == 7
    both = _daemon_config(
        monkeypatch, [*data_dir, "--guardians-per-host=3"], {GUARDIANS_PER_HOST_ENV: "7"}
    )
    assert both.guardians_per_host == 3  # the flag wins over the variable


@pytest.mark.parametrize("value", ["-1", "many", "2.5", ""])
def test_rhizomed_refuses_a_bad_value_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, data_dir: list[str], value: str
) -> None:
    result = _daemon_config(
        monkeypatch, [*data_dir, "--guardians-per-host", value], {GUARDIANS_PER_HOST_ENV: ""}
    )
    assert not isinstance(result, PlatformConfig)
    assert result.exit_code == 2, result.output
    assert "--guardians-per-host" in result.output
    assert "whole number of jobs per guardian host" in result.output
    assert "Traceback" not in result.output


def test_a_bad_variable_is_refused_naming_flag_and_variable(
    monkeypatch: pytest.MonkeyPatch, data_dir: list[str]
) -> None:
    result = _daemon_config(monkeypatch, data_dir, {GUARDIANS_PER_HOST_ENV: "-5"})
    assert not isinstance(result, PlatformConfig)
    assert result.exit_code == 2, result.output
    assert "--guardians-per-host" in result.output and GUARDIANS_PER_HOST_ENV in result.output


def test_the_lcm_config_receives_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import services.lcm.manager as manager_module
    from contract.etcd import EtcdClient

    configs: list[Any] = []

    class FakeManager:
        def __init__(self, config: Any, *_: Any) -> None:
            configs.append(config)

        def start(self) -> None: ...

        def stop(self) -> None: ...

    class FakeServer:
        def add_generic_rpc_handlers(self, handlers: Any) -> None: ...

        def add_registered_method_handlers(self, name: str, handlers: Any) -> None: ...

    monkeypatch.setattr(manager_module, "LifecycleManager", FakeManager)
    monkeypatch.setattr(EtcdClient, "connect", classmethod(lambda cls, url: None))
    monkeypatch.setattr(lcm_hosting, "jobs_repository", lambda ctx: None)
    monkeypatch.setenv(GUARDIANS_PER_HOST_ENV, "9")
    for given, expected in ((42, 42), (0, 0), (None, 9)):
        config = PlatformConfig(
            data_dir=tmp_path,
            etcd_url="http://127.0.0.1:1",
            services=("lcm",),
            guardians_per_host=given,
        )
        lcm_hosting.build(DaemonContext(config, FakeServer()))  # type: ignore[arg-type]
        # rhizomed's value wins; a daemon built in-process (None) follows the variable
        assert configs.pop().guardians_per_host == expected, given


def test_an_lcm_built_without_a_value_follows_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from services.lcm.manager import LcmConfig

    monkeypatch.delenv(GUARDIANS_PER_HOST_ENV, raising=False)
    assert LcmConfig(tmp_path, "", "").guardians_per_host == DEFAULT_GUARDIANS_PER_HOST
    monkeypatch.setenv(GUARDIANS_PER_HOST_ENV, "50")
    assert LcmConfig(tmp_path, "", "").guardians_per_host == 50
    assert LcmConfig(tmp_path, "", "", guardians_per_host=0).guardians_per_host == 0
    monkeypatch.setenv(GUARDIANS_PER_HOST_ENV, "lots")
    with pytest.raises(click.UsageError, match=GUARDIANS_PER_HOST_ENV):
        LcmConfig(tmp_path, "", "")


def test_up_passes_the_flag_to_the_daemon_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from services.client.cli import cli
    from services.embedded import platform

    calls: list[dict[str, Any]] = []

    def fake_up(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        raise click.ClickException("stop here")

    monkeypatch.setattr(platform, "up", fake_up)
    base = ["--data-dir", str(tmp_path), "up", "--embedded"]
    CliRunner().invoke(cli, [*base, "--guardians-per-host", "100"])
    CliRunner().invoke(cli, base)
    assert [c["daemon_args"] for c in calls] == [["--guardians-per-host=100"], []]
    refused = CliRunner().invoke(cli, [*base, "--guardians-per-host", "-3"])
    assert refused.exit_code == 2 and "--guardians-per-host" in refused.output
    assert len(calls) == 2  # refused before anything was started
