"""The run directory and everything in it: its layout and control requests (:mod:`.layout`), crash-safe writes
(:mod:`.files`), the event protocol and its byte-level reading and rotation (:mod:`.events`, :mod:`.event_lines`,
:mod:`.event_carry`, :mod:`.growth`), the typed events and their one decoder (:mod:`.protocol`), the one reducer
from a stage's events to its facts (:mod:`.stage_reducer`), a stage's status row (:mod:`.stage_row`, :mod:`.stage_status`), state.json for
front ends (:mod:`.state_file`), the audit log and log scanning. Above the plan only; front ends read a run through it."""
