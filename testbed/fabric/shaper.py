"""Shaping of ONE direction of a link: packets leaving end A (``egress_ns``/``egress_if``) toward
end B, its veth peer (``ingress_ns``/``ingress_if``).

Tree on the egress interface (everything through pyroute2 netlink)::

    rate set:        htb 1: (default 1:10) -> class 1:10 rate=ceil=RATE -> leaf 10:
                     leaf 10: = netem (delay/jitter/loss, if the kernel has netem) or pfifo
    rate None:       netem 10: as root if delay/jitter/loss needs netem, else no qdisc at all

Loss without netem: an nftables table ``nezha_testbed`` (family netdev) in the INGRESS namespace,
one chain per device (``loss_<ifB>``, hook ingress on ifB, priority -500) whose head is
``numgen random mod 1000000 < N counter drop`` followed by ``accept`` (100 %: ``counter drop``;
0 %: no rule). Dropping at the peer's ingress is losing on this direction's wire (the rules and
how nft is run: testbed.kernel.nftables). A runtime loss change inserts the new head rules
(encoded by testbed.kernel.nfnl, acked in tens of microseconds) and deletes the dead ones
afterwards in the background: nftables acknowledges any deletion - a ``replace`` too - only
after an RCU grace period, 8-40 ms on this machine.

While loss > 0, TSO/GSO are turned off on the egress interface (testbed.kernel.ethtool) so each
MTU packet is lost independently; otherwise TCP's 64 KiB GSO skbs are dropped whole (1 % loss at
200 Mbit/s: 14 drop events in 3 s instead of ~470). They are turned back on when the loss is 0:
with GSO, htb is more accurate and cheaper.

Every apply/change is read back from the kernel and compared with what was asked; a difference
raises ShapingMismatch, so the testbed never claims a shaping the kernel did not apply.

The qdisc parameters (htb burst and quantum, fifo and netem limits) and why: testbed.kernel.tc.
"""
from __future__ import annotations

import json
import re
import time
from typing import Optional

from testbed.errors import CapabilityError, FabricError, ShapingMismatch
from testbed.kernel import ethtool, nfnl, nftables, tc
from testbed.kernel.capabilities import Capabilities
from testbed.kernel.nftables import NFT_TABLE, NftResult
from testbed.kernel.tc import CLASS_HANDLE, HTB_HANDLE, LEAF_HANDLE, TC_H_ROOT
from testbed.model.spec import Shape
from testbed.model.units import format_duration, format_rate, format_size

RATE_TOLERANCE_BPS = 8    # htb stores bytes/s: a rate is kept to the byte
LOSS_TOLERANCE = 1e-6
TIME_TOLERANCE_S = 1e-6


def shapes_match(asked: Shape, got: Shape) -> bool:
    if (asked.rate_bps is None) != (got.rate_bps is None):
        return False
    if asked.rate_bps is not None and abs(asked.rate_bps - got.rate_bps) > RATE_TOLERANCE_BPS:
        return False
    return (abs(asked.loss - got.loss) <= LOSS_TOLERANCE
            and abs(asked.delay_s - got.delay_s) <= TIME_TOLERANCE_S
            and abs(asked.jitter_s - got.jitter_s) <= TIME_TOLERANCE_S)


def _shape_text(s: Shape) -> str:
    return (f"rate={s.rate_bps} loss={s.loss:.9g} delay={s.delay_s * 1e6:.3f}us "
            f"jitter={s.jitter_s * 1e6:.3f}us ({s.describe()})")


