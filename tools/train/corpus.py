"""A code corpus that exists on every machine: the Python sources of the standard library and site-packages.

Files are read from `sysconfig` paths (stdlib, purelib, platlib), de-duplicated by content hash and
filtered (1 KB - 200 KB, strict UTF-8, looks like code rather than a data table, no special-token text).
Their order is the order of their SHA-256, so the corpus is a deterministic function of the set of files
and differs between machines only by what is installed. The held-out split is by file (a file's hash
decides), so no held-out text leaks into training.

Output: train.txt and heldout.txt, documents joined by `<|endoftext|>`, plus corpus.json (the manifest).

    python -m tools.train.corpus --out DIR [--train-mb 80] [--heldout-frac 0.02]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .common import log, write_json

DOC_SEP = "<|endoftext|>"
# Documents holding any of these strings are dropped: they would turn into control tokens in training.
SPECIAL_STRINGS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<think>", "</think>")
SKIP_DIRS = {"__pycache__", ".git"}
_SPACE = b" \t\n\r\x0b\x0c"
_ASCII_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@dataclass
class Doc:
    sha: str
    text: str
    source: str          # the first path seen with this content (for the manifest only)

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @property
    def bucket(self) -> int:
        """0..9999, from the content hash: decides the held-out split."""
        return int(self.sha[:8], 16) % 10000


def default_roots() -> list[str]:
    """stdlib first, then site-packages (purelib, platlib), existing and distinct."""
    paths = sysconfig.get_paths()
    out: list[str] = []
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = paths.get(key)
        if p and os.path.isdir(p):
            rp = os.path.realpath(p)
            if rp not in out:
                out.append(rp)
    return out  # nested roots (site-packages inside stdlib's folder) are fine: files are a set


def iter_py_files(roots: Sequence[str], min_bytes: int, max_bytes: int) -> list[str]:
    """All *.py files under roots whose size is in [min_bytes, max_bytes], sorted (symlinks not followed)."""
    found: set[str] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for fn in filenames:
                if not fn.endswith(".py"):
                    continue
                p = os.path.join(dirpath, fn)
                try:
                    st = os.stat(p, follow_symlinks=False)
                except OSError:
                    continue
                if min_bytes <= st.st_size <= max_bytes and os.path.isfile(p):
                    found.add(p)
    return sorted(found)


def looks_like_code(raw: bytes) -> bool:
    """Reject data tables and minified/generated blobs: long lines, mostly digits and punctuation."""
    lines = raw.split(b"\n")
    if max(len(ln) for ln in lines) > 1000 or len(raw) / len(lines) > 100:
        return False
    visible = len(raw.translate(None, _SPACE))
    letters = len(raw) - len(raw.translate(None, _ASCII_LETTERS))
    return visible > 0 and letters / visible >= 0.35


def _read(path: str) -> tuple[str, str | None, str]:
    """(path, text or None, reason)."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return path, None, "unreadable"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return path, None, "not utf-8"
    if "\x00" in text:
        return path, None, "nul byte"
    if any(s in text for s in SPECIAL_STRINGS):
        return path, None, "special-token text"
    if not looks_like_code(raw):
        return path, None, "not code-like"
    # One newline convention, so identical sources with CRLF endings dedupe too.
    return path, text.replace("\r\n", "\n"), ""


def collect_docs(roots: Sequence[str], min_bytes: int = 1024, max_bytes: int = 200 * 1024,
                 max_files: int | None = None, threads: int = 8) -> tuple[list[Doc], dict]:
    """Read, filter and de-duplicate; returns docs sorted by content hash and counts of what was dropped."""
    paths = iter_py_files(roots, min_bytes, max_bytes)
    if max_files is not None:
        paths = paths[:max_files]
    stats = {"files_seen": len(paths), "dropped": {}}
    by_sha: dict[str, Doc] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for path, text, reason in pool.map(_read, paths, chunksize=64):
            if text is None:
                stats["dropped"][reason] = stats["dropped"].get(reason, 0) + 1
                continue
            sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if sha in by_sha:
                stats["dropped"]["duplicate"] = stats["dropped"].get("duplicate", 0) + 1
                continue
            by_sha[sha] = Doc(sha, text, path)
    docs = [by_sha[s] for s in sorted(by_sha)]
    stats["unique_docs"] = len(docs)
    return docs, stats


