#include "server/tenants.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/security.h"

namespace tessel::server {
namespace {

absl::StatusOr<int64_t> ParseBytes(absl::string_view v) {
  int64_t scale = 1;
  for (auto [suffix, s] :
       {std::pair{"KiB", int64_t{1} << 10}, {"MiB", int64_t{1} << 20}, {"GiB", int64_t{1} << 30}}) {
    if (absl::EndsWith(v, suffix)) {
      v.remove_suffix(3);
      scale = s;
      break;
    }
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 0 || n > (int64_t{1} << 62) / scale) {
    return absl::InvalidArgumentError("expected a byte count such as 1073741824 or 1GiB");
  }
  return n * scale;
}

}  // namespace

absl::StatusOr<Tenants> Tenants::Parse(absl::string_view text, absl::string_view file,
                                       TenantLimits defaults) {
  Tenants t(defaults);
  absl::flat_hash_map<std::string, TenantLimits> given;  // what the file says, by tenant
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(file, ":", line_no, ": ", what));
    };
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() < 2)
      return bad(
          "expected 'TOKEN TENANT [admin] [memory_quota=BYTES] [max_sessions=N] "
          "[compile_cache_quota=BYTES]'");
    const std::string token(f[0]), tenant(f[1]);
    if (t.tokens_.contains(token)) return bad("this token is already given on an earlier line");
    Principal p{tenant, false};
    TenantLimits limits = given.contains(tenant) ? given[tenant] : TenantLimits{-1, -1, -1};
    for (size_t i = 2; i < f.size(); ++i) {
      if (f[i] == "admin") {
        p.admin = true;
        continue;
      }
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(f[i], absl::MaxSplits('=', 1));
      int64_t* slot = kv.first == "memory_quota"          ? &limits.memory_quota_bytes
                      : kv.first == "max_sessions"        ? &limits.max_sessions
                      : kv.first == "compile_cache_quota" ? &limits.compile_cache_bytes
                                                          : nullptr;
      if (slot == nullptr) {
        return bad(absl::StrCat(
            "unknown option '", f[i],
            "'; expected admin, memory_quota=BYTES, max_sessions=N or compile_cache_quota=BYTES"));
      }
      int64_t n = 0;
      if (kv.first != "max_sessions") {
        auto b = ParseBytes(kv.second);
        if (!b.ok()) return bad(absl::StrCat(kv.first, "=", kv.second, ": ", b.status().message()));
        n = *b;
      } else if (!absl::SimpleAtoi(kv.second, &n) || n < 0) {
        return bad(absl::StrCat(kv.first, "=", kv.second, ": expected a count >= 0"));
      }
      if (*slot >= 0 && *slot != n) {
        return bad(absl::StrCat("tenant ", tenant, ": ", kv.first, "=", n,
                                " but an earlier line gives ", *slot));
      }
      *slot = n;
    }
    given[tenant] = limits;
    t.tokens_.emplace(token, std::move(p));
  }
  if (t.tokens_.empty())
    return absl::InvalidArgumentError(absl::StrCat(file, ": no tokens in the file"));
  for (const auto& [tenant, l] : given) {
    t.limits_[tenant] = TenantLimits{
        l.memory_quota_bytes >= 0 ? l.memory_quota_bytes : defaults.memory_quota_bytes,
        l.max_sessions >= 0 ? l.max_sessions : defaults.max_sessions,
        l.compile_cache_bytes >= 0 ? l.compile_cache_bytes : defaults.compile_cache_bytes};
  }
  return t;
}

absl::StatusOr<Tenants> Tenants::FromFile(const std::string& path, TenantLimits defaults) {
  std::ifstream f(path);
  if (!f)
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file=", path, ": cannot read the file"));
  std::stringstream text;
  text << f.rdbuf();
  return Parse(text.str(), path, defaults);
}

absl::StatusOr<Principal> Tenants::Authenticate(absl::string_view token) const {
  if (tokens_.empty()) return Principal{std::string(kDefaultTenant), true};
  if (token.empty()) {
    return absl::UnauthenticatedError(
        "this coordinator requires a token: pass one as 'authorization: Bearer <token>' metadata "
        "(the SDKs' token=, the CLI's --token or $TESSEL_TOKEN)");
  }
  for (const auto& [known, principal] : tokens_) {
    if (SecretEquals(known, token)) return principal;
  }
  return absl::UnauthenticatedError("the token presented is not one this coordinator knows");
}

TenantLimits Tenants::LimitsOf(const std::string& tenant) const {
  auto it = limits_.find(tenant);
  return it == limits_.end() ? defaults_ : it->second;
}

namespace {
// What says a file changed: modification time, size and inode.
std::tuple<int64_t, int64_t, int64_t, int64_t> FileStamp(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return {-1, -1, -1, -1};
  return {st.st_mtim.tv_sec, st.st_mtim.tv_nsec, st.st_size, static_cast<int64_t>(st.st_ino)};
}
}  // namespace

TokensFileWatcher::TokensFileWatcher(std::string path, TenantLimits defaults, absl::Duration every,
                                     std::function<void(Tenants)> apply,
                                     std::function<void(const absl::Status&)> on_error)
    : path_(std::move(path)),
      defaults_(defaults),
      every_(every),
      apply_(std::move(apply)),
      on_error_(std::move(on_error)),
      thread_([this] { Loop(); }) {}

TokensFileWatcher::~TokensFileWatcher() {
  stop_.Notify();
  thread_.join();
}

void TokensFileWatcher::Loop() {
  auto seen = FileStamp(path_);  // the file as it was read at start-up
  while (!stop_.WaitForNotificationWithTimeout(every_)) {
    const auto now = FileStamp(path_);
    if (now == seen) continue;
    seen = now;
    auto tenants = Tenants::FromFile(path_, defaults_);
    if (tenants.ok()) {
      apply_(std::move(*tenants));
    } else {
      on_error_(tenants.status());
    }
  }
}

}  // namespace tessel::server
