"""The data plane: posted receives, staging, sends split over rails, ACKs, failures.

The engine is the ``handler`` of every Connection. A message is one step of a collective
from one rank to another; it is named (op_id, step, src) and cut into chunks, each chunk
named by its byte offset. Receivers accept a chunk from any rail and ignore repeats, so a
sender may move unacknowledged chunks of a failed rail to the surviving ones.

  core        Engine: state, begin/end of an operation, waiting, fatal failure
  messages    Desc (what a call's frames say about it), RecvSlot, SendMsg, SendChunk
  receive     posted receives, staging, ACKs sent, rate samples (b_r)
  send        chunking over rails, ACKs received, start-up samples (a_r)
  agreement   CONTROL frames; which rails every rank agrees are down
  failover    a failed connection: reroute its chunks, report it, or fail the job
"""
from .core import Engine  # noqa: F401
from .messages import Desc  # noqa: F401
