"""The uploader: a process of its own beside the job, copying a node's final files to the bucket.

``python -m tpudiag.remote.uploader RUN_DIR`` reads ``RUN_DIR/upload/config.json`` and then waits for events in
``RUN_DIR/upload/events/``: ``*.files.json`` (a finished set of files, e.g. one trace window; an empty list means
"look for new shards") and ``end.json`` (the node's outcome).  Between events it looks for new shards every
``TPUDIAG_UPLOAD_S`` seconds.  Each batch uploads the new objects, then writes one new ``manifest-<seq>.json``
naming them; ``end`` uploads everything left and writes ``complete.json`` last.  A reader trusts only objects named
in a manifest, so an upload cut short is never read.

A failed upload is retried with exponential backoff (0.5 s doubling to 30 s) until ``TPUDIAG_UPLOAD_GIVE_UP_S``
(default 900 s) after the end; what is left then is listed in ``upload/pending.json`` (``tpudiag runs`` shows it,
``tpudiag upload RUN`` retries).  If the launcher dies without an ``end`` event (the node was killed), the
uploader sends what is final and stops without a completion marker: readers then see a crashed node.
The training process never waits for any of this.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from tpudiag.atomic_file import atomic_file
from tpudiag.processes import pid_alive
from tpudiag.remote import layout, plan
from tpudiag.remote.location import Remote, parse, redact

T = TypeVar("T")


@dataclass
class UploadConfig:
    url: str
    run_id: str  # the job's run id in the bucket (the same on every node)
    node: str
    host: str
    launcher_pid: int

    def save(self, run_dir: Path) -> None:
        with atomic_file(folder(run_dir) / "config.json", "w") as fh:
            json.dump(asdict(self), fh)

    @classmethod
    def load(cls, run_dir: Path) -> UploadConfig:
        data = json.loads((folder(run_dir) / "config.json").read_text())
        return cls(**{k: data[k] for k in ("url", "run_id", "node", "host", "launcher_pid")})


def folder(run_dir: Path) -> Path:
    return run_dir / "upload"


class GiveUp(Exception):
    pass


class Vanished(Exception):
    """A local file removed between listing and upload (never retried)."""


class Uploader:
    def __init__(self, run_dir: Path, config: UploadConfig, give_up_s: float | None = None) -> None:
        self.run_dir, self.config = run_dir, config
        self.remote: Remote = parse(config.url)
        self.give_up_s = give_up_s if give_up_s is not None else float(os.environ.get("TPUDIAG_UPLOAD_GIVE_UP_S", 900))
        self.deadline: float | None = None  # set at the end: retries stop there
        self._fs: Any = None
        self.state_path = folder(run_dir) / "uploaded.jsonl"
        self.uploaded: dict[str, str] = {}  # object path -> local path
        if self.state_path.is_file():
            for line in self.state_path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    row = json.loads(line)
                    self.uploaded[row["object"]] = row["local"]
        self.seq = len(list(folder(run_dir).glob("manifest-*.sent")))

    # -- logging -------------------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        with contextlib.suppress(OSError), open(folder(self.run_dir) / "uploader.log", "a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {redact(text)}\n")

    # -- the bucket ----------------------------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = self.remote.filesystem()
        return self._fs

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = 0.5
        while True:
            try:
                return fn()
            except Vanished:
                raise
            except Exception as err:  # any client error: the bucket may be back later
                self.log(f"{what}: {type(err).__name__}: {err}")
                self._fs = None  # a fresh client (and connection pool) for the next try
                if self.deadline is None and self._job_over():
                    self.deadline = time.time() + self.give_up_s  # the job is over: retries are bounded now
                if self.deadline is not None and time.time() + delay > self.deadline:
                    raise GiveUp(what) from None
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _job_over(self) -> bool:
        return (folder(self.run_dir) / "events" / "end.json").is_file() or not pid_alive(self.config.launcher_pid)

    def _put_bytes(self, parts: tuple[str, ...], data: bytes) -> None:
        path = self.remote.path(*parts)
        self.retry(f"write {'/'.join(parts)}", lambda: self.fs.pipe_file(path, data))

    def _put_file(self, item: plan.Item) -> None:
        path = self.remote.path(*item.object)

        def put() -> None:
            try:
                self.fs.put_file(str(item.local), path)
            except FileNotFoundError:
                if item.local.is_file():  # the bucket said "not found" (a missing bucket): worth a retry
                    raise
                raise Vanished(str(item.local)) from None  # a transient local file, gone meanwhile: skip it

        self.retry(f"upload {'/'.join(item.object)}", put)

    # -- batches -------------------------------------------------------------------------------------------------
    def pending(self, items: Iterable[plan.Item]) -> list[plan.Item]:
        out, seen = [], set(self.uploaded)
        for item in items:
            key = "/".join(item.object)
            if key not in seen:
                seen.add(key)
                out.append(item)
        return out

    def send(self, items: list[plan.Item]) -> int:
        """Upload ``items``, then one manifest naming them; the number sent.  Raises GiveUp past the deadline."""
        done: list[dict[str, Any]] = []
        try:
            for item in items:
                if not item.local.is_file():
                    continue
                size = item.local.stat().st_size
                try:
                    self._put_file(item)
                except Vanished:
                    continue
                done.append({"object": "/".join(item.object), "size": size})
                with open(self.state_path, "a", encoding="utf-8") as fh:  # local bookkeeping: appends are fine here
                    fh.write(json.dumps({"object": done[-1]["object"], "local": str(item.local)}) + "\n")
                self.uploaded[done[-1]["object"]] = str(item.local)
        finally:
            if done:
                self._manifest(done)
        return len(done)

    def _manifest(self, objects: list[dict[str, Any]]) -> None:
        self.seq += 1
        body = {
            "run_id": self.config.run_id,
            "node": self.config.node,
            "host": self.config.host,
            "seq": self.seq,
            "written_at": time.time(),
            "objects": objects,
        }
        self._put_bytes(layout.manifest_object(self.config.run_id, self.config.node, self.seq), _json(body))
        (folder(self.run_dir) / f"manifest-{self.seq:06d}.sent").touch()

    def shards(self) -> list[plan.Item]:
        return self.pending(plan.shard_items(self.run_dir, self.config.run_id, self.config.node))

    def everything(self) -> list[plan.Item]:
        return self.pending(
            [
                *plan.shard_items(self.run_dir, self.config.run_id, self.config.node),
                *plan.raw_items(self.run_dir, self.config.run_id, self.config.node),
            ]
        )

    def finish(self, outcome: dict[str, Any] | None) -> bool:
        """Upload everything left; with an outcome, write the completion marker.  True when nothing is left."""
        self.deadline = time.time() + self.give_up_s
        items = self.everything()
        try:
            self.send(items)
            if outcome is not None:
                body = {
                    "run_id": self.config.run_id,
                    "node": self.config.node,
                    "host": self.config.host,
                    "manifests": self.seq,
                    "objects": len(self.uploaded),
                    "written_at": time.time(),
                    **outcome,
                }
                self._put_bytes(layout.complete_object(self.config.run_id, self.config.node), _json(body))
        except GiveUp as err:
            left = [str(i.local) for i in self.pending(items)]
            self._status("pending", left, f"gave up on {err} after {self.give_up_s:.0f} s")
            return False
        self._status("done" if outcome is not None else "crashed", [], None)
        return True

    def _status(self, state: str, left: list[str], why: str | None) -> None:
        body = {"state": state, "url": self.config.url, "run_id": self.config.run_id, "files": left, "why": why}
        with atomic_file(folder(self.run_dir) / "status.json", "w") as fh:
            json.dump(body, fh)
        pending = folder(self.run_dir) / "pending.json"
        if left:
            with atomic_file(pending, "w") as fh:
                json.dump(body, fh)
        else:
            pending.unlink(missing_ok=True)


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True).encode()


def run(run_dir: Path, poll_s: float = 0.25) -> int:
    """The uploader's loop (the process's main)."""
    config = UploadConfig.load(run_dir)
    up = Uploader(run_dir, config)
    events = folder(run_dir) / "events"
    interval = float(os.environ.get("TPUDIAG_UPLOAD_S", "30"))
    last_scan = 0.0
    up.log(f"uploading {config.node} of run {config.run_id} to {config.url}")
    while True:
        end = events / "end.json"
        if end.is_file():
            outcome = json.loads(end.read_text())
            ok = up.finish(outcome)
            up.log("done" if ok else "some files were not uploaded (tpudiag upload retries them)")
            return 0 if ok else 1
        batch = sorted(events.glob("*.files.json")) if events.is_dir() else []
        if batch or time.monotonic() - last_scan > interval:
            last_scan = time.monotonic()
            named: list[Path] = []
            for event in batch:
                with contextlib.suppress(ValueError, OSError):
                    named += [Path(p) for p in json.loads(event.read_text()).get("files", [])]
                event.unlink(missing_ok=True)
            items = up.shards() + up.pending(plan.raw_items(run_dir, config.run_id, config.node, named))
            with contextlib.suppress(GiveUp):  # no deadline while the job runs: send only gives up at the end
                up.send(items)
        if not pid_alive(config.launcher_pid) and not end.is_file():
            up.log("the launcher is gone without an end: uploading what is final, no completion marker")
            up.finish(None)
            return 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m tpudiag.remote.uploader RUN_DIR\n")
        return 2
    try:
        return run(Path(args[0]))
    except Exception as err:  # the uploader's own failure: logged (redacted), the job is not affected
        with contextlib.suppress(OSError), open(folder(Path(args[0])) / "uploader.log", "a", encoding="utf-8") as fh:
            fh.write(f"uploader failed: {redact(f'{type(err).__name__}: {err}')}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
