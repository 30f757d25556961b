"""Per-rail cost samples: what each rail's shares of an operation took to arrive.

The balancer must charge a rail what its shares cost to *finish*, because a message is done
when its last rail is. The receiver sees that directly: for every message it knows, per
rail, when the share's first header came in, when its last byte did, and when the rail's
previous share from the same peer ended. A share could start no earlier than the message's
first header on any rail (all shares of a message are queued at once) and no earlier than
the end of the rail's previous share (a rail sends in order), so its cost is

    last byte - max(first header of the message on any rail, end of the rail's previous share)

This charges what delays a share's finish: start-up, a lost first packet, retransmission
stalls, a token bucket that ran dry, a slow hop; and it does not charge a rail for idling
between pipeline blocks, so an under-used fast rail is not mistaken for a slow one. When a
late share was completed by hedge copies on other rails (engine/hedge.py), the late rail is
charged with what it delivered itself (its frames of the share, and its own repeats of the
rescued bytes that arrive while the operation lasts) over the time to its last such frame:
the bytes a rescue carried must not make an overloaded rail look fine, and chunks it never
got to send (the copy won) are not its cost either. Samples are summed per operation (one per
rail, however small the shares: with 8 or 16 rails or many hosts a share is a few dozen KiB)
and windowed by the balancer (balance.RailEstimator), each with its *tail*: the cost of the
rail's last messages carrying TAIL_SHARE of its bytes, what a rail that changed during the
operation costs at its end.
Each rank measures the hop into it, so the agreement can take the slowest hop of the ring.
Each rail's *slack* is measured with it: how long before the message's last rail it was done,
over the message's span. It tells the rail that set the pace (0) from one that could have
carried more, which a token bucket's burst can make look far cheaper than it is
(balance.RailState._within_slack).
"""
from __future__ import annotations

import math
from typing import Callable

SAMPLE_MIN_OP = 128 << 10     # operations smaller than this give no sample
TAIL_SHARE = 0.25             # the tail: the last messages carrying this much of a rail's op


def gives_samples(op_bytes: int) -> bool:
    """Is an operation of ``op_bytes`` measured? The one rule for the Context (which ops it
    records) and the balancer (which small messages it still splits in COLD, for samples)."""
    return op_bytes >= SAMPLE_MIN_OP


class ShareCosts:
    """Accumulates the current operation's per-rail (bytes, seconds); ``take`` empties it.
    Called with the engine's lock held."""

    def __init__(self, nrails: int):
        self.nrails = nrails
        self._msgs: dict[int, list] = {}     # per rail: (bytes, seconds) per message, in order
        # per rail: [seconds it was done before its messages' last rail, their spans]
        self._slack: dict[int, list] = {}

    def add_message(self, slot) -> None:
        """A complete receive (engine.messages.RecvSlot with its per-rail times)."""
        if not slot.rbytes:
            return
        t0 = min(slot.t_first.values())
        self._add_slack(slot, t0)
        for r, nb in slot.rbytes.items():
            if r in slot.copied:      # [own bytes, last own byte]; its start: op_ended
                slot.pending[r] = [nb, slot.t_last.get(r, -math.inf)]
            else:
                self._add(r, nb, slot.t_last[r] - max(t0, slot.t_prev[r]))

    def late_frame(self, slot, rail: int, nbytes: int, t_end: float) -> None:
        """The late rail's own copy of a frame that hedge copies already delivered."""
        p = slot.pending.get(rail)
        if p is not None:
            p[0] += nbytes
            p[1] = max(p[1], t_end)

    def op_ended(self, slots, delivered: Callable[[int, int], int | None] | None = None,
                 seconds: float = 0.0) -> None:
        """The operation is over: every hedged rail's own deliveries become its sample, from
        where its own frames of the message could start, as for a rail that was not hedged:
        max(the message's first header, the end of the rail's previous frame, which its first
        own frame of the message set, before or after the copies completed it: engine
        ``_mark``). Not from the first header alone: an over-loaded rail is still sending
        earlier messages' shares, and charging it that backlog made a 304 Mbit/s rail
        over-loaded by a third look like 92-131 Mbit/s, which swung its share between 0.11
        and 0.37.

        A rail none of whose own frames came in before the end, its shares all carried by
        copies, is charged what reached us on it from those peers while the operation lasted
        (``delivered(peer, rail)`` bytes over ``seconds``): it was busy all along, since its
        first share was queued at the start and never finished. Without that sample it gave
        no news at all, and its old cost stayed in use: 4 hosts x 4 rails of 100 Mbit/s, one
        down to 2 Mbit/s for 3 s, were 2.3-2.9x slower for all of those 3 s, its shares
        rescued by hedge copies every operation."""
        silent: dict[int, set] = {}      # rail -> peers whose shares on it no own frame ended
        for slot in slots:
            if not slot.pending:
                continue
            t0 = min(slot.t_first.values())
            for rail, (nb, last) in slot.pending.items():
                if nb > 0:           # some own frame came in, so its start is known
                    self._add(rail, nb, last - max(t0, slot.t_prev[rail]))
                else:
                    silent.setdefault(rail, set()).add(slot.key[2])
            slot.pending.clear()
        if delivered is None or seconds <= 0:
            return
        for rail, peers in sorted(silent.items()):
            if rail in self._msgs:       # its own frames of other messages tell its cost
                continue
            got = [delivered(p, rail) for p in sorted(peers)]
            if None not in got:
                self._add(rail, max(1, sum(got)), seconds)

    def _add_slack(self, slot, t0: float) -> None:
        """How long before the message's last rail each rail was done (its *slack*), and the
        message's span from its first header to its last byte. A message that hedge copies
        completed tells nothing of it (its rails' ends are the copies')."""
        if slot.copied or len(slot.rbytes) < 2:
            return
        end = max(slot.t_last[r] for r in slot.rbytes)
        span = end - t0
        if span <= 0:
            return
        for r in slot.rbytes:
            acc = self._slack.setdefault(r, [0.0, 0.0])
            acc[0] += end - slot.t_last[r]
            acc[1] += span

    def _add(self, rail: int, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self._msgs.setdefault(rail, []).append((nbytes, seconds))

    def take(self) -> list[tuple[int, int, float, float, tuple]]:
        """[(rail, bytes, seconds, tail, slack)] since the last call. ``tail`` is the seconds
        per byte of the rail's last messages that carry TAIL_SHARE of its bytes (nan with
        fewer than two messages): what the rail costs at the end of the operation, when it
        changed during it. ``slack`` is (seconds the rail was done before its messages' last
        rail, the messages' spans), summed over the messages it shared with another rail
        ((0, 0): none)."""
        out = []
        for r, msgs in sorted(self._msgs.items()):
            nb = sum(n for n, _ in msgs)
            slack = tuple(self._slack.get(r, (0.0, 0.0)))
            out.append((r, nb, sum(s for _, s in msgs), self._tail(msgs, nb), slack))
        self._msgs.clear()
        self._slack.clear()
        return out

    @staticmethod
    def _tail(msgs: list, total: int) -> float:
        if len(msgs) < 2:
            return float("nan")
        nb = sec = 0.0
        for n, s in reversed(msgs[1:]):      # never the whole operation
            nb, sec = nb + n, sec + s
            if nb >= TAIL_SHARE * total:
                break
        return sec / nb if nb > 0 else float("nan")
