"""compose.yaml (+ compose.remote-drafter.yaml) against the CLI: every SPECSPLIT_* variable a service sets is a
flag its sub-command accepts, health checks probe the address the service listens on, and the override turns
the verifier's in-process drafter into the drafter service."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import build_parser
from services.cliargs import env_name

yaml = pytest.importorskip("yaml")
ROOT = Path(__file__).resolve().parents[1]


def _load(*names: str) -> dict:
    """The services of the compose files merged like `docker compose -f a -f b` merges environments."""
    merged: dict = {}
    for name in names:
        for svc, body in yaml.safe_load((ROOT / name).read_text())["services"].items():
            cur = merged.setdefault(svc, {})
            env = {**cur.get("environment", {}), **(body.get("environment") or {})}
            cur.update(body)
            cur["environment"] = env
    return merged


def _env_flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {env_name(opt) for act in sub.choices[command]._actions for opt in act.option_strings
            if opt.startswith("--")}


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.remote-drafter.yaml"),
                                   ("compose.yaml", "compose.remote-drafter.yaml", "compose.drafter-gpu.yaml")],
                         ids=["in-process-drafter", "remote-drafter", "drafter-on-its-own-gpu"])
def test_every_variable_is_a_flag_and_health_checks_the_listen_address(files):
    services = _load(*files)
    for name, svc in services.items():
        command = svc["command"][0]
        flags = _env_flags(command)
        unknown = {k for k in svc["environment"] if k.startswith("SPECSPLIT_") and k not in flags}
        assert not unknown, f"{name}: {sorted(unknown)} are not flags of `specsplit {command}`"
        missing = set(svc.get("depends_on", {})) - set(services)
        assert not missing, f"{name} depends on services these files do not define: {sorted(missing)}"
        listen = svc["environment"].get("SPECSPLIT_LISTEN")
        if listen:
            assert listen in svc["healthcheck"]["test"], name
    assert services["gateway"]["environment"]["SPECSPLIT_VERIFIER"] == services["verifier"]["environment"][
        "SPECSPLIT_LISTEN"]


def test_the_override_moves_the_drafter_out_of_the_verifier():
    base = _load("compose.yaml")["verifier"]["environment"]
    assert base["SPECSPLIT_DRAFT"] and "SPECSPLIT_DRAFTER" not in base
    assert base["SPECSPLIT_DEVICE"].startswith("${SPECSPLIT_DEVICE:-cuda")
    both = _load("compose.yaml", "compose.remote-drafter.yaml")
    v = both["verifier"]
    assert v["environment"]["SPECSPLIT_DRAFT"] == ""          # empty = unset: no in-process drafter
    assert v["environment"]["SPECSPLIT_DRAFTER"] == both["drafter"]["environment"]["SPECSPLIT_LISTEN"]
    assert v["depends_on"]["drafter"]["condition"] == "service_healthy"


def test_the_gpu_override_gives_the_drafter_its_own_gpu():
    d = _load("compose.yaml", "compose.remote-drafter.yaml", "compose.drafter-gpu.yaml")["drafter"]
    assert d["environment"]["SPECSPLIT_DEVICE"] == "cuda:0"      # the container sees only its reserved GPU
    (dev,) = d["deploy"]["resources"]["reservations"]["devices"]
    assert dev["device_ids"] == ["${SPECSPLIT_DRAFTER_GPU:-1}"] and dev["capabilities"] == ["gpu"]