# ---------------------------------------------------------------------------------------------
class DirectionShaper:
    """Shapes packets leaving ``egress_if`` (in ``egress_ns``) toward its peer ``ingress_if``."""

    def __init__(self, egress, egress_ns: str, egress_if: str, ingress, ingress_ns: str,
                 ingress_if: str, caps: Capabilities, mtu: int = 1500,
                 name: Optional[str] = None, per_packet_loss: bool = True,
                 gso: int = tc.GSO_MAX_SIZE) -> None:
        self.egress, self.egress_ns, self.egress_if = egress, egress_ns, egress_if
        self.ingress, self.ingress_ns, self.ingress_if = ingress, ingress_ns, ingress_if
        self.caps = caps
        self.mtu = mtu
        self.gso = gso        # the largest skb that reaches this queue (sizes htb's bucket)
        self.name = name or f"{egress_ns}/{egress_if}->{ingress_ns}/{ingress_if}"
        self.chain = "loss_" + re.sub(r"[^A-Za-z0-9_]", "_", ingress_if)
        self.shape: Optional[Shape] = None        # last shape verified in the kernel
        self._nft_handles: Optional[list] = None    # our chain's rule handles (None: no chain)
        self._nft_chain_absent = False               # known: we never made the chain here
        self._nft_stale: list = []                   # dead rules behind the head, to delete
        self._index: Optional[int] = None
        # loss > 0: TSO/GSO off on the egress interface, so the kernel segments before the veth
        # and each MTU packet is lost on its own (else a 64 KiB GSO skb - up to 44 segments -
        # is dropped as one: 14 drop events instead of ~470 for 1 % loss over 3 s at 200 Mbit/s)
        self.per_packet_loss = per_packet_loss
        self._saved_offloads: Optional[dict] = None

    # ---- public API ------------------------------------------------------------------------
    def apply(self, shape: Shape, new_link: bool = False) -> float:
        """First set-up (rebuilds from scratch); verified by read-back. Returns the monotonic
        time at which the kernel acknowledged the last step. ``new_link``: the caller has just
        created the link in a new namespace, so there is no old tree or nft chain to remove
        (skipping those look-ups makes a 32-link fabric build several times faster)."""
        acked = self._apply(shape, new_link)
        self._verify(shape)
        return acked

    def _apply(self, shape: Shape, new_link: bool = False) -> float:
        self._check(shape)
        if new_link:
            self._nft_chain_absent = True
        else:
            self._remove_tree()
        self._build_tree(shape)
        self._set_nft_loss(shape.loss, fresh=True)
        self._set_offloads(shape.loss)
        return time.monotonic()

    def change(self, shape: Shape) -> float:
        """Runtime change in place (``stage``), then read back and verified (``confirm``);
        returns the monotonic time the kernel acked the last step."""
        acked = self.stage(shape)
        self.confirm(shape)
        return acked

    def stage(self, shape: Shape) -> float:
        """The kernel side of a runtime change, not yet read back: htb class 'change', netem
        'change', nft head-rule insert (dead rules deleted in the background); a leaf kind
        switch (pfifo <-> netem) replaces only the leaf; only a root switch (htb <->
        netem-only <-> none) rebuilds the tree. Returns when the kernel acked the last step.
        ``confirm(shape)`` must follow: a fault is applied the moment the kernel has it, and
        its read-back (1-2 ms per direction) comes after, not in between two directions or
        two links of one fault."""
        self._check(shape)
        old = self.shape
        if old is None:        # a handle made for an existing fabric: start from the kernel
            try:
                old = self.read_back()
            except ShapingMismatch:
                return self._apply(shape)
            if self._plan(old) != self._kernel_plan():
                return self._apply(shape)
        old_root, old_leaf = self._plan(old)
        root, leaf = self._plan(shape)
        idx = self._ifindex()
        if (old_root, old_leaf) == (root, leaf):
            if root == "htb":
                if shape.rate_bps != old.rate_bps:
                    self._tc("change-class", "htb", idx, CLASS_HANDLE,
                             **tc.htb_class_kwargs(shape.rate_bps, self.mtu, self.gso))
                if leaf == "netem":
                    self._tc("change", "netem", idx, LEAF_HANDLE, parent=CLASS_HANDLE,
                             **tc.netem_kwargs(shape, self.mtu))
                # the fifo keeps its limit: shrinking it under a standing queue drops every new
                # packet (ACKs included) until the old backlog drains - 100+ ms of silence
                # that looks like a black hole; a rate fault changes the rate, nothing else
            elif root == "netem":
                self._tc("change", "netem", idx, LEAF_HANDLE, parent=TC_H_ROOT,
                         **tc.netem_kwargs(shape, self.mtu))
        elif old_root == root == "htb":      # only the leaf kind changes (pfifo <-> netem)
            if shape.rate_bps != old.rate_bps:
                self._tc("change-class", "htb", idx, CLASS_HANDLE,
                         **tc.htb_class_kwargs(shape.rate_bps, self.mtu, self.gso))
            self._tc("del", old_leaf, idx, LEAF_HANDLE, parent=CLASS_HANDLE)
            self._add_leaf(idx, shape, leaf)
        else:                                # htb <-> netem root <-> nothing: rebuild
            self._remove_tree()
            self._build_tree(shape)
        if shape.loss != old.loss:
            self._set_nft_loss(shape.loss, fresh=False)
        if (shape.loss > 0) != (old.loss > 0) or self.shape is None:
            self._set_offloads(shape.loss)
        return time.monotonic()

    def confirm(self, shape: Shape) -> None:
        """Read back what ``stage(shape)`` set: a difference raises ShapingMismatch."""
        self._verify(shape)
        self._collect_stale_nft()

    def prepare(self, rates: set[int]) -> None:
        """Encode now the htb class requests for ``rates`` (a fault schedule's), so a fault
        does not pay pyroute2's ~1 ms of rate-table encoding at its scheduled time."""
        prepare = getattr(self.egress, "prepare", None)
        if prepare is None:
            return
        idx = self._ifindex()
        for rate in rates:
            prepare("tc", "change-class", "htb", index=idx, handle=CLASS_HANDLE,
                    **tc.htb_class_kwargs(rate, self.mtu, self.gso))

    def read_back(self) -> Shape:
        """What the kernel actually has for this direction, decoded into a Shape."""
        return self._read()[0]

    def describe(self) -> dict:
        shape, info = self._read()
        method = None
        if shape.loss > 0:
            method = "nftables" if info.get("nft_rule") else "netem"
        return {
            "link": self.name,
            "egress": f"{self.egress_ns}/{self.egress_if}",
            "ingress": f"{self.ingress_ns}/{self.ingress_if}",
            "rate": format_rate(shape.rate_bps), "rate_bps": shape.rate_bps,
            "loss": shape.loss, "delay_s": shape.delay_s, "jitter_s": shape.jitter_s,
            "shape": shape.describe(),
            "loss_method": method,
            "qdiscs": info.get("qdiscs", []),
            "nft": info.get("nft_rule"),
            "nft_drops": info.get("nft_drops"),
            "class_stats": info.get("class_stats"),
            "offloads": self.offloads(),
        }

    def clear(self) -> None:
        """Remove our qdiscs (egress) and our nft chain (ingress) for this direction."""
        self._remove_tree()
        if self.caps.nftables:
            nftables.nft_run(self.ingress_ns,
                             ["delete", "chain", "netdev", NFT_TABLE, self.chain])
        self._nft_handles, self._nft_stale = None, []
        self._set_offloads(0.0)
        self.shape = None

    # ---- checks ----------------------------------------------------------------------------
    def _check(self, shape: Shape) -> None:
        if shape.needs_netem and not self.caps.netem:
            what = "delay" if shape.delay_s else "jitter"
            raise CapabilityError(
                what, f"{self.name}: {what} needs the kernel's netem qdisc (sch_netem), which "
                f"this kernel lacks ({self.caps.details.get('netem', 'netem probe failed')})",
                "no delay/jitter on this machine, or a kernel with sch_netem")
        if shape.loss > 0 and self.caps.loss_method is None:
            raise CapabilityError("loss", f"{self.name}: loss needs netem or nftables, and "
                                  "neither works here", "install nftables")
        if not 0.0 <= shape.loss <= 1.0:
            raise CapabilityError("loss", f"{shape.loss!r} is not a fraction", "0..1")
        if shape.rate_bps is not None and shape.rate_bps < 8:
            raise CapabilityError("bandwidth", f"{shape.rate_bps!r} bit/s", "at least 8kbit")

    def _plan(self, shape: Shape) -> tuple[Optional[str], Optional[str]]:
        """(root, leaf) qdisc kinds for a shape on this kernel."""
        netem = self.caps.netem and (shape.needs_netem or shape.loss > 0)
        if shape.rate_bps is not None:
            return "htb", ("netem" if netem else "pfifo")
        return ("netem", None) if netem else (None, None)

    def _set_offloads(self, loss: float) -> None:
        """TSO/GSO off on the egress interface while loss > 0 (per-packet loss), back to what
        they were (on, veth's default, if this handle never saw them) when the loss is gone."""
        if not self.per_packet_loss:
            return
        current = ethtool.offloads_in(self.egress_ns, self.egress_if, self.egress)
        if loss > 0:
            want = {"tso": False, "gso": False}
            if self._saved_offloads is None and current != want:
                self._saved_offloads = current
        else:
            want = self._saved_offloads or {"tso": True, "gso": True}
            self._saved_offloads = None
        if current != want:
            try:
                got = ethtool.set_offloads_in(self.egress_ns, self.egress_if,
                                              want["tso"], want["gso"], self.egress)
            except OSError as e:
                raise FabricError(f"{self.name}: setting TSO/GSO on {self.egress_ns}/"
                                  f"{self.egress_if} failed: {e}") from e
            if got != want:
                raise ShapingMismatch(f"{self.name}: asked offloads {want} on "
                                      f"{self.egress_if}, the kernel has {got}")

    def offloads(self) -> dict:
        return ethtool.offloads_in(self.egress_ns, self.egress_if, self.egress)

    def _kernel_plan(self) -> tuple[Optional[str], Optional[str]]:
        """(root, leaf) kinds of our qdiscs as they are in the kernel now."""
        idx = self._ifindex()
        qdiscs = [q for q in self.egress.get_qdiscs(index=idx) if q["index"] == idx]
        kinds = {q["parent"]: (q.get_attr("TCA_KIND"), q["handle"]) for q in qdiscs}
        root = kinds.get(TC_H_ROOT)
        if root == ("htb", HTB_HANDLE):
            leaf = kinds.get(CLASS_HANDLE)
            return "htb", (leaf[0] if leaf and leaf[1] == LEAF_HANDLE else None)
        if root == ("netem", LEAF_HANDLE):
            return "netem", None
        return None, None

    def _nft_loss(self) -> bool:
        return not self.caps.netem and self.caps.nftables

    # ---- qdisc tree ------------------------------------------------------------------------
    def _ifindex(self) -> int:
        if self._index is None:
            found = self.egress.link_lookup(ifname=self.egress_if)
            if not found:
                raise FabricError(f"{self.name}: no interface {self.egress_if} in "
                                  f"namespace {self.egress_ns}")
            self._index = found[0]
        return self._index

    def _tc(self, command: str, kind: Optional[str], idx: int, handle: int, **kw) -> None:
        try:
            self.egress.tc(command, kind, index=idx, handle=handle, **kw)
        except Exception as e:
            raise FabricError(f"{self.name}: tc {command} {kind} {tc.handle_text(handle)} on "
                              f"{self.egress_ns}/{self.egress_if} failed: {e}") from e

    def _add_leaf(self, idx: int, shape: Shape, leaf: str) -> None:
        if leaf == "netem":
            self._tc("add", "netem", idx, LEAF_HANDLE, parent=CLASS_HANDLE,
                     **tc.netem_kwargs(shape, self.mtu))
        else:
            self._tc("add", "pfifo", idx, LEAF_HANDLE, parent=CLASS_HANDLE,
                     limit=tc.fifo_limit(shape.rate_bps, self.mtu))

    def _build_tree(self, shape: Shape) -> None:
        root, leaf = self._plan(shape)
        if root is None:
            return
        idx = self._ifindex()
        if root == "htb":
            self._tc("add", "htb", idx, HTB_HANDLE, default=CLASS_HANDLE & 0xFFFF)
            self._tc("add-class", "htb", idx, CLASS_HANDLE,
                     **tc.htb_class_kwargs(shape.rate_bps, self.mtu, self.gso))
            self._add_leaf(idx, shape, leaf)
        else:
            self._tc("add", "netem", idx, LEAF_HANDLE, parent=TC_H_ROOT,
                     **tc.netem_kwargs(shape, self.mtu))

    def _remove_tree(self) -> None:
        idx = self._ifindex()
        for q in self.egress.get_qdiscs(index=idx):
            if q["index"] == idx and q["parent"] == TC_H_ROOT and (
                    (q.get_attr("TCA_KIND"), q["handle"]) in
                    (("htb", HTB_HANDLE), ("netem", LEAF_HANDLE))):
                tc.del_root_qdisc(self.egress, idx)

    # ---- nftables loss ---------------------------------------------------------------------
    def _nft(self, args: list[str], stdin: Optional[str] = None) -> NftResult:
        run = nftables.nft_run(self.ingress_ns, args, stdin=stdin)
        if run.returncode != 0:
            raise FabricError(f"{self.name}: nft {' '.join(args)} in {self.ingress_ns} failed: "
                              f"{run.stderr.strip()}")
        return run

    def _set_nft_loss(self, loss: float, fresh: bool) -> None:
        """Fresh: (re)create our chain with the rules for ``loss``. Runtime: insert the new
        rules at the head of the chain (additions only: acked in about a millisecond) - from
        then on every packet gets its verdict there, so the previous rules are dead; they are
        deleted afterwards in the background, because nftables acknowledges any deletion
        (replace included) only after an RCU grace period, measured at 8-40 ms here."""
        if not self._nft_loss():
            return
        base = f"netdev {NFT_TABLE} {self.chain}"
        rules = nftables.nft_generation(loss)
        if fresh or self._nft_handles is None:
            if fresh and not self._nft_chain_absent:   # leftovers of an earlier run: clear them
                nftables.nft_run(self.ingress_ns, ["delete", "chain", *base.split()])
            if loss <= 0:
                return
            self._nft_chain_absent = False
            script = nftables.ingress_chain_script(self.chain, self.ingress_if, rules)
        else:
            sock = self._nft_socket()
            if sock is not None:       # the fast path: encoded here, no libnftables
                try:
                    nfnl.insert_loss_rules(sock, NFT_TABLE, self.chain, loss)
                except OSError as e:
                    raise FabricError(f"{self.name}: inserting the loss rules into {base} in "
                                      f"{self.ingress_ns} failed: {e}") from None
                return
            script = "".join(f"insert rule {base} {r}\n" for r in reversed(rules))
        self._nft(["-f", "-"], stdin=script)

    def _nft_socket(self):
        """The ingress namespace's NETLINK_NETFILTER socket (testbed.kernel.rtnl), or None
        where its handle has none (Mininet's backend) or the kernel refuses one."""
        get = getattr(self.ingress, "nft_socket", None)
        if get is None:
            return None
        try:
            return get()
        except OSError:
            return None

    def _collect_stale_nft(self) -> None:
        if self._nft_stale:
            base = f"netdev {NFT_TABLE} {self.chain}"
            script = "".join(f"delete rule {base} handle {h}\n" for h in self._nft_stale)
            nftables.nft_run_background(self.ingress_ns, ["-f", "-"], stdin=script)
            self._nft_stale = []

    def _read_nft(self) -> tuple[float, Optional[str], Optional[int]]:
        """(loss, rule text, drop counter) from our chain's head rules; loss 0 if absent.
        Also notes the chain's rule handles and which are dead (after the head)."""
        run = nftables.nft_run(self.ingress_ns,
                               ["-j", "list", "chain", "netdev", NFT_TABLE, self.chain])
        if run.returncode != 0:
            self._nft_handles, self._nft_stale = None, []
            return 0.0, None, None
        rules = [o["rule"] for o in json.loads(run.stdout).get("nftables", []) if "rule" in o]
        handles = [r["handle"] for r in rules]
        self._nft_handles = handles
        if not rules:
            self._nft_stale = []
            return 0.0, None, None
        try:
            loss, head = nftables.decode_nft_chain([r.get("expr", []) for r in rules])
        except ValueError as e:
            raise ShapingMismatch(f"{self.name}: nft chain {self.chain} in {self.ingress_ns}: "
                                  f"{e}") from None
        self._nft_stale = handles if loss == 0 else handles[head:]
        if loss == 0:
            return 0.0, None, None
        text = f"{NFT_TABLE} {self.chain} handle {handles[0]}: {nftables.nft_rule(loss)}"
        return loss, text, nftables.rule_packets(rules[0]["expr"])

    # ---- read-back -------------------------------------------------------------------------
    def _read(self) -> tuple[Shape, dict]:
        """The shape the kernel has for this direction (qdiscs on the egress interface, our nft
        chain at the ingress), and what was found, as text, for ``describe``."""
        idx = self._ifindex()
        info: dict = {"qdiscs": []}
        qdiscs = [q for q in self.egress.get_qdiscs(index=idx) if q["index"] == idx]
        root = next((q for q in qdiscs if q["parent"] == TC_H_ROOT), None)
        kind = root.get_attr("TCA_KIND") if root is not None else None
        rate, netem_q = None, None
        if kind == "htb" and root["handle"] == HTB_HANDLE:
            rate, netem_q = self._read_htb(idx, qdiscs, info)
        elif kind == "netem":
            netem_q = root
        elif root is not None and kind not in ("noqueue", "pfifo_fast", "fq_codel", "mq"):
            info["qdiscs"].append(f"{kind} {tc.handle_text(root['handle'])} root (not ours)")
        loss = delay = jitter = 0.0
        if netem_q is not None:
            loss, delay, jitter = self._read_netem(netem_q, info)
        if self._nft_loss() and not self._nft_chain_absent:
            nloss, text, drops = self._read_nft()
            if nloss:
                loss = nloss
            info["nft_rule"], info["nft_drops"] = text, drops
        return Shape(rate_bps=rate, loss=loss, delay_s=delay, jitter_s=jitter), info

    def _read_htb(self, idx: int, qdiscs: list, info: dict) -> tuple[int, Optional[object]]:
        """(rate in bit/s, the netem leaf or None) of our htb tree; notes it in ``info``."""
        info["qdiscs"].append("htb 1: root default 1:10")
        cls = next((c for c in self.egress.get_classes(index=idx)
                    if c["index"] == idx and c["handle"] == CLASS_HANDLE), None)
        if cls is None:
            raise ShapingMismatch(f"{self.name}: htb 1: without class 1:10")
        htb = tc.decode_htb_class(cls)
        rate = htb["rate_bps"]
        info["qdiscs"].append(
            f"class htb 1:10 rate {format_rate(rate)} ceil {format_rate(htb['ceil_bps'])} "
            f"burst {format_size(htb['burst'])} quantum {htb['quantum']}")
        if htb["ceil_bps"] != rate:
            raise ShapingMismatch(f"{self.name}: class 1:10 rate {rate} != ceil "
                                  f"{htb['ceil_bps']}")
        if htb["stats"]:
            info["class_stats"] = htb["stats"]
        leaf = next((q for q in qdiscs if q["parent"] == CLASS_HANDLE), None)
        if leaf is None or leaf.get_attr("TCA_KIND") == "netem":
            return rate, leaf
        lopts = leaf.get_attr("TCA_OPTIONS")
        limit = lopts.get("limit") if lopts is not None else None
        info["qdiscs"].append(f"{leaf.get_attr('TCA_KIND')} {tc.handle_text(leaf['handle'])} "
                              "parent 1:10" + (f" limit {limit}" if limit is not None else ""))
        return rate, None

    @staticmethod
    def _read_netem(netem_q, info: dict) -> tuple[float, float, float]:
        """(loss, delay_s, jitter_s) of our netem qdisc (root or leaf); notes it in ``info``."""
        nopts = netem_q.get_attr("TCA_OPTIONS")
        loss, delay, jitter = tc.decode_netem(nopts)
        where = "root" if netem_q["parent"] == TC_H_ROOT else "parent 1:10"
        info["qdiscs"].append(
            f"netem {tc.handle_text(netem_q['handle'])} {where} limit {nopts['limit']} "
            f"delay {format_duration(delay)} jitter {format_duration(jitter)} "
            f"loss {loss * 100:g}%")
        return loss, delay, jitter

    def _verify(self, asked: Shape) -> None:
        got = self.read_back()
        if not shapes_match(asked, got):
            self.shape = got
            raise ShapingMismatch(f"{self.name}: asked {_shape_text(asked)}, but the kernel "
                                  f"has {_shape_text(got)}")
        self.shape = asked
