"""Prompts read between the engine thread's decode steps, a chunk's worth of tokens per turn of its loop."""

from __future__ import annotations

from collections.abc import Callable

from h2o_chat.app.serve.api import ApiError
from h2o_chat.app.serve.jobs import SHUTTING_DOWN, Job, Outbox
from h2o_chat.app.serve.replies import Replies
from h2o_chat.app.serve.rows import Lane, ReadingStopped, read_together
from h2o_chat.errors import H2OChatError, out_of_memory


class Reader:
    """The prompts being read (`rows.Reading`), in turn: a job's reading `begin`s in the row placed for it,
    `read_some` reads a chunk's worth of tokens each turn, a chunk of one prompt after another, and a prompt read
    moves into its row, where `replies` takes its first token. So a short prompt waits for one chunk of each
    prompt ahead of it, not for a long one's whole. New conversations' short prompts arriving together are read
    in one batch (`read_together`), within the same chunk's worth of tokens. A prompt not read to its end
    (`unread`) frees its row and gives its conversation back as it was (`release`); `draining` stops every
    reading at its next chunk."""

    def __init__(
        self,
        chunk_size: int,
        outbox: Outbox,
        replies: Replies,
        release: Callable[[Job], None],
        draining: Callable[[], bool],
    ):
        self.chunk_size, self.outbox, self.replies = chunk_size, outbox, replies
        self.release, self.draining = release, draining
        # prompts being read, the next to read first (their rows are looked up when used: a resize moves rows)
        self.readings: list[tuple[Job, Lane]] = []
        self.together = 0  # prompts read in a batch with others, so far (/v1/stats)

    def begin(self, job: Job, lane: Lane, r: int) -> None:
        """Row r is the job's; its prompt's reading begins (`read_some` reads it). When it cannot, the job's
        conversation goes back (`release`) and the error that says why is raised."""
        turn = job.turn
        try:
            # asked after each chunk: a drain stops the reading at once, not at the prompt's end
            job.reading = lane.read(turn.session.state, turn.ids, self.draining, turn.session.tail)
        except Exception as e:
            self.release(job)
            raise self._error(e) from None
        lane.jobs[r] = job
        self.readings.append((job, lane))

    def read_some(self) -> None:
        """Read prompts a chunk at a time, each in turn (round robin), until a chunk's worth of tokens
        (`--chunk-size`) is read this turn or none is left; each prompt read moves into its row and its first
        token goes out at once."""
        quantum = self.chunk_size - self._read_together()
        while self.readings and quantum > 0:
            job, lane = self.readings[0]
            reading = job.reading
            before = reading.read
            try:
                done = reading.advance()
            except Exception as e:
                self.unread(job, lane, reading.abandon)
                error = self._error(e)
                if not isinstance(error, ApiError):
                    raise error from e
                self.outbox.send(job, ("error", error))
                continue
            quantum -= max(1, reading.read - before)
            self.readings.pop(0)
            if done:
                self._enter(job, lane)
                self.outbox.flush()  # its first token, before the next prompt is read
            else:
                self.readings.append((job, lane))  # its next chunk after one of each other prompt

    def _read_together(self) -> int:
        """The unread prompts of new conversations of the first such prompt's lane, each within one chunk, read in
        one batch while their padded batch stays within a chunk's worth of tokens; each moves into its row and its
        first token goes out. Returns the tokens read (0: fewer than two such prompts). Prompts that cannot be
        read so (no memory for their batch) are read one by one as before."""
        if self.draining():
            return 0
        group: list[tuple[Job, Lane]] = []
        for job, lane in self.readings:
            if not (job.reading.together and job.reading.untouched) or (group and lane is not group[0][1]):
                continue
            longest = max([job.reading.total, *(j.reading.total for j, _ in group)])
            if group and (len(group) + 1) * longest > self.chunk_size:
                break
            group.append((job, lane))
        if len(group) < 2:
            return 0
        readings = [job.reading for job, _ in group]
        try:
            read = read_together(group[0][1], readings)
        except Exception as e:
            if not (isinstance(e, H2OChatError) or out_of_memory(e)):
                raise
            read = False
        if not read:
            for reading in readings:
                reading.together = False
            return 0
        self.together += len(group)
        for job, lane in group:
            self.readings.remove((job, lane))
            self._enter(job, lane)
        self.outbox.flush()
        return sum(r.total for r in readings)

    def unread(self, job: Job, lane: Lane, end: Callable[[], None]) -> None:
        """A prompt that will not be read to its end: its reading ends (`end`), its row is free, and the
        conversation it continues stays as it was."""
        end()
        self.readings = [x for x in self.readings if x[0] is not job]
        lane.jobs[lane.row_of(job)], job.reading = None, None
        self.release(job)

    def drop_lane(self, lane: Lane | None = None) -> None:
        """The readings of a lane that failed stop (their jobs are told by the caller); None: every lane's, when
        the engine thread ends."""
        for job, la in self.readings:
            if lane is None or la is lane:
                job.reading.cancel()
        self.readings = [x for x in self.readings if lane is not None and x[1] is not lane]

    def _enter(self, job: Job, lane: Lane) -> None:
        reading, turn, r = job.reading, job.turn, lane.row_of(job)
        first = lane.enter(r, reading, job.req)
        job.reading, job.read_seconds = None, reading.seconds
        turn.session.state, turn.session.nbytes = None, 0  # the conversation is in the row now
        self.outbox.send(job, ("started", None))
        self.replies.consume(lane, r, first)

    @staticmethod
    def _error(e: Exception) -> Exception:
        """What a job whose prompt could not be read is told (the conversation it continues stays as it was)."""
        if isinstance(e, ReadingStopped):
            return ApiError(503, SHUTTING_DOWN)
        if isinstance(e, H2OChatError):
            return ApiError(503, f"this prompt cannot be read here: {e}")
        if out_of_memory(e):
            return ApiError(503, f"out of memory while reading this prompt ({str(e).splitlines()[0]})")
        return e
