"""The timeline's settings, declared into the one table of rdmamw/config.py when
rdmamw.trace is imported; ``rdmamw info --config`` lists them under [trace]."""

from __future__ import annotations

from rdmamw.config import declare

declare("trace", "RDMAMW_TRACE", "str", None,
        "record a timeline of the collectives, parameter-server rounds and the "
        "channels' batches, waits and rendezvous phases into this file (Chrome "
        "trace-event JSON, for Perfetto), written at exit; %r: the rank, %p: the pid "
        "(default: off)")
declare("trace", "RDMAMW_TRACE_MAX_EVENTS", "int", 1_000_000,
        "spans kept per process; later ones are counted as dropped (about 200 B each)",
        minimum=1, maximum=1 << 30)
declare("trace", "RDMAMW_TRACE_MAX_RECORDS", "int", 1 << 20,
        "records of the channels' batches, doorbells, completions, waits and rendezvous "
        "phases kept per process: the latest, in a ring (64 B each, allocated when "
        "recording starts); older ones are counted as dropped", minimum=1, maximum=1 << 26)
