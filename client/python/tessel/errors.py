"""Exceptions: one class per kind of failure, each carrying the server's message."""

import grpc


class TesselError(Exception):
    """Base class. `code` is the gRPC status code name (e.g. 'INVALID_ARGUMENT')."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


class InvalidArgumentError(TesselError):
    """A malformed graph, a wrong argument, a signature mismatch."""


class NotFoundError(TesselError):
    """An array, executable or session that does not exist (or was deleted)."""


class DonatedArrayError(TesselError):
    """An array used after it was donated to an execution."""


class TransferGuardError(TesselError):
    """A transfer the transfer guard disallows."""


class RecompileError(TesselError):
    """A compile the session forbids (a cache miss with compiles forbidden)."""


class OutOfMemoryError(TesselError):
    """A device out of memory, or a session over its memory quota."""


class WorkerLostError(TesselError):
    """A worker stopped answering; its arrays are lost."""


class FailedPreconditionError(TesselError):
    """Any other FAILED_PRECONDITION."""


def from_code(code, message):
    """The exception for a status code name and the server's message."""
    if code == "FAILED_PRECONDITION" or code == grpc.StatusCode.FAILED_PRECONDITION:
        code = "FAILED_PRECONDITION"
        if "transfer guard:" in message:
            return TransferGuardError(message, code)
        if "was donated to execution" in message:
            return DonatedArrayError(message, code)
        if "forbids new compiles" in message:
            return RecompileError(message, code)
        return FailedPreconditionError(message, code)
    if isinstance(code, grpc.StatusCode):
        code = code.name
    kinds = {
        "INVALID_ARGUMENT": InvalidArgumentError,
        "NOT_FOUND": NotFoundError,
        "RESOURCE_EXHAUSTED": OutOfMemoryError,
        "UNAVAILABLE": WorkerLostError,
    }
    return kinds.get(code, TesselError)(message, code)


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def from_status_int(code, message):
    return from_code(_CODE_NAMES.get(code, "UNKNOWN"), message)


def from_rpc_error(e):
    return from_code(e.code(), e.details() or str(e))
