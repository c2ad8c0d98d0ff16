// Transport security and caller identity, shared by the daemons, the SDK and
// the CLI.
//
// TLS: a daemon's certificate and key (--tls_cert, --tls_key) are its
// identity both as a server and as a client of the other daemons; --tls_ca
// verifies the peer. The files are watched and reloaded when they change
// (rotation needs no restart). Without TLS a daemon listens only on a
// loopback address unless --insecure says otherwise.
//
// Identity on the wire is bearer metadata ("authorization: Bearer <token>"),
// attached to every call of a channel by an interceptor (so it works on
// plaintext loopback channels, which refuse call credentials, as well as on
// TLS ones) and read by the services with BearerToken.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tessel/v1/worker.pb.h"

namespace tessel {

struct TlsFiles {
  std::string cert, key, ca;  // PEM files
  // How often the files are checked for changes.
  int reload_s = 10;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// What a daemon serves and joins with.
struct DaemonSecurity {
  TlsFiles tls;
  std::string join_token;  // empty: none
  bool insecure = false;   // --insecure: plaintext allowed off loopback
};
// The daemon's --tls_* and --join_token_file, checked (CheckTlsFiles, and
// CheckListenSecurity against `host` and --insecure); the error names the
// flag and what is wrong.
absl::StatusOr<DaemonSecurity> DaemonSecurityFromFlags(absl::string_view daemon,
                                                       absl::string_view host);

// INVALID_ARGUMENT naming the flag when a file is missing or unreadable, or
// when a server has a certificate without its key (or the reverse).
absl::Status CheckTlsFiles(const TlsFiles& tls, bool server);

// True for 127.0.0.0/8, ::1 and "localhost".
bool IsLoopbackHost(absl::string_view host);

// Whether a daemon may listen on `host`: over TLS always; in plaintext on a
// loopback address, or anywhere with `insecure` (the caller logs a warning).
// FAILED_PRECONDITION saying which flags would allow it otherwise.
absl::Status CheckListenSecurity(absl::string_view daemon, absl::string_view host,
                                 const TlsFiles& tls, bool insecure);

// Server credentials: plaintext without TLS files; otherwise TLS, asking
// peers for a certificate signed by the CA: required when
// `require_client_cert` (a worker's port: only the cluster's daemons may
// call), verified when presented otherwise (the coordinator's port, which
// clients without certificates reach too).
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& tls,
                                                           bool require_client_cert);

// Channel credentials: plaintext without TLS files; otherwise TLS verifying
// the server against the CA (the system's roots without one) and presenting
// the certificate and key when given.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& tls);

// A channel whose every call carries `token` as bearer metadata (none when
// empty).
std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> creds,
    const grpc::ChannelArguments& args, const std::string& token);

// The bearer token the caller presented, or empty.
std::string BearerToken(const grpc::ServerContextBase& ctx);
// The token of an authorization value "Bearer <token>" (any case); "" if it is not one.
std::string BearerTokenOf(absl::string_view authorization);

// The first line of a secret file, surrounding space trimmed.
// INVALID_ARGUMENT naming `flag` when unreadable or empty.
absl::StatusOr<std::string> ReadSecretFile(absl::string_view flag, const std::string& path);

// A fresh random secret: 32 hex digits.
std::string RandomSecret();

// SHA-256 of `bytes`, in hex (64 digits): a digest nobody can forge a
// collision for, where an id names content another party chooses.
std::string Sha256Hex(absl::string_view bytes);

// Compares secrets in time independent of where they differ.
bool SecretEquals(absl::string_view a, absl::string_view b);

// Tickets: a client's authority, granted by the coordinator, to read or
// write one buffer on one worker directly. A ticket is "<expiry in unix
// ms>.<HMAC-SHA256 of the grant and the expiry, keyed with the worker's
// secret, in hex>"; the coordinator signs, the worker checks. The grant
// says exactly what is allowed (ReadGrant, WriteGrant).
std::string SignTicket(absl::string_view secret, absl::string_view grant, absl::Time expiry);
// OK when `ticket` was signed with `secret` for `grant` and has not expired
// at `now`; PERMISSION_DENIED saying which part failed.
absl::Status CheckTicket(absl::string_view secret, absl::string_view ticket,
                         absl::string_view grant, absl::Time now);
// Reading buffer `buffer` of the worker's device `device` (local index).
std::string ReadGrant(int device, uint64_t buffer);
// Writing buffer `buffer`, of type `type` (as "f32[2,3]"), to the worker's
// devices `devices` (local indices).
std::string WriteGrant(uint64_t buffer, absl::string_view type, absl::Span<const int> devices);
// The write a PutShard header asks for: what the coordinator signs for a
// client and the worker checks, derived alike on both sides.
std::string WriteGrant(const v1::PutShardRequest::Header& header);
// Receipts: what a worker signs, with the same HMAC as a ticket, once a
// write by ticket has landed whole; the coordinator checks it before the
// array is ready. Worded apart from WriteGrant, so a write ticket is never
// a receipt.
std::string WrittenGrant(uint64_t buffer, absl::string_view type, absl::Span<const int> devices);
std::string WrittenGrant(const v1::PutShardRequest::Header& header);

}  // namespace tessel
