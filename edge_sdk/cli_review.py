"""``wildfed-edge review`` (the rangers' review page) and ``wildfed-edge review-user add|list|disable|enable|
set-password`` (its accounts); docs/review.md.

::

    wildfed-edge review --config site.yaml [--host 127.0.0.1] [--port 8081] [--tls-cert PEM --tls-key PEM]
    wildfed-edge review-user add NAME --config site.yaml [--password-stdin]
    wildfed-edge review-user list --config site.yaml
    wildfed-edge review-user disable NAME --config site.yaml      (ends its sessions at once)
    wildfed-edge review-user enable NAME --config site.yaml
    wildfed-edge review-user set-password NAME --config site.yaml [--password-stdin]   (ends its sessions)

``review-user`` works on ``<state>/review.sqlite`` alone, so it can run while ``review`` serves. The work is
``edge_sdk.review``'s; this module parses options and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError, WildFedError

from edge_sdk import cli_common as _common

__all__ = ["register", "review", "user_app", "LOOPBACK"]

console = _common.console
out = Console()
LOOPBACK = ("127.0.0.1", "localhost", "::1")

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="site config YAML (the gateway's site.yaml)")]
PasswordStdin = Annotated[bool, typer.Option("--password-stdin", help="read the password from the first line of "
                                             "standard input instead of asking twice (for scripts)")]

user_app = typer.Typer(name="review-user", help="Accounts of the review page (kept on the gateway, "
                       "<state>/review.sqlite): add, list, disable, enable, set-password.", no_args_is_help=True,
                       add_completion=False)


def _fail(message: object, code: int = 2) -> typer.Exit:
    _common.error(message)
    return typer.Exit(code=code)


def _config(path: Path):  # noqa: ANN202 - SiteConfig
    from edge_sdk.config import load_site_config

    try:
        return load_site_config(path)
    except WildFedError as exc:
        raise _fail(exc) from None


def _accounts(path: Path):  # noqa: ANN202 - ReviewAccounts
    from edge_sdk.review.accounts import ReviewAccounts
    from edge_sdk.site_paths import review_accounts_path

    return ReviewAccounts(review_accounts_path(_config(path)))


def _password(from_stdin: bool, prompt: str) -> str:
    if from_stdin:
        return typer.get_text_stream("stdin").readline().rstrip("\r\n")
    return typer.prompt(prompt, hide_input=True, confirmation_prompt=True)


def review(
    config: ConfigOption,
    host: Annotated[str, typer.Option(help="address to listen on (the site's own network; 0.0.0.0 for every "
                                           "interface)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8081,
    tls_cert: Annotated[Optional[Path], typer.Option("--tls-cert", help="PEM certificate: serve HTTPS")] = None,
    tls_key: Annotated[Optional[Path], typer.Option("--tls-key", help="PEM private key of --tls-cert")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Serve the rangers' review page of this site until interrupted: events least certain first, every photo with
    its boxes, and verdicts written into the site's package as human observations. Make accounts first with
    `wildfed-edge review-user add NAME`. Without --tls-cert/--tls-key it serves plain HTTP, safe only on loopback
    or behind a TLS proxy."""
    import uvicorn

    from edge_sdk.review.app import create_app

    if (tls_cert is None) != (tls_key is None):
        raise _fail(ConfigError("give both --tls-cert and --tls-key, or neither", field="--tls-cert/--tls-key",
                                fix="pass the PEM certificate and its private key"))
    for option, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not path.is_file():
            raise _fail(ConfigError(f"{path} is not a file", field=option, fix="point it at a PEM file"))
    _common.setup_logging(log_level)
    cfg = _config(config)
    if cfg.incoming is None:
        console.print("[yellow]warning:[/] this site config sets no `incoming:` folder, so the field loop makes no "
                      "events here; the page shows only what an earlier run indexed")
    scheme = "https" if tls_cert else "http"
    if scheme == "http" and host not in LOOPBACK:
        console.print(f"[yellow]warning:[/] serving plain HTTP on {escape(host)}: passwords, session cookies and "
                      "the photos cross the network in the clear. Put a TLS proxy in front or pass --tls-cert and "
                      "--tls-key.")
    app = create_app(cfg, secure_cookies=tls_cert is not None)
    console.print(escape(f"review page of {cfg.site_id} on {scheme}://{host}:{port}/ (Ctrl-C stops it)"))
    ssl = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key)} if tls_cert else {}
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), proxy_headers=False, **ssl)


@user_app.command("add")
def user_add(name: Annotated[str, typer.Argument(help="2-64 characters of a-z, 0-9, _.-")], config: ConfigOption,
             password_stdin: PasswordStdin = False) -> None:
    """Create a review account; the password is asked twice and never echoed (its Argon2id hash is stored)."""
    from shared.web_auth import check_username

    accounts = _accounts(config)  # a broken config fails before the password is asked
    try:
        check_username(name)
        if accounts.get(name) is not None:  # and so does a taken name
            raise ConfigError(f"user {name!r} exists", field="username",
                              fix="choose another name, or use `wildfed-edge review-user set-password`")
        account = accounts.create(name, _password(password_stdin, "password"))
    except WildFedError as exc:
        raise _fail(exc) from None
    finally:
        accounts.close()
    out.print(f"[green]created[/] {escape(account.username)}")


@user_app.command("set-password")
def user_set_password(name: Annotated[str, typer.Argument(help="an existing account")], config: ConfigOption,
                      password_stdin: PasswordStdin = False) -> None:
    """Give an account a new password; its sessions end at once."""
    accounts = _accounts(config)
    try:
        if accounts.get(name) is None:
            raise ConfigError(f"user {name!r} does not exist", field="username",
                              fix="list the accounts with `wildfed-edge review-user list`")
        accounts.update(name, password=_password(password_stdin, "new password"))
    except WildFedError as exc:
        raise _fail(exc) from None
    finally:
        accounts.close()
    out.print(f"[green]password changed[/] for {escape(name)}; its sessions have ended")


def _set_disabled(name: str, config: Path, disabled: bool) -> None:
    accounts = _accounts(config)
    try:
        accounts.update(name, disabled=disabled)
    except WildFedError as exc:
        raise _fail(exc) from None
    finally:
        accounts.close()
    out.print(f"[green]{'disabled' if disabled else 'enabled'}[/] {escape(name)}"
              + ("; its sessions have ended" if disabled else ""))


@user_app.command("disable")
def user_disable(name: Annotated[str, typer.Argument(help="an existing account")], config: ConfigOption) -> None:
    """Disable an account: it cannot log in, and its sessions end at once."""
    _set_disabled(name, config, True)


@user_app.command("enable")
def user_enable(name: Annotated[str, typer.Argument(help="an existing account")], config: ConfigOption) -> None:
    """Enable a disabled account."""
    _set_disabled(name, config, False)


@user_app.command("list")
def user_list(config: ConfigOption) -> None:
    """List the review accounts."""
    accounts = _accounts(config)
    try:
        rows = accounts.list()
    finally:
        accounts.close()
    table = Table(title="review accounts")
    for column in ("user", "state", "created"):
        table.add_column(column)
    for a in rows:
        table.add_row(escape(a.username), "disabled" if a.disabled else "active", a.created_at)
    out.print(table)


def register(app: typer.Typer) -> None:
    """Add ``review`` and the ``review-user`` group to the ``wildfed-edge`` app."""
    app.command("review")(review)
    app.add_typer(user_app, name="review-user")
