"""What `rhizome up` prints once the platform is up: where it serves, its TLS, the admin
token's file and the dashboard's one-time login link."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:  # the CLI starts without importing the platform's modules
    from services.embedded.platform import PlatformState


def print_up_summary(err: Console, state: PlatformState, backend: str = "local") -> None:
    err.print(
        f"[green]Rhizome is up[/green]: API {state.api_address}, REST {state.rest_url}, data {state.data_dir}"
    )
    if backend == "local":
        from services.backends.local.isolation import data_dir_fallback

        fallback = data_dir_fallback(Path(state.data_dir))
        if fallback:
            err.print(f"[yellow]warning:[/yellow] {fallback}", soft_wrap=True)
    if state.tls:
        trust = f"its CA is {state.tls_ca}" if state.tls_ca else "trusting the system's CAs"
        err.print(f"TLS on the API and REST ({trust}); this CLI and the SDK trust it here")
    else:
        err.print("[yellow]the API serves plaintext: tokens travel in clear text[/yellow]")
    token_file = Path(state.data_dir) / "admin.token"
    if token_file.exists():
        err.print(
            f"admin token in {token_file} (mode 0600): this CLI and the SDK use it here; "
            "`rhizome token create --user NAME` makes one for someone else"
        )
        import httpx

        from services.dashboard.login_link import login_link

        try:
            link = login_link(state.rest_url, token_file, state.tls_ca if state.tls else "")
            # soft_wrap: a terminal's width must not break the link across lines.
            err.print(
                f"dashboard {state.rest_url}/ — sign in once with {link} (10 minutes)",
                soft_wrap=True,
            )
            if state.tls and state.tls_ca:
                err.print(
                    f"the dashboard's certificate is signed by this platform's own CA, "
                    f"{state.tls_ca}: import it into your browser to trust it",
                    soft_wrap=True,
                )
        except (OSError, httpx.HTTPError, KeyError, ValueError) as exc:
            # The platform is up all the same; say why there is no link.
            err.print(f"dashboard {state.rest_url}/ (no login link: {exc}; sign in with the token)")
