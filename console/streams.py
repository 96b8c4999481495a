"""Read positions in the run files the console follows through the transport, one per file.

:class:`Stream` is where the console is in one growing file (a stage's ``events.jsonl`` or ``stage.log``),
:func:`consume` advances it over what a read returned: only whole lines, starting near the end of a
long file on attach (so attaching to a week-long run costs what an hour-long one does), from the start
again when the file was cut or replaced. :func:`follow_rotation` is the events file's rotation
(:mod:`pipeline.run.rundir.growth`): it finishes the old generation, found by its inode among
``events.N.jsonl``, before the new file, whose carried head it skips (:func:`drop_carried`), so no
event is lost or applied twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.run.rundir import growth
from pipeline.run.rundir.event_lines import LineSkipper
from pipeline.run.rundir.events import Event, drop_carried_head


@dataclass
class Stream:
    """Read position in one growing file."""

    offset: int = 0
    ino: int = 0
    primed: bool = False  # False until the first read decided where to start
    skip: LineSkipper = field(default_factory=LineSkipper)  # a fragment to drop, an over-long line to skip
    skipped: int = 0  # bytes of the file's head jumped over on attach (the curves read them back later)
    gen: int = 0  # >0: finishing rotated generation N (``events.N.jsonl``) before the current file
    gen_ino: int = 0  # the inode of the generation being finished (0: take the one found)
    skip_carried: bool = False  # the head of this generation repeats what was read: skip carried lines
    next_skip: bool = False  # skip_carried for the generation after the one just finished

    def rel(self, name: str) -> str:
        """The run-relative file to read next: ``name`` or one of its rotated generations."""
        return growth.generation_name(name, self.gen)


def consume(
    stream: Stream, data: bytes, size: int, ino: int, tail_bytes: int, window: int
) -> tuple[list[bytes], list[str]]:
    """Advance ``stream`` over ``data`` (read at ``stream.offset``); return the complete new lines, and a
    note for each line longer than ``window`` that was skipped (so it never stalls the stream).

    A file that shrank or was replaced starts over. On the first read of a file longer than
    ``tail_bytes`` the stream jumps to its last ``tail_bytes`` (read on the next poll) and drops
    the first, partial line there, so attaching to a week-long run costs what an hour-long one does.
    """
    if size < 0:
        return [], []
    if (stream.ino and ino and ino != stream.ino) or size < stream.offset:
        stream.offset, stream.primed, stream.skip = 0, False, LineSkipper()
        stream.ino = ino
        return [], []
    stream.ino = ino
    if not stream.primed:
        stream.primed = True
        if size - stream.offset > tail_bytes:
            stream.offset = size - tail_bytes
            stream.skip.start_mid_line()
            stream.skipped = stream.offset
            return [], []
    lines, used, notes = stream.skip.take(data, window)
    stream.offset += used
    return lines, notes


def follow_rotation(
    stream: Stream, data: bytes, size: int, ino: int, window: int
) -> tuple[list[bytes], list[str]] | None:
    """Rotation of an events file: the lines to apply from this answer (and notes of over-long lines
    skipped), or None when it is an ordinary read of the current file (for :func:`consume`).

    The current file with a new inode starts the finishing of the old generation (next poll reads
    ``events.1.jsonl`` at the old offset). A generation whose inode is not the one we were reading sends
    the next poll one generation further; none left: the current file from its start, carried lines and
    all (so the state is whole again). At a generation's end the next newer one follows, from its start,
    skipping its carried head."""
    if stream.gen == 0:
        if stream.ino and ino and size >= 0 and ino != stream.ino and stream.primed:
            stream.gen, stream.gen_ino, stream.ino = 1, stream.ino, 0
            return [], []
        if stream.ino == 0 and stream.primed and size >= 0:
            stream.ino = ino  # arrived in the current file from a rotated generation
        return None
    if size < 0 or (stream.gen_ino and ino != stream.gen_ino):
        if size >= 0 and stream.gen_ino and stream.gen < growth.keep("events"):
            stream.gen += 1  # rotated again meanwhile: it is one generation further
            return [], []
        # gone: the current file from its start
        stream.gen, stream.gen_ino, stream.offset, stream.ino, stream.skip_carried = 0, 0, 0, 0, False
        return [], []
    stream.gen_ino = ino
    start = stream.offset
    lines, used, notes = stream.skip.take(data, window)  # a fragment (attached mid-file), an over-long line
    stream.offset += used
    if start + len(data) >= size:  # read to its end: nothing is appended to a rotated generation
        stream.gen, stream.gen_ino, stream.offset = stream.gen - 1, 0, 0
        stream.next_skip = True
    return lines, notes


def drop_carried(stream: Stream, events: list[Event]) -> list[Event]:
    """:func:`pipeline.run.rundir.events.drop_carried_head` for a stream that is skipping a generation's head."""
    kept, stream.skip_carried = drop_carried_head(events)
    return kept
