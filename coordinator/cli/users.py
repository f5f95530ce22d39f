"""``wildfed-coordinator user ...``: the web view's accounts (add, list, set-role, set-password, disable, enable;
Argon2id hashes, coordinator/web/auth.py); mounted by :mod:`coordinator.cli.web`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from shared.errors import ConfigError

from coordinator.cli.common import config_option, console, friendly
from coordinator.config import load_config
from coordinator.storage import Store

__all__ = ["user_app"]


user_app = typer.Typer(name="user", help="Accounts of the rangers' web view: add, list, set-role, set-password, "
                       "disable, enable.",
                       no_args_is_help=True, add_completion=False)


def _accounts(config: Path):  # noqa: ANN202 - (Store, AccountStore)
    from coordinator.web.auth import AccountStore

    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    return store, AccountStore(store)


@user_app.command("add")
@friendly
def user_add(username: str = typer.Argument(..., help="2-64 characters of a-z, 0-9, _.-"),
             role: str = typer.Option(..., "--role", help="operator, ranger (exact locations), partner or public "
                                      "(sensitive locations fuzzed)"),
             password_stdin: bool = typer.Option(False, "--password-stdin", help="read the password from the first "
                                                 "line of standard input (scripts, provisioning), not a prompt"),
             config: Path = config_option()) -> None:
    """Create a web-view account; the password is asked twice and never echoed (Argon2id hash stored)."""
    from coordinator.web.auth import AccountError

    store, accounts = _accounts(config)  # a broken config fails before the password is asked
    try:
        if accounts.get(username) is not None:  # and so does a taken name
            raise AccountError(f"user {username!r} exists", field="username",
                               fix="choose another name, or use `user set-role` / `user set-password`")
        if password_stdin:
            import sys

            password = sys.stdin.readline().rstrip("\r\n")
        else:
            password = _prompt_password()
        account = accounts.create(username, password, role)
    finally:
        store.dispose()
    console.print(f"[green]created[/] {escape(account.username)} ({account.role.value})")


@user_app.command("set-password")
@friendly
def user_set_password(username: str = typer.Argument(..., help="an existing account"),
                      config: Path = config_option()) -> None:
    """Give an account a new password (asked twice, never echoed); its web sessions end at once."""
    from coordinator.web.auth import AccountError

    store, accounts = _accounts(config)
    try:
        if accounts.get(username) is None:
            raise AccountError(f"user {username!r} does not exist", field="username",
                               fix="list the accounts with `wildfed-coordinator user list`, or create it with "
                                   "`wildfed-coordinator user add NAME --role ROLE`")
        password = _prompt_password("new password", fix="run it on a terminal (an ssh session with -t)")
        account = accounts.update(username, password=password)
    finally:
        store.dispose()
    console.print(f"[green]password changed[/] for {escape(account.username)}; its web sessions have ended "
                  "(log in again with the new password)")


@user_app.command("list")
@friendly
def user_list(config: Path = config_option()) -> None:
    """List the web-view accounts and their roles."""
    store, accounts = _accounts(config)
    try:
        rows = accounts.list()
    finally:
        store.dispose()
    table = Table(title=f"{len(rows)} account(s)")
    for col in ("user", "role", "state"):
        table.add_column(col)
    for a in rows:
        table.add_row(escape(a.username), a.role.value, "disabled" if a.disabled else "active")
    console.print(table)


def _user_update(username: str, config: Path, **change: object) -> None:
    store, accounts = _accounts(config)
    try:
        account = accounts.update(username, **change)  # type: ignore[arg-type]
    finally:
        store.dispose()
    console.print(f"[green]updated[/] {escape(account.username)}: {account.role.value}, "
                  f"{'disabled' if account.disabled else 'active'}")


@user_app.command("set-role")
@friendly
def user_set_role(username: str = typer.Argument(...), role: str = typer.Argument(..., help="operator, ranger, "
                  "partner or public"), config: Path = config_option()) -> None:
    """Change an account's role."""
    _user_update(username, config, role=role)


@user_app.command("disable")
@friendly
def user_disable(username: str = typer.Argument(...), config: Path = config_option()) -> None:
    """Disable an account (it can no longer log in; nothing is deleted)."""
    _user_update(username, config, disabled=True)


@user_app.command("enable")
@friendly
def user_enable(username: str = typer.Argument(...), config: Path = config_option()) -> None:
    """Enable a disabled account again."""
    _user_update(username, config, disabled=False)


def _prompt_password(label: str = "password",
                     fix: str = "pipe it in with --password-stdin (its first line is the password)") -> str:
    """A password asked twice without echo (on the terminal; from standard input where there is none).

    Raises:
        ConfigError: standard input ended before a password came and is not a terminal (a script, a pipe, no
            input); ``fix`` says what to do instead.
    """
    import sys

    import click

    try:
        return typer.prompt(label, hide_input=True, confirmation_prompt=True)
    except (click.exceptions.Abort, typer.Abort):
        if sys.stdin.isatty():
            raise  # Ctrl-C or Ctrl-D at the prompt
        raise ConfigError("no terminal to ask the password on, and no password on standard input", field="password",
                          fix=fix) from None
