"""`rhizome token …`: create, list and revoke API tokens (admins only; docs/security.md)."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.table import Table

from services.client.cli import emit_json, err, fmt_time, handles_errors, out, to_dict
from services.client.durations import parse_duration
from services.client.options import Ctx, json_option


def _token_row(t: Any) -> list[str]:
    state = "revoked" if t.HasField("revoked_at") else "active"
    if state == "active" and t.HasField("expires_at") and t.expires_at.seconds < time.time():
        state = "expired"
    expires = fmt_time(t.expires_at) if t.HasField("expires_at") else "never"
    return [t.token_id, t.prefix + "…", t.user, t.role, state, fmt_time(t.created_at), expires]


@click.group(name="token")
def token() -> None:
    """Create, list and revoke API tokens (admin tokens only)."""


@token.command("create")
@click.option("--user", "for_user", default="", help="The user the token acts as (default: you).")
@click.option("--role", type=click.Choice(["user", "admin"]), default="user", show_default=True)
@click.option("--expires-in", default="0", help="Lifetime, e.g. 30d, 12h (default: never).")
@click.option("--description", default="", help="A note shown in `rhizome token list`.")
@json_option
@click.pass_obj
@handles_errors
def token_create(
    obj: Ctx, for_user: str, role: str, expires_in: str, description: str, as_json: bool
) -> None:
    """Create a token. Its secret is printed once, on stdout, and never again."""
    resp = obj.client.create_token(for_user, role, int(parse_duration(expires_in)), description)
    if as_json:
        emit_json(to_dict(resp))
        return
    t = resp.token
    expires = fmt_time(t.expires_at) if t.HasField("expires_at") else "never"
    err.print(f"token {t.token_id} for {t.user} ({t.role}), expires {expires}:")
    click.echo(resp.secret)
    err.print(
        "[yellow]Store it now: it is not shown again.[/yellow] Use it with --token or $RHIZOME_TOKEN."
    )


@token.command("list")
@json_option
@click.pass_obj
@handles_errors
def token_list(obj: Ctx, as_json: bool) -> None:
    """List tokens, newest first (never their secrets)."""
    tokens = obj.client.list_tokens()
    if as_json:
        emit_json([to_dict(t) for t in tokens])
        return
    table = Table("id", "prefix", "user", "role", "state", "created", "expires")
    for t in tokens:
        table.add_row(*_token_row(t))
    out.print(table if tokens else "no tokens")


@token.command("revoke")
@click.argument("token_id")
@json_option
@click.pass_obj
@handles_errors
def token_revoke(obj: Ctx, token_id: str, as_json: bool) -> None:
    """Revoke a token: it stops working within seconds (docs/security.md)."""
    t = obj.client.revoke_token(token_id)
    if as_json:
        emit_json(to_dict(t))
    else:
        out.print(f"token {t.token_id} ({t.user}) revoked")
