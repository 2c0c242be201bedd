"""The generated stubs are current: regenerating from the .proto gives the same bytes, and the hash that
guards them moves when the .proto does."""

import shutil
import subprocess
import sys

from services import wire


def test_stubs_are_not_stale(tmp_path):
    assert wire.stale_reason() is None, "run `python -c 'import services.wire as w; w.ensure_generated()'`"
    wire.generate(tmp_path)
    fresh = wire.generated_files(tmp_path)
    assert set(fresh) == set(wire.GENERATED)
    assert fresh == wire.generated_files(wire.GEN_DIR)


def test_imports_are_package_relative():
    text = (wire.GEN_DIR / "specsplit_pb2_grpc.py").read_text()
    assert "from . import specsplit_pb2" in text and "from specsplit" not in text
    assert wire.pb.DESCRIPTOR.name == wire.PROTO_NAME
    assert {s.full_name for s in wire.pb.DESCRIPTOR.services_by_name.values()} == {
        "specsplit.v1.Verifier", "specsplit.v1.Drafter", "specsplit.v1.Gateway"}


def test_changed_proto_changes_hash_and_is_stale(tmp_path):
    proto = tmp_path / "proto" / wire.PROTO_NAME
    proto.parent.mkdir(parents=True)
    shutil.copy(wire.PROTO_FILE, proto)
    out = tmp_path / "gen"
    wire.generate(out, proto)
    assert wire.stale_reason(out, proto) is None
    before = wire.proto_sha256(proto)
    proto.write_text(proto.read_text() + "\nmessage Extra { int32 x = 1; }\n")
    assert wire.proto_sha256(proto) != before
    assert "changed" in wire.stale_reason(out, proto)
    wire.generate(out, proto)
    assert wire.stale_reason(out, proto) is None
    assert "class Extra" in (out / "specsplit_pb2.pyi").read_text()


def test_missing_stubs_are_regenerated_on_import(tmp_path):
    # a fresh clone: copy the package without proto_gen and import the stubs from there
    root = tmp_path / "clone"
    shutil.copytree(wire.ROOT / "proto", root / "proto")
    (root / "services").mkdir()
    shutil.copy(wire.ROOT / "services" / "__init__.py", root / "services")
    shutil.copy(wire.ROOT / "services" / "wire.py", root / "services")
    code = "from services.wire import pb, pb_grpc; print(pb.DraftRequest.DESCRIPTOR.full_name, pb_grpc.DrafterStub)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "specsplit.v1.DraftRequest" in out.stdout
    assert wire.generated_files(root / "services" / "proto_gen") == wire.generated_files(wire.GEN_DIR)
