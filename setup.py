"""Build hook: generate the gRPC stubs from proto/ at build time (pyproject.toml holds the configuration).

Regular builds write them into the build tree (so wheels carry them); editable installs write them into
services/proto_gen in the source tree. services/wire.py regenerates them on import if they go stale.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _wire():
    # Loaded from its file: importing the `services` package here would need its runtime dependencies.
    spec = importlib.util.spec_from_file_location("_specsplit_wire", HERE / "services" / "wire.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        wire = _wire()
        if getattr(self, "editable_mode", False):
            out = HERE / "services" / "proto_gen"
        else:
            out = Path(self.build_lib) / "services" / "proto_gen"
        for path in wire.generate(out, wire.PROTO_FILE):
            self.announce(f"generated {path}", level=2)


setup(cmdclass={"build_py": BuildPyWithStubs})
