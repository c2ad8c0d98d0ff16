#include "core/security.h"

#include <arpa/inet.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/client_interceptor.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"

namespace tessel {

namespace {

absl::Status Readable(absl::string_view flag, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::ifstream f(path);
  if (!f)
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  std::string line;
  std::getline(f, line);
  if (!absl::StrContains(line, "-----BEGIN")) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path,
                                                   ": expected a PEM file (-----BEGIN ...), got '",
                                                   line.substr(0, 40), "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& tls, bool server) {
  if (!tls.enabled()) return absl::OkStatus();
  if (tls.cert.empty() != tls.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: --tls_cert and --tls_key go together; got ",
                     tls.cert.empty() ? "--tls_key alone" : "--tls_cert alone"));
  }
  if (server && tls.cert.empty()) {
    return absl::InvalidArgumentError(
        "TLS: a daemon needs --tls_cert and --tls_key as well as --tls_ca");
  }
  if (server && tls.ca.empty()) {
    return absl::InvalidArgumentError(
        "TLS: a daemon needs --tls_ca to verify the other daemons' certificates");
  }
  for (auto [flag, path] :
       {std::pair{"tls_cert", &tls.cert}, {"tls_key", &tls.key}, {"tls_ca", &tls.ca}}) {
    if (absl::Status s = Readable(flag, *path); !s.ok()) return s;
  }
  return absl::OkStatus();
}

bool IsLoopbackHost(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string h(host);
  in_addr v4{};
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::Status CheckListenSecurity(absl::string_view daemon, absl::string_view host,
                                 const TlsFiles& tls, bool insecure) {
  if (tls.enabled() || insecure || IsLoopbackHost(host)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(daemon, ": --host=", host,
                   " is not a loopback address and TLS is off: give --tls_cert, --tls_key and "
                   "--tls_ca, or --insecure to serve plaintext on a network you trust"));
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& tls,
                                                           bool require_client_cert) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      tls.key, tls.cert, tls.ca, tls.reload_s);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!tls.ca.empty()) options.watch_root_certs();
  options.set_cert_request_type(require_client_cert
                                    ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (!tls.ca.empty() || !tls.cert.empty()) {
    auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        tls.key, tls.cert, tls.ca, tls.reload_s);
    options.set_certificate_provider(provider);
    if (!tls.ca.empty()) options.watch_root_certs();
    if (!tls.cert.empty()) options.watch_identity_key_cert_pairs();
  }
  return grpc::experimental::TlsCredentials(options);
}

namespace {

class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", *value_});
    }
    methods->Proceed();
  }

 private:
  const std::string* value_;
};

class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& token)
      : value_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(&value_);
  }

 private:
  const std::string value_;  // outlives every call: the channel owns the factory
};

}  // namespace

std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> creds,
    const grpc::ChannelArguments& args, const std::string& token) {
  if (token.empty()) return grpc::CreateCustomChannel(address, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<BearerInterceptorFactory>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, creds, args,
                                                                 std::move(interceptors));
}

std::string BearerToken(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return "";
  return BearerTokenOf(absl::string_view(it->second.data(), it->second.size()));
}

std::string BearerTokenOf(absl::string_view v) {
  if (!absl::StartsWithIgnoreCase(v, "bearer ")) return "";
  return std::string(absl::StripAsciiWhitespace(v.substr(7)));
}

absl::StatusOr<std::string> ReadSecretFile(absl::string_view flag, const std::string& path) {
  std::ifstream f(path);
  if (!f)
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  std::string line;
  std::getline(f, line);
  std::string secret(absl::StripAsciiWhitespace(line));
  if (secret.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path,
                                                   ": expected a token on the first line, "
                                                   "got an empty line"));
  }
  return secret;
}

std::string RandomSecret() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&out, "%08x", rd());
  return out;
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr);
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) absl::StrAppendFormat(&hex, "%02x", digest[i]);
  return hex;
}

bool SecretEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

namespace {

// HMAC-SHA256 of "<grant>|<expiry ms>" keyed with `secret`, in hex.
std::string TicketMac(absl::string_view secret, absl::string_view grant, int64_t expiry_ms) {
  const std::string msg = absl::StrCat(grant, "|", expiry_ms);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), int(secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) absl::StrAppendFormat(&hex, "%02x", mac[i]);
  return hex;
}

}  // namespace

std::string ReadGrant(int device, uint64_t buffer) {
  return absl::StrFormat("read of buffer %#x on device %d", buffer, device);
}

std::string WriteGrant(uint64_t buffer, absl::string_view type, absl::Span<const int> devices) {
  return absl::StrFormat("write of buffer %#x (%s) to devices %s", buffer, type,
                         absl::StrJoin(devices, ","));
}

std::string WriteGrant(const v1::PutShardRequest::Header& header) {
  return WriteGrant(header.buffer(), TypeString(header.type()),
                    std::vector<int>(header.devices().begin(), header.devices().end()));
}

std::string WrittenGrant(uint64_t buffer, absl::string_view type, absl::Span<const int> devices) {
  return absl::StrFormat("receipt: buffer %#x (%s) written whole to devices %s", buffer, type,
                         absl::StrJoin(devices, ","));
}

std::string WrittenGrant(const v1::PutShardRequest::Header& header) {
  return WrittenGrant(header.buffer(), TypeString(header.type()),
                      std::vector<int>(header.devices().begin(), header.devices().end()));
}

std::string SignTicket(absl::string_view secret, absl::string_view grant, absl::Time expiry) {
  const int64_t ms = absl::ToUnixMillis(expiry);
  return absl::StrCat(ms, ".", TicketMac(secret, grant, ms));
}

absl::Status CheckTicket(absl::string_view secret, absl::string_view ticket,
                         absl::string_view grant, absl::Time now) {
  const size_t dot = ticket.find('.');
  int64_t expiry_ms = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(ticket.substr(0, dot), &expiry_ms)) {
    return absl::PermissionDeniedError(
        absl::StrCat("ticket for the ", grant,
                     ": expected \"<expiry ms>.<signature>\" as the coordinator issues it, got a "
                     "malformed one"));
  }
  const std::string want = TicketMac(secret, grant, expiry_ms);
  const absl::string_view got = ticket.substr(dot + 1);
  if (got.size() != want.size() || CRYPTO_memcmp(got.data(), want.data(), want.size()) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "ticket: not signed for the ", grant, " by the coordinator this worker registered with"));
  }
  if (absl::FromUnixMillis(expiry_ms) < now) {
    return absl::PermissionDeniedError(
        absl::StrCat("ticket for the ", grant, ": expired ",
                     absl::FormatDuration(now - absl::FromUnixMillis(expiry_ms)),
                     " ago; ask the coordinator again for a fresh one"));
  }
  return absl::OkStatus();
}

}  // namespace tessel
