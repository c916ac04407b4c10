"""Bad inputs to tpudiag import: one clear line naming the file, non-zero exit, store unchanged."""

from __future__ import annotations

import gzip
import hashlib
import io
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, run_tpudiag
from tpudiag.errors import TpudiagError
from tpudiag.importer import import_paths
from tpudiag.progress import StatusLine
from tpudiag.store import Store, queries

SAMPLE_KINETO = REPO / "sample_traces" / "cpu_mlp.trace.json.gz"
SAMPLE_XPLANE = REPO / "sample_traces" / "tpu_device.xplane.pb"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


@pytest.fixture
def seeded(db: Path) -> Path:
    """A store that already holds one good run."""
    proc = run_tpudiag("import", str(SAMPLE_KINETO), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    return db


def _bad_files(tmp: Path) -> dict[str, Path]:
    raw = gzip.decompress(SAMPLE_KINETO.read_bytes())
    xspace = SAMPLE_XPLANE.read_bytes()
    files = {
        "empty": b"",
        "truncated_json": raw[: len(raw) // 2],
        "truncated_gzip": SAMPLE_KINETO.read_bytes()[:-40],
        "truncated_xplane": xspace[: len(xspace) // 2],
        "wrong_json": b'{"hello": "world"}',
        "text": b"just some words\n",
        "json_list_of_numbers": b"[1, 2, 3]",
    }
    out = {}
    for name, data in files.items():
        suffix = ".xplane.pb" if "xplane" in name else ".json.gz" if "gzip" in name else ".json"
        path = tmp / f"{name}{suffix}"
        path.write_bytes(data)
        out[name] = path
    return out


def test_each_bad_file_gives_one_clear_line_and_leaves_the_store_unchanged(seeded: Path, tmp_path: Path) -> None:
    before = _digest(seeded)
    for name, path in _bad_files(tmp_path).items():
        proc = run_tpudiag("import", str(path), "--db", str(seeded))
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tpudiag: error:")]
        assert proc.returncode != 0, name
        assert "Traceback" not in proc.stderr, (name, proc.stderr)
        assert len(errors) == 1 and str(path) in errors[0], (name, proc.stderr)
        assert _digest(seeded) == before, name
    assert len(queries.list_runs(Store(seeded))) == 1
    assert [p.name for p in (seeded.parent / "store.runs").iterdir()] == [queries.list_runs(Store(seeded))[0]["id"]]


def test_folder_with_bad_files_imports_the_good_ones_and_reports_the_rest(db: Path, tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    bad = _bad_files(folder)
    (folder / "good.json.gz").write_bytes(SAMPLE_KINETO.read_bytes())
    proc = run_tpudiag("import", str(folder), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("tpudiag: warning: skipped")]
    assert len(warned) == len(bad)
    assert all(any(str(p) in w for w in warned) for p in bad.values())
    run = queries.resolve_run(Store(db), proc.stdout.strip())
    assert len(run["notes"]) == len(bad)
    assert queries.trace_counts(Store(db), run["id"])  # the good file's events are there


def test_missing_path_is_a_clean_error(db: Path, tmp_path: Path) -> None:
    proc = run_tpudiag("import", str(tmp_path / "nope.json"), "--db", str(db))
    assert proc.returncode != 0 and "no such file" in proc.stderr and "Traceback" not in proc.stderr
    assert not db.exists()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=4096), prefix=st.sampled_from([b"", b"{", b"[", b"\x1f\x8b", b"\n{\n  "]))
def test_random_bytes_never_crash_and_never_write(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, prefix: bytes
) -> None:
    tmp = tmp_path_factory.mktemp("rand")
    path = tmp / "random.json"
    path.write_bytes(prefix + data)
    store = Store(tmp / "s.duckdb")
    try:
        import_paths(store, [path], status=StatusLine(io.StringIO()))
    except TpudiagError as err:
        assert str(path) in str(err)
        assert not store.path.exists()
        assert not store.runs_dir.exists() or not any(store.runs_dir.iterdir())
    else:  # random bytes that happen to be a valid trace must have produced a run
        assert queries.list_runs(store)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=2048))
def test_random_bytes_shaped_like_an_xspace_never_crash(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    tmp = tmp_path_factory.mktemp("randx")
    path = tmp / "random.xplane.pb"
    path.write_bytes(b"\x0a" + bytes([min(len(data), 127)]) + data)  # a plausible first field: goes to xprof
    store = Store(tmp / "s.duckdb")
    try:
        import_paths(store, [path], status=StatusLine(io.StringIO()))
    except TpudiagError as err:
        assert str(path) in str(err)
        assert not store.path.exists()
