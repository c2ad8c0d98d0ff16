#include "server/kv_store.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessel::server {
namespace {

// Keys are chosen by programs, not people; quote them with escapes so a
// message stays one readable line.
std::string Quoted(absl::string_view key) {
  constexpr size_t kShown = 200;
  std::string shown = absl::CHexEscape(key.substr(0, kShown));
  return key.size() > kShown ? absl::StrCat("'", shown, "'...") : absl::StrCat("'", shown, "'");
}

}  // namespace

KvStore::KvStore(Limits limits) : limits_(limits) {}

absl::Status KvStore::CheckKey(absl::string_view key) const {
  if (key.empty()) return absl::InvalidArgumentError("kv store: empty key");
  if (int64_t(key.size()) > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv store: key %s is %d bytes, the limit is %d", Quoted(key), key.size(),
                        limits_.max_key_bytes));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(absl::string_view key, std::string value, const std::string& writer) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (int64_t(value.size()) > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv store: value for key %s is %d bytes, the limit is %d", Quoted(key),
                        value.size(), limits_.max_value_bytes));
  }
  absl::MutexLock l(&mu_);
  auto it = values_.find(key);
  if (it != values_.end() && it->second.writer != writer) {
    return absl::PermissionDeniedError(
        absl::StrFormat("kv store: key %s was set by another writer and is not %s's to replace",
                        Quoted(key), writer.empty() ? "an anonymous caller" : writer));
  }
  const int64_t old_bytes =
      it == values_.end() ? 0 : int64_t(it->first.size() + it->second.value.size());
  const int64_t new_bytes = int64_t(key.size() + value.size());
  const absl::string_view group = key.substr(0, key.find('/'));
  GroupUsage& g = groups_[group];
  if (it == values_.end() && g.keys >= limits_.max_group_keys) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("kv store: cannot add key %s: its group %s holds the "
                        "limit of %d keys",
                        Quoted(key), Quoted(group), limits_.max_group_keys));
  }
  if (g.bytes - old_bytes + new_bytes > limits_.max_group_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "kv store: cannot set key %s (%d bytes): its group %s holds %d of its %d bytes",
        Quoted(key), new_bytes, Quoted(group), g.bytes, limits_.max_group_bytes));
  }
  if (it == values_.end() && int64_t(values_.size()) >= limits_.max_keys) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv store: cannot add key %s: the store holds the limit of %d keys",
                        Quoted(key), limits_.max_keys));
  }
  if (total_bytes_ - old_bytes + new_bytes > limits_.max_total_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv store: cannot set key %s (%d bytes): the store holds %d of its %d bytes", Quoted(key),
        new_bytes, total_bytes_, limits_.max_total_bytes));
  }
  total_bytes_ += new_bytes - old_bytes;
  g.bytes += new_bytes - old_bytes;
  if (it == values_.end()) {
    ++g.keys;
    values_.emplace(std::string(key), Entry{std::move(value), writer});
  } else {
    it->second.value = std::move(value);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvStore::Get(absl::string_view key, absl::Duration timeout) const {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.contains(key); };
  // Set wakes waiters through the mutex: absl::Mutex re-evaluates the
  // conditions of waiters whenever it is released.
  absl::MutexLock l(&mu_);
  if (!present() && !mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "kv store: key ", Quoted(key), " was not set within ", absl::FormatDuration(timeout)));
  }
  return values_.find(key)->second.value;
}

int64_t KvStore::num_keys() const {
  absl::MutexLock l(&mu_);
  return values_.size();
}

}  // namespace tessel::server
