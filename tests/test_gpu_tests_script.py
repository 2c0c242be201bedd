"""bench/gpu_tests.sh's jobs (GPU_TESTS_JOBS): the test files dealt to concurrent pytest processes, each on one
visible GPU, the two-GPU tests (mark gpus2) afterwards in one process that sees every GPU, and the exit status of
any failing job. Run on the CPU with stand-ins for nvidia-smi and the kernel precompile."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_TEST = '''
import os
import pytest

def test_{name}():
    with open(os.environ["SEEN"], "a") as f:
        f.write("{name} " + os.environ.get("CUDA_VISIBLE_DEVICES", "all") + "\\n")
    assert {ok}

@pytest.mark.gpus2
def test_{name}_two():
    with open(os.environ["SEEN"], "a") as f:
        f.write("{name}_two " + os.environ.get("CUDA_VISIBLE_DEVICES", "all") + "\\n")
'''


def _run(tmp: Path, files: dict[str, bool], jobs: int) -> tuple[int, str, list[str]]:
    (tmp / "bench").mkdir(exist_ok=True)
    shutil.copy(ROOT / "bench" / "gpu_tests.sh", tmp / "bench")
    shutil.copy(ROOT / "bench" / "device_env.sh", tmp / "bench")
    for stub in ("roofline.py", "gpu_deltanet_check.py"):
        (tmp / "bench" / stub).write_text("")
    (tmp / "bin").mkdir(exist_ok=True)
    smi = tmp / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in *index*) printf '0\\n1\\n';; *) echo 'Stand-in GPU, 0';; esac\n")
    smi.chmod(0o755)
    # a wrapper, not a link: a virtual environment's interpreter reached through a link elsewhere loses its packages
    py = tmp / "bin" / "python3"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    names = []
    for name, ok in files.items():
        (tmp / f"test_{name}.py").write_text(_TEST.format(name=name, ok=ok))
        names.append(f"test_{name}.py")
    seen = tmp / "seen.txt"
    seen.write_text("")
    env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "SEEN": str(seen), "OUT": str(tmp / "out"),
           "GPU_TESTS_JOBS": str(jobs), "GPU_TEST_FILES": " ".join(names)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run(["bash", "bench/gpu_tests.sh"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr, sorted(seen.read_text().split("\n"))[1:]


def test_jobs_split_files_over_gpus_then_two_gpu_tests_see_all(tmp_path):
    rc, out, seen = _run(tmp_path, {"a": True, "b": True, "c": True}, jobs=3)
    assert rc == 0, out
    # files dealt round-robin to 3 jobs over 2 GPUs: job i on GPU i % 2; the gpus2 tests after, with every GPU
    assert seen == ["a 0", "a_two all", "b 1", "b_two all", "c 0", "c_two all"], out
    assert "gpu_tests.0.log" in out and "gpu_tests.2.log" in out and "gpu_tests.gpus2.log" in out
    assert "gpu tests rc 0" in out


def test_a_failing_job_fails_the_run(tmp_path):
    rc, out, seen = _run(tmp_path, {"a": True, "b": False}, jobs=2)
    assert rc != 0 and "FAILED" in out and "test_b" in out
    assert "a 0" in seen and "b 1" in seen


def test_jobs_must_be_a_count(tmp_path):
    rc, out, _ = _run(tmp_path, {"a": True}, jobs=0)
    assert rc == 2 and "GPU_TESTS_JOBS must be a count" in out
