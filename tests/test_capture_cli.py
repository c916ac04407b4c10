"""`tpudiag capture` runs the target exactly as Python would, and stores the run however it ends.

Each test captures a real script in a subprocess, as a user would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag

NO_COLLECTORS = ("--collect", "none")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _runs(db: Path, cwd: Path) -> list[dict]:
    out = run_tpudiag("runs", "--json", "--db", str(db), cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_script_sees_argv_path_main_and_stdin_as_with_python(tmp_path: Path, db: Path) -> None:
    proj = tmp_path / "proj"
    _write(proj / "helper.py", "VALUE = 41\n")
    script = _write(
        proj / "main.py",
        """
        import json, os, sys
        import helper
        data = sys.stdin.read()
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                          "value": helper.VALUE + 1, "stdin": data, "file": __file__}))
        print("to stderr", file=sys.stderr)
        """,
    )
    args = ["scripts/x", "--name", "not-tpudiag's", "-m", "also-the-script's"]
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, str(script), *args, cwd=tmp_path, input="hello stdin")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    direct = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        input="hello stdin",
        capture_output=True,
        text=True,
    )
    assert got == json.loads(direct.stdout.strip().splitlines()[-1])
    assert got["argv"] == [str(script), *args]
    assert got["name"] == "__main__" and got["value"] == 42 and got["stdin"] == "hello stdin"
    assert out.stderr.startswith("to stderr\n")
    assert "stored in" in out.stderr.strip().splitlines()[-1]
    (run,) = _runs(db, tmp_path)
    assert run["name"] == "main" and run["argv"] == args and run["status"] == "ok" and run["exit_code"] == 0


@pytest.mark.parametrize("given", ["links/main.py", "./proj/real/main.py"])
def test_a_relative_or_linked_script_sees_argv_path_and_globals_as_with_python(
    tmp_path: Path, db: Path, given: str
) -> None:
    # python: ``sys.argv[0]`` the path as typed, ``sys.path[0]`` the real directory of the script (a symbolic link
    # resolved), ``__file__`` and the loader's path a relative path joined to the working directory (not
    # normalized), the globals of its own ``__main__``.  A script that changes directory still finds the file next
    # to it through ``__file__``.
    real = tmp_path / "proj" / "real"
    _write(real / "helper.py", "VALUE = 7\n")
    _write(
        real / "main.py",
        """
        import json, os, sys
        import helper
        names = sorted((k, type(v).__name__) for k, v in dict(globals()).items())  # __loader__, __builtins__, ...
        os.chdir("/")
        with open(os.path.join(os.path.dirname(__file__), "data.txt")) as fh:
            data = fh.read()
        print(json.dumps({"argv0": sys.argv[0], "path0": sys.path[0], "file": __file__, "value": helper.VALUE,
                          "globals": names, "loader": __loader__.path, "data": data}))
        """,
    )
    _write(tmp_path / "links" / "data.txt", "next to the link")
    _write(real / "data.txt", "next to the real file")
    (tmp_path / "links" / "main.py").symlink_to(real / "main.py")
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, given, cwd=tmp_path)
    direct = subprocess.run([sys.executable, given], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 == direct.returncode, out.stderr + direct.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    plain = json.loads(direct.stdout.strip().splitlines()[-1])
    assert plain["file"] == plain["loader"] == os.path.join(str(tmp_path), given)
    assert got == plain
    assert got["data"] == ("next to the link" if given.startswith("links") else "next to the real file")
    assert got["argv0"] == given and got["path0"] == str(real) and got["value"] == 7


def test_a_zip_application_runs_as_with_python(tmp_path: Path, db: Path) -> None:
    # A zip file is a file too, but python runs its __main__.py (a script file is compiled, a zip is not).
    import zipfile

    with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
        z.writestr("__main__.py", "import sys\nprint('zipped', sys.argv[1:])\n")
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, "app.zip", "a", cwd=tmp_path)
    direct = subprocess.run([sys.executable, "app.zip", "a"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 == direct.returncode, out.stderr
    assert out.stdout == direct.stdout == "zipped ['a']\n"


@pytest.mark.parametrize("hook", [False, True])
def test_an_uncaught_error_is_printed_by_pythons_hook_word_for_word(tmp_path: Path, db: Path, hook: bool) -> None:
    # The interpreter's display adds what the traceback module does not on 3.11 ("Did you mean"), and a script's own
    # ``sys.excepthook`` is the one that prints.
    lines = ["import os, sys"]
    if hook:
        lines += ["def hook(kind, err, tb):", "    print('the script hook:', kind.__name__, err, file=sys.stderr)",
                  "sys.excepthook = hook"]  # fmt: skip
    lines += ["def inner():", "    return os.getcwdd()", "inner()"]
    _write(tmp_path / "sub" / "typo.py", "\n".join(lines) + "\n")
    script = str(tmp_path / "sub" / "typo.py")
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, script, cwd=tmp_path)
    direct = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 == direct.returncode
    assert out.stderr.split("tpudiag: ")[0] == direct.stderr
    if hook:
        assert direct.stderr.startswith("the script hook: AttributeError")
    else:
        assert "Did you mean: 'getcwd'?" in direct.stderr
    (run,) = _runs(db, tmp_path)
    assert run["status"] == "failed" and any("AttributeError" in n for n in run["notes"])


def test_module_mode_with_relative_imports(tmp_path: Path, db: Path) -> None:
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "util.py", "def double(x):\n    return 2 * x\n")
    _write(
        tmp_path / "pkg" / "tool.py",
        """
        import sys
        from .util import double
        if __name__ == "__main__":
            print(double(int(sys.argv[1])), sys.argv[0].endswith("tool.py"), __spec__.name)
        """,
    )
    out = run_tpudiag(
        "capture", "--db", str(db), "--name", "mod-run", *NO_COLLECTORS, "-m", "pkg.tool", "21", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["42", "True", "pkg.tool"]
    (run,) = _runs(db, tmp_path)
    assert run["name"] == "mod-run" and run["script"] == "-m pkg.tool" and run["argv"] == ["21"]


@pytest.mark.parametrize("kind", ["module", "directory", "zip"])
def test_a_module_directory_or_zip_sees_what_python_gives_it_and_fails_with_pythons_traceback(
    tmp_path: Path, db: Path, kind: str
) -> None:
    # python runs these three through runpy's ``_run_module_as_main``: its two frames head an uncaught error's
    # traceback, ``sys.path[0]`` is the absolute path (the working directory for -m), ``sys.argv[0]`` the module's
    # file for -m and the path as typed otherwise.
    body = textwrap.dedent(
        """
        import json, sys
        print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
                          "spec": getattr(__spec__, "name", None), "package": __package__,
                          "globals": sorted(k for k in globals() if k.startswith("__"))}))
        def inner():
            raise ValueError("boom")
        inner()
        """
    )
    if kind == "module":
        _write(tmp_path / "pkg" / "__init__.py", "import sys\nprint('while found:', sys.argv)\n")  # ['-m', 'x']
        _write(tmp_path / "pkg" / "boom.py", body)
        given = ["-m", "pkg.boom"]
    elif kind == "directory":
        _write(tmp_path / "app" / "__main__.py", body)
        given = ["app"]
    else:
        import zipfile

        with zipfile.ZipFile(tmp_path / "app.zip", "w") as z:
            z.writestr("__main__.py", body)
        given = ["app.zip"]
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, *given, "x", cwd=tmp_path)
    direct = subprocess.run([sys.executable, *given, "x"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 == direct.returncode, out.stderr
    assert out.stdout == direct.stdout
    assert out.stderr.split("tpudiag: ")[0] == direct.stderr
    assert 'File "<frozen runpy>"' in direct.stderr and "ValueError: boom" in direct.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["path0"] == (str(tmp_path) if kind == "module" else str(tmp_path / given[0]))
    assert seen["argv"][1:] == ["x"] and seen["name"] == "__main__"


def test_a_missing_submodule_is_told_as_python_tells_it_and_its_package_runs_only_under_the_capture(
    tmp_path: Path, db: Path
) -> None:
    _write(tmp_path / "pkg" / "__init__.py", "import sys\nprint('pkg imported with', sys.argv)\n")
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, "-m", "pkg.nope", cwd=tmp_path)
    direct = subprocess.run([sys.executable, "-m", "pkg.nope"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 == direct.returncode
    assert out.stdout == direct.stdout == "pkg imported with ['-m']\n"
    assert out.stderr.split("tpudiag: ")[0] == direct.stderr
    assert "No module named pkg.nope" in direct.stderr


def test_the_tpudiag_command_finds_a_module_in_the_working_directory_as_python_m_does(tmp_path: Path, db: Path) -> None:
    # The console script's own directory is its sys.path[0], not the working directory (``python -m tpudiag``, as
    # the other tests run it, has the working directory there and hid this: "no module named 'pkg'").
    _write(tmp_path / "pkg" / "__init__.py", "")
    _write(tmp_path / "pkg" / "tool.py", "import sys\nprint('tool', sys.argv[1:], __spec__.name)\n")
    exe = Path(sys.executable).with_name("tpudiag")
    env = {k: v for k, v in os.environ.items() if k not in ("TPUDIAG_DB", "PYTHONPATH")}
    out = subprocess.run(
        [str(exe), "capture", "--db", str(db), *NO_COLLECTORS, "-m", "pkg.tool", "a"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    direct = subprocess.run(
        [sys.executable, "-m", "pkg.tool", "a"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 == direct.returncode, out.stderr
    assert out.stdout == direct.stdout == "tool ['a'] pkg.tool\n"


@pytest.mark.parametrize("code", [0, 3, 255])
def test_exit_status_is_the_scripts(tmp_path: Path, db: Path, code: int) -> None:
    script = _write(tmp_path / "exit.py", f"import sys\nsys.exit({code})\n")
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, str(script), cwd=tmp_path)
    assert out.returncode == code
    (run,) = _runs(db, tmp_path)
    assert run["exit_code"] == code
    assert run["status"] == ("ok" if code == 0 else "failed")


def test_uncaught_exception_prints_the_scripts_traceback_and_exits_1(tmp_path: Path, db: Path) -> None:
    script = _write(
        tmp_path / "boom.py",
        """
        def inner():
            raise ValueError("boom from the script")
        print("before")
        inner()
        """,
    )
    out = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, str(script), cwd=tmp_path)
    direct = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1 == direct.returncode
    assert out.stdout == "before\n"
    # The traceback is the one Python prints: same frames, nothing of tpudiag or runpy.
    ours = out.stderr.split("tpudiag: ")[0]
    assert ours == direct.stderr
    (run,) = _runs(db, tmp_path)
    assert run["status"] == "failed" and run["exit_code"] == 1
    assert any("ValueError: boom from the script" in n for n in run["notes"])


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_process_as_it_ends_python_and_the_run_is_stored_interrupted(
    tmp_path: Path, db: Path, sig: signal.Signals, code: int
) -> None:
    # Python dies of the signal (a KeyboardInterrupt it did not catch: after its exit handlers): its parent sees -2
    # or -15 (a shell 130 or 143). The stored run keeps the shell's figure.
    script = _write(
        tmp_path / "wait.py",
        """
        import atexit, time
        atexit.register(lambda: print("exit handler", flush=True))
        print("ready", flush=True)
        time.sleep(60)
        """,
    )

    def ended(command: list[str]) -> tuple[int, str, str]:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Python leaves SIGINT ignored when it starts with it ignored (a background job of a non-interactive
            # shell: ``bash .ci/run &``), and so would the plain script: the test is about the default disposition.
            preexec_fn=_default_sigint,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=180)
        return proc.returncode, out, err

    code_plain, out_plain, _ = ended([sys.executable, str(script)])
    code_ours, out_ours, err = ended(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), *NO_COLLECTORS, str(script)]
    )
    assert code_plain == -sig
    assert code_ours == code_plain, err
    # (Python runs no exit handler when SIGTERM kills it, and neither does the capture.)
    assert out_ours == out_plain == ("exit handler\n" if sig == signal.SIGINT else "")
    (run,) = _runs(db, tmp_path)
    assert run["status"] == "interrupted" and run["exit_code"] == code


def test_sigterm_ends_the_process_at_once_as_it_ends_python(tmp_path: Path, db: Path) -> None:
    """SIGTERM kills python at once: no thread waited for, no exit handler, the output still in its buffers lost.
    The capture stores the run, then dies the same way (it had waited for the script's non-daemon thread, here
    two minutes, and run its exit handler: a preempted job kept alive past its grace period)."""
    script = _write(
        tmp_path / "threads.py",
        """
        import atexit, sys, threading, time
        atexit.register(lambda: print("exit handler", flush=True))
        threading.Thread(target=time.sleep, args=(120,)).start()  # not a daemon: python's exit would wait for it
        print("buffered, never flushed")
        print("ready", file=sys.stderr, flush=True)
        time.sleep(120)
        """,
    )

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (stdout to a pipe: block-buffered)

    def ended(command: list[str]) -> tuple[int, str, float]:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        assert proc.stderr.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=200)
        return proc.returncode, out, time.monotonic() - t0

    code_plain, out_plain, _ = ended([sys.executable, str(script)])
    command = [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), *NO_COLLECTORS, str(script)]
    code_ours, out_ours, took = ended(command)
    assert code_plain == code_ours == -signal.SIGTERM
    assert out_plain == out_ours == ""
    assert took < 60, took  # the run stored (seconds), not the thread's two minutes waited for
    (run,) = _runs(db, tmp_path)
    assert run["status"] == "interrupted" and run["exit_code"] == 143


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_only_the_script_thread_takes_sigint_and_sigterm(tmp_path: Path, db: Path) -> None:
    """tpudiag's own threads (flusher, profiler, DuckDB, numpy/Arrow workers) block SIGINT and SIGTERM, so the kernel
    hands them to the script's thread: a signal taken by another thread would leave a script that waits in C
    (``time.sleep``) unaware of it."""
    stop = tmp_path / "stop"
    script = _write(
        tmp_path / "wait.py",
        """
        import os, sys, time
        print("ready", flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), "--collect", "trace", str(script), str(stop)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        masks = {}
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):
                fields = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines())
                masks[int(task.name)] = int(fields["SigBlk"], 16)
    finally:
        stop.touch()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    held = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    assert len(masks) > 2  # the profiler's and the flusher's threads at least
    assert masks.pop(proc.pid) & held == 0  # the script's thread takes them
    assert all(mask & held == held for mask in masks.values()), {t: hex(m) for t, m in masks.items()}


