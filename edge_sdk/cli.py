"""``wildfed-edge``: the gateway agent's command line (typer + rich).

Commands:
    ``run --config site.yaml``   connect to the broker and serve training tasks until interrupted.
    ``keygen --out DIR``         create the site's Ed25519 key pair (``site.key`` 0600, ``site.pub``).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

from shared.errors import WildFedError
from shared.keys import generate_signing_key, key_fingerprint, save_private_key, save_public_key

__all__ = ["app"]

app = typer.Typer(help="WildFed gateway agent: trains on local camera-trap data with CCDP and uploads signed "
                       "updates.", no_args_is_help=True, add_completion=False)
console = Console(stderr=True)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=console, rich_tracebacks=False, show_path=False)], force=True)


@app.command()
def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="site config YAML (see edge_sdk/config.py)")],
    max_rounds: Annotated[Optional[int], typer.Option(help="stop after this many rounds (all acknowledged)")] = None,
    idle_timeout: Annotated[Optional[float], typer.Option(help="stop after this many seconds without messages")]
    = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
    ready_file: Annotated[Optional[Path], typer.Option(help="touch this file once connected and subscribed "
                                                              "(for supervisors and the demo)")] = None,
) -> None:
    """Serve training tasks for one site until interrupted (Ctrl-C or SIGTERM stops cleanly)."""
    _setup_logging(log_level)
    from edge_sdk.agent import EdgeAgent

    try:
        agent = EdgeAgent.from_config(config)
    except WildFedError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=2) from None
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    try:
        agent.start()
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.write_text(f"{agent.config.site_id}\n")
        rounds = agent.run(max_rounds=max_rounds, idle_timeout_s=idle_timeout)
    except KeyboardInterrupt:
        rounds = None
    except WildFedError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    finally:
        agent.close()
    console.print(f"stopped; rounds trained: {rounds if rounds is not None else 'interrupted'}; "
                  f"stats: {dict(agent.stats)}")


@app.command()
def keygen(
    out: Annotated[Path, typer.Option("--out", "-o", help="directory for site.key and site.pub")],
    name: Annotated[str, typer.Option(help="file stem")] = "site",
    force: Annotated[bool, typer.Option(help="overwrite an existing key pair")] = False,
) -> None:
    """Create an Ed25519 key pair: ``<out>/<name>.key`` (PEM, mode 0600) and ``<out>/<name>.pub``."""
    private_path, public_path = out / f"{name}.key", out / f"{name}.pub"
    if private_path.exists() and not force:
        console.print(f"[bold red]error:[/] {private_path} exists (fix: pass --force to replace it, which "
                      "invalidates the site's enrolment)")
        raise typer.Exit(code=2)
    key = generate_signing_key()
    save_private_key(key, private_path)
    save_public_key(key.public_key(), public_path)
    typer.echo(f"private key: {private_path}\npublic key:  {public_path}\n"
               f"fingerprint: {key_fingerprint(key.public_key())}")


if __name__ == "__main__":  # pragma: no cover
    app()
