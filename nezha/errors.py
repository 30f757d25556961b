"""Exceptions raised by nezha. Every failure a user can see is a NezhaError subclass."""


class NezhaError(Exception):
    """Base class of every error nezha raises."""


class ConfigError(NezhaError, ValueError):
    """Bad arguments or environment (rank out of range, unknown system, bad dtype...)."""


class RailConfigError(ConfigError):
    """A rail address or interface that does not exist on this host."""


class StoreError(NezhaError):
    """The key-value store could not be reached or answered badly."""


class StoreTimeout(StoreError, TimeoutError):
    """A store wait did not complete within its timeout."""


class RendezvousError(NezhaError):
    """The ranks could not agree on who is in the job."""


class DuplicateRankError(RendezvousError):
    """Two processes claimed the same rank."""


class MissingRankError(RendezvousError, TimeoutError):
    """Some ranks never showed up within the timeout."""


class WorldSizeMismatchError(RendezvousError):
    """Ranks disagree on the world size (or on the number of rails)."""


class RendezvousAborted(RendezvousError):
    """Another rank failed the rendezvous and told everyone."""


class AuthenticationError(StoreError, RendezvousError):
    """The store or a peer did not prove the job secret, or refused our proof (a wrong or
    missing NEZHA_JOB_SECRET on one side, or not a member of this job at all)."""


class CommError(NezhaError):
    """A collective failed. The Context is unusable afterwards."""


class ProtocolError(CommError):
    """A peer sent a malformed or unexpected frame (bad magic, checksum, lengths...)."""


class MismatchError(CommError):
    """Ranks called collectives with different arguments (length, dtype, op, root...)."""


class PeerClosedError(CommError):
    """A peer closed its connections (or died) while work was outstanding."""


class PeerAbortedError(CommError):
    """A peer failed and told us why (an ABORT frame)."""


class AllRailsDownError(CommError):
    """No rail to a peer is left."""


class CommTimeout(CommError, TimeoutError):
    """A collective did not complete within the context's timeout."""


class AggregatorError(CommError):
    """An aggregation switch (an in-network reduction rail) failed a contribution."""


class AggregatorUnavailable(AggregatorError):
    """The aggregation switch cannot be reached, or its connection is gone: every
    contribution still in flight on it failed (the caller moves them to other rails)."""


class AggregatorTimeout(AggregatorUnavailable, TimeoutError):
    """No result from the aggregation switch within the timeout."""


class AggregationRefused(AggregatorError):
    """The switch refused one contribution or gave up its key (``code``: busy, duplicate,
    mismatch, timeout, ...); the connection stays usable."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code
