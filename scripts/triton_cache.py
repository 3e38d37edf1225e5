"""Carries Triton's compile cache from one GPU machine to the next, so a fresh machine does not spend its first
minutes compiling kernels a previous session already compiled (on the H100, 2026-12-06: the NVFP4 dummy model's
first server start took 170 s on a fresh machine against 68-71 s once the cache was warm; the GPU tests of a fresh
machine spend most of their time compiling). Device time is the budget a session has least of.

    python3 scripts/triton_cache.py restore .gpucache/triton_cache.tgz   # before anything compiles; prints the dir
    python3 scripts/triton_cache.py save "$OUT/triton_cache.tgz"          # at the end: what comes back with $OUT

Triton keys each entry on the kernel's source, its specialization, the compile options, the target (cuda, sm_90:
the H100's and the H200's cubins are interchangeable) and Triton's own version, so a stale entry is never hit, it
only takes room. Each entry's group file names its files by absolute path, so the cache lives at one fixed path
(``CACHE_DIR``) on every machine. Kept per entry: what loading a compiled kernel reads (its metadata ``.json``, the
``.cubin``, a launcher ``.so`` built for the machine's Python), not the intermediate IRs (``.ttir``, ``.ttgir``,
``.llir``, ``.ptx``, ``.source``), which are most of the bytes; newest entries first up to ``--max-mib`` compressed,
under what one file from ``$OUT`` may be. Autotuning results are not carried (they are timings of one card).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile

CACHE_DIR = "/tmp/ft-triton-cache"
KEEP_SUFFIXES = (".json", ".cubin", ".so")
GROUP_PREFIX = "__grp__"


def entry_files(entry_dir: str, target_dir: str = CACHE_DIR) -> dict[str, bytes]:
    """One cache entry's files to keep, by name, its group files rewritten to name only the kept files, at the
    paths they will have under ``target_dir`` (Triton loads what a group names and exists there)."""
    names = sorted(n for n in os.listdir(entry_dir) if n.endswith(KEEP_SUFFIXES))
    out = {}
    for name in names:
        with open(os.path.join(entry_dir, name), "rb") as f:
            data = f.read()
        if name.startswith(GROUP_PREFIX):
            try:
                children = json.loads(data)["child_paths"]
            except (ValueError, KeyError, TypeError):
                continue  # not a group Triton would take: leave it behind
            key = os.path.basename(entry_dir)
            kept = {c: os.path.join(target_dir, key, c) for c in children if c.endswith(KEEP_SUFFIXES)}
            data = json.dumps({"child_paths": kept}).encode()
        out[name] = data
    return out


def save(cache_dir: str, archive: str, max_mib: float, target_dir: str = CACHE_DIR) -> int:
    """Writes the newest entries of ``cache_dir`` into ``archive`` (tar.gz) up to ``max_mib`` compressed, for
    ``restore`` into ``target_dir``; returns how many entries went in."""
    if not os.path.isdir(cache_dir):
        print(f"triton cache: nothing at {cache_dir}")
        return 0
    entries = [os.path.join(cache_dir, d) for d in os.listdir(cache_dir)]
    entries = sorted((e for e in entries if os.path.isdir(e)), key=os.path.getmtime, reverse=True)
    limit = int(max_mib * 2**20)
    buf = io.BytesIO()
    taken = skipped = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for entry in entries:
            files = entry_files(entry, target_dir)
            if not files:
                continue
            # the compressed size of what is in so far, plus this entry uncompressed: never over the limit
            if buf.tell() + sum(len(d) for d in files.values()) > limit:
                skipped += 1
                continue
            for name, data in files.items():
                info = tarfile.TarInfo(f"{os.path.basename(entry)}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            taken += 1
    with open(archive, "wb") as f:
        f.write(buf.getvalue())
    print(f"triton cache: {taken} entries into {archive} ({len(buf.getvalue()) / 2**20:.1f} MiB), {skipped} left out")
    return taken


def restore(archive: str, cache_dir: str) -> int:
    """Unpacks ``archive`` into ``cache_dir`` (entries already there are kept); returns how many files came in."""
    if not os.path.exists(archive):
        print(f"triton cache: no {archive}, starting cold", file=sys.stderr)
        return 0
    os.makedirs(cache_dir, exist_ok=True)
    n = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or len(parts) != 2 or not all(parts) or ".." in parts:
                continue  # only entry/file, nothing that would leave the cache
            if not parts[1].endswith(KEEP_SUFFIXES):  # what save leaves behind
                continue
            dest = os.path.join(cache_dir, *parts)
            if os.path.exists(dest):
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(tar.extractfile(member).read())
            n += 1
    print(f"triton cache: {n} files from {archive} into {cache_dir}", file=sys.stderr)
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("restore", help="unpack an archive into the cache dir, then print the dir")
    r.add_argument("archive")
    r.add_argument("--cache-dir", default=CACHE_DIR)
    s = sub.add_parser("save", help="pack the cache dir's newest entries into an archive")
    s.add_argument("archive")
    s.add_argument("--cache-dir", default=CACHE_DIR)
    s.add_argument("--max-mib", type=float, default=15.0)
    a = p.parse_args(argv)
    if a.verb == "restore":
        restore(a.archive, a.cache_dir)
        print(a.cache_dir)
    else:
        save(a.cache_dir, a.archive, a.max_mib, a.cache_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
