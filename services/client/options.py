"""The `rhizome` CLI's shared state and options: `Ctx` (where the API is, who calls it,
the data directory), `--json`, and the global options every command takes before or
after its name (`rhizome --data-dir X up` and `rhizome up --data-dir X`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from services.client.sdk import Client, ClientError
from services.config import DEFAULT_API_ADDRESS, DEFAULT_DATA_DIR

F = TypeVar("F", bound=Callable[..., Any])


class Ctx:
    def __init__(
        self,
        api: str | None,
        user: str | None,
        data_dir: Path,
        token: str | None = None,
        tls_ca: Path | None = None,
        plaintext: bool = False,
    ) -> None:
        self._api = api
        self.user = user
        self.data_dir = data_dir
        self.token = token
        self.tls_ca = tls_ca
        self.plaintext = plaintext
        self.json = False  # `rhizome --json CMD`: every command's --json
        self._client: Client | None = None

    def override(self, attr: str, value: Any) -> None:
        """A global option given after the subcommand (`rhizome list --data-dir X`)."""
        if attr == "data_dir":
            value = Path(value).expanduser()
        setattr(self, "_api" if attr == "api" else attr, value)
        self._client = None  # the next call connects with what is set now

    @property
    def api(self) -> str:
        if self._api:
            return self._api
        from services.embedded.platform import StaleStateError, read_state

        try:
            state = read_state(self.data_dir)
        except StaleStateError as exc:
            raise ClientError("FAILED_PRECONDITION", str(exc)) from None
        if state and state.api_address:
            return state.api_address
        return DEFAULT_API_ADDRESS

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(
                self.api,
                self.user,
                token=self.token,
                data_dir=self.data_dir,
                tls=False if self.plaintext else None,
                ca_file=self.tls_ca,
            )
        return self._client


def _json_default(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    obj = ctx.find_object(Ctx)
    return value or bool(obj and obj.json)


json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    callback=_json_default,
    help="Print machine-readable JSON.",
)


# The options every command takes, before or after its name (`rhizome --data-dir X up` and
# `rhizome up --data-dir X`): (Ctx attribute, click declarations, the group's settings).
GLOBAL_OPTIONS: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
    (
        "api",
        ("--api",),
        {
            "envvar": "RHIZOME_API",
            "metavar": "HOST:PORT",
            "help": "Trainer API address (default: the embedded platform's, else 127.0.0.1:50051); "
            "a comma-separated list (ACTIVE,STANDBY) fails over to the next on UNAVAILABLE.",
        },
    ),
    (
        "token",
        ("--token",),
        {
            "envvar": "RHIZOME_TOKEN",
            "help": "API token (default: $RHIZOME_TOKEN, else the embedded platform's "
            "<data dir>/admin.token).",
        },
    ),
    (
        "user",
        ("--user",),
        {
            "envvar": "RHIZOME_USER",
            "help": "User id sent when there is no token; only a daemon run with "
            "--insecure-trust-user-header believes it (default: $USER).",
        },
    ),
    (
        "data_dir",
        ("--data-dir",),
        {
            "type": click.Path(path_type=Path, file_okay=False),
            "envvar": "RHIZOME_DATA_DIR",
            "help": f"Embedded platform data directory (default: {DEFAULT_DATA_DIR}).",
        },
    ),
    (
        "tls_ca",
        ("--tls-ca", "tls_ca"),
        {
            "type": click.Path(path_type=Path, dir_okay=False),
            "envvar": "RHIZOME_TLS_CA",
            "help": "Call the API over TLS trusting this CA certificate (default: the "
            "embedded platform's <data dir>/tls/ca.pem when --api is that platform's).",
        },
    ),
    (
        "plaintext",
        ("--insecure-plaintext", "plaintext"),
        {"is_flag": True, "help": "Call the API without TLS (tokens travel in clear text)."},
    ),
    ("json", ("--json", "as_json"), {"is_flag": True, "help": "Print machine-readable JSON."}),
]


def global_options(fn: F) -> F:
    """The group's own global options (`rhizome --api X CMD`), read from env too."""
    for _attr, decls, settings in reversed(GLOBAL_OPTIONS):
        fn = click.option(*decls, default=None, **settings)(fn)
    return fn


def defaults_for(
    group: click.Group, flags: dict[str, Any], data_dir: Path | None
) -> dict[str, Any]:
    values = dict(flags)
    if data_dir is not None:
        values["data_dir"] = str(data_dir)
    out: dict[str, Any] = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            out[name] = defaults_for(command, flags, data_dir)
        else:
            names = {p.name for p in command.params}
            out[name] = {k: v for k, v in values.items() if k in names}
    return out


def _after_subcommand(attr: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        obj = ctx.find_object(Ctx)
        if obj is not None and value not in (None, False):
            obj.override(attr, value)

    return callback


def add_global_options(command: click.Command) -> None:
    """Give `command` (and a group's subcommands) the global options it lacks, parsed
    before its own (eager), so that a job id prefix is resolved against the platform
    they name."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_global_options(sub)
        return
    taken = {opt for p in command.params for opt in p.opts}
    for attr, decls, settings in GLOBAL_OPTIONS:
        flags = [d for d in decls if d.startswith("--")]
        if taken & set(flags) or attr == "json":
            continue  # the command's own option of that name (up's --tls-ca serves one)
        kept = {k: v for k, v in settings.items() if k != "envvar"}  # the group reads env
        command.params.append(
            click.Option(
                flags,
                default=None,
                expose_value=False,
                is_eager=True,
                callback=_after_subcommand(attr),
                **kept,
            )
        )