def _write(path: Path, docs: Iterable[Doc]) -> tuple[int, int]:
    n = nbytes = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            if n:
                f.write(DOC_SEP)
            f.write(d.text)
            n += 1
            nbytes += d.nbytes
    return n, nbytes


def build_corpus(out_dir: str | os.PathLike[str], roots: Sequence[str] | None = None, train_mb: float = 80.0,
                 heldout_frac: float = 0.02, heldout_mb: float = 4.0, min_bytes: int = 1024,
                 max_bytes: int = 200 * 1024, max_files: int | None = None) -> dict:
    """Write train.txt / heldout.txt / corpus.json into out_dir; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    roots = list(roots) if roots else default_roots()
    log(f"corpus: scanning {len(roots)} roots: {roots}")
    docs, stats = collect_docs(roots, min_bytes, max_bytes, max_files)
    threshold = int(round(heldout_frac * 10000))
    held = [d for d in docs if d.bucket < threshold]
    train = [d for d in docs if d.bucket >= threshold]

    def cap(ds: list[Doc], mb: float) -> list[Doc]:
        limit, total, kept = int(mb * 1e6), 0, []
        for d in ds:                      # hash order: a uniform sample of the packages, not alphabetical
            if total + d.nbytes > limit:
                continue
            kept.append(d)
            total += d.nbytes
        return kept

    train, held = cap(train, train_mb), cap(held, heldout_mb)
    n_tr, b_tr = _write(out / "train.txt", train)
    n_he, b_he = _write(out / "heldout.txt", held)
    if n_tr == 0 or n_he == 0:
        raise SystemExit(f"corpus: too few files ({n_tr} train, {n_he} held-out) under {roots}")
    manifest = {
        "roots": roots,
        "python": sys.version.split()[0],
        "filters": {"min_bytes": min_bytes, "max_bytes": max_bytes, "utf8": True, "code_like": True,
                    "no_special_token_text": True},
        "heldout_rule": f"int(sha256(text)[:8], 16) % 10000 < {threshold}",
        **stats,
        "train": {"docs": n_tr, "bytes": b_tr, "cap_mb": train_mb},
        "heldout": {"docs": n_he, "bytes": b_he, "cap_mb": heldout_mb},
        "train_sha256": hashlib.sha256(b"".join(bytes.fromhex(d.sha) for d in train)).hexdigest(),
        "heldout_sha256": hashlib.sha256(b"".join(bytes.fromhex(d.sha) for d in held)).hexdigest(),
    }
    write_json(out / "corpus.json", manifest)
    log(f"corpus: {stats['files_seen']} files -> {len(docs)} unique docs; train {n_tr} docs {b_tr / 1e6:.1f} MB, "
        f"held-out {n_he} docs {b_he / 1e6:.2f} MB (dropped: {stats['dropped']})")
    return manifest


def read_docs(path: str | os.PathLike[str]) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    return [d for d in text.split(DOC_SEP) if d]


CYCLE_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def write_cycle_corpus(out_dir: str | os.PathLike[str], n_docs: int = 160, words_per_doc: int = 420,
                       seed: int = 0) -> Path:
    """Source files that repeat one fixed cycle of words (two lines per cycle), each from a random start.

    A target trained on them continues the cycle deterministically, so a drafter can learn to predict whole
    blocks: the known-good pair that shows what speculative decoding gains when drafts are accepted.
    """
    import random

    rnd = random.Random(seed)
    cycle = CYCLE_WORDS[:]
    rnd.shuffle(cycle)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        start = rnd.randrange(len(cycle))
        words = [cycle[(start + j) % len(cycle)] for j in range(words_per_doc)]
        breaks = {cycle[len(cycle) // 2 - 1], cycle[-1]}      # two lines per cycle (short lines look like code)
        text = "".join(w + ("\n" if w in breaks else " ") for w in words)
        (out / f"cycle_{i:04d}.py").write_text(text)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", action="append", help="folder to scan (repeatable; default: stdlib + site-packages)")
    ap.add_argument("--train-mb", type=float, default=80.0)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--heldout-mb", type=float, default=4.0)
    ap.add_argument("--cycle", action="store_true", help="write the synthetic cycle sources into --out instead")
    a = ap.parse_args(argv)
    if a.cycle:
        write_cycle_corpus(a.out)
        return
    build_corpus(a.out, a.root, a.train_mb, a.heldout_frac, a.heldout_mb)


if __name__ == "__main__":
    main()
