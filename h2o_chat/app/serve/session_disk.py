"""The server's idle conversations on disk (serve --session-dir DIR), for the server's life.

An idle conversation that the memory limit (or --max-sessions) would drop is written as a state file
(`app/statefile.py`, kind "session": the row's snapshot, `engine/storage/persist.py`, and the session's own bookkeeping,
`CARRIED`) and stays in the idle store without its snapshot; its next turn reads the file back (in the planning
thread, before the request reaches the engine) and continues as if it had never left memory. The reply says so
(`h2o.restored_from_disk`). A file is removed once it is read back, and the server removes what it wrote when it
stops: the files are the server's memory, not an archive. Never written: the scope (an API key among it), kept in
memory only, so a file alone continues nothing.

The disk is bounded too (`max_files`, least recently used first out); a file that cannot be written or read back
(a full disk, a damaged file) drops that conversation, as the memory limit would have, and its next request reads
it again from the start.
"""

from __future__ import annotations

from pathlib import Path

from h2o_chat.app import statefile
from h2o_chat.engine.cache import H2OCache
from h2o_chat.engine.storage import persist
from h2o_chat.errors import InputError

# A Session's fields a file carries (`sessions.Session`; its scope, state, path and sizes stay in memory)
CARRIED = ("kind", "cache_key", "id", "messages", "ids", "text", "fed", "unfed", "fed_stop", "seam", "tail", "turns")


def session_folder(path) -> Path:
    """--session-dir checked (a folder, made if missing, writable): one line when it cannot be used."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".h2o-chat-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise InputError(f"--session-dir {path} cannot be used: {e.strerror or e}") from None
    return folder


class SessionDisk:
    """Writes idle sessions' snapshots to `folder` and reads them back, checked against this server's model and
    cache settings (`settings`: the lanes' `EngineSettings`)."""

    def __init__(self, folder: Path, loaded, settings, max_files: int = 1024):
        self.folder, self.loaded, self.settings, self.max_files = folder, loaded, settings, max_files
        self.written = self.restored = 0
        self._caches: dict = {}  # policy -> an empty cache of it: what a state is checked and unpacked against

    def _cache(self, policy) -> H2OCache:
        if policy not in self._caches:
            s, loaded = self.settings, self.loaded
            self._caches[policy] = H2OCache.for_model(
                loaded.model, policy, s.positions, loaded.context, kv_quant=s.kv_quant
            )
        return self._caches[policy]

    def write(self, session) -> None:
        """`session`'s snapshot to its file; the session keeps its policy and path and lets its snapshot go.
        StateError when it cannot be written (nothing is left under its name)."""
        state = session.state
        cache = self._cache(state["rows"][0].group.policy)
        values, tensors = persist.pack(state)
        path = self.folder / f"{session.id}.h2o"
        carried = {name: getattr(session, name) for name in CARRIED}
        statefile.write(path, "session", statefile.identity(self.loaded, cache), values, tensors, session=carried)
        session.policy, session.path = cache.policy, path
        session.state, session.nbytes = None, 0
        self.written += 1

    def read(self, session) -> None:
        """`session`'s snapshot back from its file (on the host, as one kept in memory is), checked whole; the
        file is removed. StateError (the file is removed too) when it cannot be."""
        try:
            file = statefile.read(session.path, kind="session")
            cache = self._cache(session.policy)
            file.check(statefile.identity(self.loaded, cache), "this server")
            saved = file.header.get("session") or {}
            if saved.get("id") != session.id or saved.get("fed") != session.fed:
                raise persist.StateError(f"{session.path} holds another conversation")
            dtype = self.loaded.model.dtype
            session.state = persist.unpack(file.state, file.tensors, cache, dtype, "cpu")
        finally:
            self.remove(session)
        self.restored += 1

    def remove(self, session) -> None:
        if session.path is not None:
            session.path.unlink(missing_ok=True)
            session.path = None