def test_sigkill_leaves_a_run_that_is_later_marked_interrupted_with_its_flushed_data(tmp_path: Path, db: Path) -> None:
    """The store survives a SIGKILL; spooled data flushed before the kill is kept."""
    script = _write(
        tmp_path / "train.py",
        """
        import time, torch
        m = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            m(torch.randn(4, 8)).sum().backward()
            opt.step()
            time.sleep(0.2)
        with torch.no_grad():
            m(torch.randn(1, 8))  # the next forward is where the chunk holding the last step is cut
        print("ready", flush=True)
        time.sleep(120)
        """,
    )
    proc = subprocess.Popen(
        # --trace all: the whole-run trace, cut into chunks at optimizer steps, is what is flushed as it goes.  (With
        # the default trace windows the open window is the unflushed tail a kill loses; the pulse is kept.)
        [
            sys.executable,
            "-m",
            "tpudiag",
            "capture",
            "--db",
            str(db),
            "--collect",
            "trace",
            "--trace",
            "all",
            str(script),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TPUDIAG_TRACE_CHUNK_S": "0.1", "TPUDIAG_FLUSH_S": "0.2"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    # The run is registered and its flushed chunks loaded while it runs (a child process loads the spool).
    deadline = time.monotonic() + 60
    while not (db.exists() and _runs(db, tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    (running,) = _runs(db, tmp_path)
    assert running["status"] == "running"
    proc.kill()
    proc.wait(timeout=30)
    (run,) = _runs(db, tmp_path)
    assert run["status"] == "interrupted"
    assert run["id"] == running["id"]
    # Its feeder (left alone, the capture gone) loaded once more and left: no reader asks it for loads.
    feeding = db.with_name(db.stem + ".runs") / ".feeding"
    deadline = time.monotonic() + 60
    while list(feeding.glob(run["id"] + "*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(feeding.glob(run["id"] + "*"))
    report = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["run"]["status"] == "interrupted"
    # The chunks cut at the three optimizer steps were flushed before the kill: their ops and steps are there.
    names = {op["name"] for op in data["slow_ops"]}
    assert {"aten::addmm", "aten::sum"} <= names
    assert data["steps"]["count"] == 3


def test_concurrent_captures_all_land_and_a_reader_works_meanwhile(tmp_path: Path, db: Path) -> None:
    script = _write(
        tmp_path / "job.py",
        """
        import os, sys, time
        print("ready", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:  # runs until the test has looked
            time.sleep(0.05)
        """,
    )
    stop = tmp_path / "stop"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tpudiag",
                "capture",
                "--db",
                str(db),
                "--name",
                f"job{i}",
                *NO_COLLECTORS,
                str(script),
                str(i),
                str(stop),
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TPUDIAG_FLUSH_S": "0.2"},
        )
        for i in range(4)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            assert line == "ready", p.stderr.read() if p.stderr and p.poll() is not None else "no output yet"
        # While all four run, a reader sees them: each capture registers its run at its first flush (every 0.2 s
        # here, TPUDIAG_FLUSH_S), not before its script; four writers queue for the lock, so the reader polls.
        t0 = time.monotonic()
        during: list[dict] = []
        while len(during) < 4 and time.monotonic() - t0 < 30:
            during = _runs(db, tmp_path) if db.exists() else []  # the first registration creates the store
            time.sleep(0.1)
        assert time.monotonic() - t0 < 30
        assert sorted(r["name"] for r in during) == ["job0", "job1", "job2", "job3"]
        assert {r["status"] for r in during} == {"running"}
    finally:
        stop.touch()  # the jobs end once the test has looked (or failed)
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    after = _runs(db, tmp_path)
    assert sorted(r["name"] for r in after) == ["job0", "job1", "job2", "job3"]
    assert {r["status"] for r in after} == {"ok"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["capture", "missing.py"], "can't open file 'missing.py'"),
        (["capture", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["capture", "--collect", "trace,bogus", "s.py"], "unknown collector bogus"),
        (["capture"], "capture needs a script"),
        (["report", "nosuchrun"], "no run 'nosuchrun'"),
        (["capture", "--db", "DIR", "s.py"], "is a directory"),
        (["runs", "--db", "CORRUPT"], "not a tpudiag store"),
        (["report", "--db", "CORRUPT"], "not a tpudiag store"),
        (["runs", "--db", "MISSING"], "no store at"),
    ],
)
def test_bad_input_is_one_clear_line_and_nonzero(tmp_path: Path, db: Path, args: list[str], message: str) -> None:
    _write(tmp_path / "s.py", "print('ran')\n")
    (tmp_path / "DIR").mkdir()
    (tmp_path / "CORRUPT").write_bytes(b"\x00garbage" * 512)
    if args[0] == "report" and "--db" not in args:
        ok = run_tpudiag("capture", "--db", str(db), *NO_COLLECTORS, "s.py", cwd=tmp_path)
        assert ok.returncode == 0
    if "--db" not in args:
        args = [args[0], "--db", str(db), *args[1:]]
    out = run_tpudiag(*args, cwd=tmp_path)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 2 and message in lines[-1], out.stderr
    assert "ran" not in out.stdout  # the script never started
    assert (tmp_path / "CORRUPT").read_bytes() == b"\x00garbage" * 512


def test_tpudiag_db_environment_variable_selects_the_store(tmp_path: Path) -> None:
    _write(tmp_path / "s.py", "pass\n")
    target = tmp_path / "via-env.duckdb"
    out = run_tpudiag("capture", *NO_COLLECTORS, "s.py", cwd=tmp_path, env={"TPUDIAG_DB": str(target)})
    assert out.returncode == 0, out.stderr
    listed = run_tpudiag("runs", "--json", cwd=tmp_path, env={"TPUDIAG_DB": str(target)})  # waits for the store write
    assert listed.returncode == 0, listed.stderr
    assert [r["name"] for r in json.loads(listed.stdout)] == ["s"]
    assert target.exists() and not (tmp_path / "tpudiag.duckdb").exists()


def test_a_capture_in_this_process_gives_back_its_sigterm_handling(tmp_path: Path, db: Path) -> None:
    """The capture ignores a SIGTERM that comes after the script until the run is stored; a process that goes on
    after an in-process capture (the Python API, a test run) got SIGTERM back ignored for good, and every child it
    started later ignored it too (a SIGTERM test after an in-process capture saw its script run to the end)."""
    from tpudiag.capture_options import CaptureOptions
    from tpudiag.runner import Target
    from tpudiag.script_capture import capture_script

    script = _write(tmp_path / "s.py", "print('done')\n")
    before = signal.getsignal(signal.SIGTERM)
    result = capture_script(Target("script", str(script), ()), CaptureOptions(db=db, collect=[]))
    assert result.exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is before
