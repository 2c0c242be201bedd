"""Flags that can also come from SPECSPLIT_* environment variables; argparse value types the service commands share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "SPECSPLIT_"


def env_name(flag: str) -> str:
    """--max-queue -> SPECSPLIT_MAX_QUEUE."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def add_env_argument(parser: argparse.ArgumentParser | Any, flag: str, **kw: Any) -> None:
    """parser.add_argument(flag, ...) whose default comes from SPECSPLIT_<FLAG> when that is set.

    argparse runs `type` over string defaults, so the variable is parsed exactly like the flag would be;
    a variable also satisfies `required=True`. Boolean switches (action="store_true") read 1/true/yes/on.
    """
    env = env_name(flag)
    val = os.environ.get(env)
    if val is not None and val != "":
        if kw.get("action") in ("store_true", "store_false"):
            on = val.strip().lower() in ("1", "true", "yes", "on")
            kw["default"] = on if kw["action"] == "store_true" else not on
        else:
            kw["default"] = val
        kw["required"] = False
    kw["help"] = f"{kw.get('help', '')} [env {env}]".strip()
    parser.add_argument(flag, **kw)


def _convert(text: str, kind: Callable[[str], Any], what: str) -> Any:
    """kind(text), or an ArgumentTypeError 'expected <what>, got ...'."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum."""
    def parse(text: str) -> int:
        n = _convert(text, int, "a whole number")
        if n < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {n}")
        return n

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0."""
    x = _convert(text, float, "a number of seconds")
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {x}")
    return x


def port(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    n = _convert(text, int, "a port number")
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {n}")
    return n


def address(text: str) -> str:
    """An argparse type: a service address services.rpc.parse_address accepts, returned as given."""
    from services.rpc import parse_address

    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
