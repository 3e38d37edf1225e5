"""scripts/triton_cache.py: Triton's compile cache carried between GPU machines. What it keeps and drops, the size
cap (newest first), a restore that leaves nothing outside the cache, and, with a Triton that can compile for sm_90
here, that Triton loads a restored entry instead of compiling again."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("triton_cache", f"{ROOT}/scripts/triton_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(cache, key, name, size=64, mtime=None):
    """A cache entry as Triton writes one: IRs, metadata, cubin and a group file naming them by absolute path."""
    d = cache / key
    d.mkdir(parents=True)
    files = {}
    for suffix in (".source", ".ttir", ".ttgir", ".llir", ".ptx", ".cubin", ".json"):
        (d / f"{name}{suffix}").write_bytes(os.urandom(size))
        files[f"{name}{suffix}"] = str(d / f"{name}{suffix}")
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": files}))
    if mtime is not None:
        os.utime(d, (mtime, mtime))
    return d


def test_save_keeps_what_loading_reads_and_restore_rewrites_the_group(tmp_path):
    tc = _script()
    src, dst = tmp_path / "src", tmp_path / "dst"
    _entry(src, "AAA", "k1")
    archive = str(tmp_path / "c.tgz")
    assert tc.save(str(src), archive, 15.0, str(dst)) == 1
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    assert names == ["AAA/__grp__k1.json", "AAA/k1.cubin", "AAA/k1.json"]
    assert tc.restore(archive, str(dst)) == 3
    group = json.loads((dst / "AAA" / "__grp__k1.json").read_text())["child_paths"]
    assert group == {"k1.cubin": str(dst / "AAA" / "k1.cubin"), "k1.json": str(dst / "AAA" / "k1.json")}
    assert (dst / "AAA" / "k1.cubin").read_bytes() == (src / "AAA" / "k1.cubin").read_bytes()
    assert tc.restore(archive, str(dst)) == 0  # what is there stays
    assert tc.restore(str(tmp_path / "missing.tgz"), str(dst)) == 0


def test_save_takes_the_newest_entries_up_to_the_cap(tmp_path):
    tc = _script()
    src = tmp_path / "src"
    for i in range(6):  # random bytes do not compress: ~200 KiB an entry kept (cubin + json)
        _entry(src, f"E{i}", "k", size=100 * 1024, mtime=1_000_000 + i)
    archive = str(tmp_path / "c.tgz")
    taken = tc.save(str(src), archive, 0.5, str(tmp_path / "dst"))
    assert 1 <= taken < 6 and os.path.getsize(archive) <= 0.5 * 2**20
    with tarfile.open(archive) as tar:
        keys = {n.split("/")[0] for n in tar.getnames()}
    assert keys == {f"E{i}" for i in range(6 - taken, 6)}  # the newest


def test_restore_writes_only_entry_files_inside_the_cache(tmp_path):
    tc = _script()
    archive = tmp_path / "evil.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("../outside.json", "/abs.json", "a/b/deep.json", "K/k.ttir", "K/k.cubin"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    dst = tmp_path / "cache"
    assert tc.restore(str(archive), str(dst)) == 1
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == ["K/k.cubin"]
    assert not (tmp_path / "outside.json").exists()


def _compile_sm90(fn):
    """``fn`` compiled for sm_90 as the launcher would (Triton's real compiler, no GPU needed), through the cache
    ``TRITON_CACHE_DIR`` names."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={(2,): 256})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_triton_loads_a_restored_entry_instead_of_compiling(tmp_path, monkeypatch):
    """A real sm_90 compile into one cache, carried into another: compiling the same kernel there adds no file
    (Triton found the entry) and gives the same cubin."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel has no ptxas")
    import triton.language as tl

    @triton.jit
    def _double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    tc = _script()
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(first))
    cubin = _compile_sm90(_double).asm["cubin"]
    assert any(p.suffix == ".ttir" for p in first.rglob("*"))  # a cold compile writes its IRs
    tc.save(str(first), str(tmp_path / "c.tgz"), 15.0, str(second))
    assert tc.restore(str(tmp_path / "c.tgz"), str(second)) > 0
    before = sorted(str(p) for p in second.rglob("*"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(second))
    again = _compile_sm90(_double)
    assert sorted(str(p) for p in second.rglob("*")) == before
    assert again.asm["cubin"] == cubin and "ttir" not in again.asm
