"""The flags the long-running daemons (`rankguard agent`, `rankguard supervisor`) share,
spelled once so both commands read and behave alike."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Opt = typer.Option

TlsCert = Annotated[
    Path, Opt(help="serve HTTPS with this certificate (PEM chain); needs --tls-key")
]
TlsKey = Annotated[Path, Opt(help="the certificate's private key (owner-only)")]
PrintConfig = Annotated[
    bool, Opt("--print-config", help="print the effective configuration as TOML and exit")
]
LogLevel = Annotated[str, Opt(help="debug, info, warning, error")]
