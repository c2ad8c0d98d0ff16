"""gRPC channels to Tessel's daemons: TLS from files or $TESSEL_TLS_CA, and a
bearer token (or $TESSEL_TOKEN) on every call."""

import collections
import os

import grpc


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel (a
    plaintext loopback channel refuses call credentials, so not those)."""

    def __init__(self, token):
        self._entry = ("authorization", "Bearer " + token)

    def _details(self, d):
        return _CallDetails(
            d.method,
            d.timeout,
            list(d.metadata or ()) + [self._entry],
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    intercept_stream_stream = intercept_stream_unary


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}={path!r}: cannot read the file: {e.strerror}") from None


def make_channel(address, *, token=None, tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None, options=()):
    """A gRPC channel to a Tessel daemon: TLS when a CA file is given (or
    $TESSEL_TLS_CA), verifying the server against it and presenting
    `tls_cert`/`tls_key` when given; every call carries `token` (or
    $TESSEL_TOKEN) as bearer metadata."""
    token = token if token is not None else os.environ.get("TESSEL_TOKEN")
    tls_ca = tls_ca if tls_ca is not None else os.environ.get("TESSEL_TLS_CA")
    options = list(options)
    if tls_ca:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(tls_ca, "tls_ca"),
            private_key=_read(tls_key, "tls_key") if tls_key else None,
            certificate_chain=_read(tls_cert, "tls_cert") if tls_cert else None,
        )
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel
