"""Nezha: multi-rail collective communication (allreduce, broadcast, allgather,
reduce_scatter, barrier) over several network rails, with online cost-balanced splitting
and rail fault tolerance.

Modules, in the order data flows:
  config       Config / Workload: every NEZHA_* variable, read once (the table is there)
  kinds        SYSTEMS, DTYPES, OPS (also what the testbed's scenarios accept)
  context      Context: the public API (see its docstring); Context.from_env()
  buffers      user buffers -> flat numpy arrays (and the copy back)
  rendezvous   store meeting, authenticated HELLO/AUTH handshake, connect / accept, rejoin
  store        TCP key-value store for rendezvous (served by rank 0), authenticated, bounded
  auth         the job secret: HMAC-SHA256 challenge-response (store and rails)
  rails        rail specs (IPv4 address or interface name) -> addresses
  transport/   Transport + Connection (TCP per rail, MPTCP), reader/writer threads
  wire         the 64-byte frame header (documented there)
  collectives  pipelined ring reduce-scatter/allgather, star or chain broadcast
  engine/      posted receives, staging, chunking over rails, ACKs, reroute, abort
  exchange     the estimate exchange (allgather of every rank's table) before an op
  balance      cost model T = a + s*b, estimates, agreement, cold/hot state machine
  health       watchdog, heartbeats, netlink link events, rail reports, re-probe/rejoin
  events       per-rail counters and the JSON-lines event log
  baselines    make_context(system=...), GlooContext (torch)
  torch/       the torch.distributed backend "nezha" (import nezha.torch; DDP unchanged)
  worker       python -m nezha.worker: verified allreduce loop for the testbed
  bench        python -m nezha.bench: latency / algbw / busbw per system
  testing      run ranks as local processes on loopback rails
"""
from .errors import *  # noqa: F401,F403
from .config import Config  # noqa: F401
from .context import Context  # noqa: F401
from .kinds import SYSTEMS  # noqa: F401

__all__ = ["Config", "Context", "SYSTEMS"]
