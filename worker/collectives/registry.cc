#include "worker/collectives/registry.h"

#include <gloo/transport/tcp/attr.h>

#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "spdlog/sinks/null_sink.h"
#include "worker/collectives.h"
#include "worker/collectives/gloo_endpoint.h"
#include "worker/collectives/group.h"
#include "worker/collectives/layout.h"
#include "worker/gloo_guard.h"

namespace tessel::worker {

EpochKey ParseEpochKey(const std::string& key) {
  EpochKey k;
  const size_t at = key.rfind('@');
  if (at == std::string::npos) return k;
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos || dot < at) return k;
  if (!absl::SimpleAtoi(absl::string_view(key).substr(dot + 1), &k.epoch)) return k;
  k.devices = key.substr(0, at);
  k.incarnation = key.substr(at + 1, dot - at - 1);
  k.valid = true;
  return k;
}

namespace {

class Registry final : public CommunicatorRegistry {
 public:
  Registry(CollectivesOptions options, std::shared_ptr<const GlooEndpoint> endpoint)
      : options_(std::move(options)), endpoint_(std::move(endpoint)) {}

  absl::StatusOr<std::shared_ptr<Communicator>> Get(const GroupSpec& spec) override {
    absl::MutexLock l(&mu_);
    if (auto it = groups_.find(spec.key); it != groups_.end()) {
      if (it->second->rank_workers() != spec.rank_workers) {
        return absl::InvalidArgumentError(
            absl::StrCat("collective group '", spec.key, "' was created with rank workers [",
                         absl::StrJoin(it->second->rank_workers(), ", "),
                         "], asked for again with [", absl::StrJoin(spec.rank_workers, ", "), "]"));
      }
      return it->second;
    }
    const EpochKey ek = ParseEpochKey(spec.key);
    if (ek.valid) {
      auto cur = current_.find(ek.devices);
      if (cur != current_.end()) {
        const EpochKey& now = cur->second;
        if (now.incarnation == ek.incarnation && ek.epoch < now.epoch) {
          return absl::FailedPreconditionError(
              absl::StrCat("collective group '", spec.key, "': its epoch ", ek.epoch,
                           " is over (this worker meets in epoch ", now.epoch,
                           " now); a step sent before a group broke cannot run its collectives"));
        }
      }
    }
    auto layout = MakeLayout(spec, options_.self);
    if (!layout.ok()) return layout.status();
    if (layout->num_workers() > 1 && endpoint_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "collective group '", spec.key, "' spans workers [", absl::StrJoin(layout->workers, ", "),
          "] but this worker has no rendezvous store"));
    }
    auto group = std::make_shared<GroupCommunicator>(std::move(*layout), endpoint_,
                                                     options_.timeout, options_.logger);
    if (ek.valid) {
      // Earlier epochs of these devices (and other coordinators') are over.
      for (auto it = groups_.begin(); it != groups_.end();) {
        const EpochKey old = ParseEpochKey(it->first);
        if (old.valid && old.devices == ek.devices) {
          options_.logger->info("collective group '{}' dropped: superseded by '{}'", it->first,
                                spec.key);
          groups_.erase(it++);
        } else {
          ++it;
        }
      }
      current_[ek.devices] = ek;
    }
    groups_.emplace(spec.key, group);
    return std::shared_ptr<Communicator>(std::move(group));
  }

  int num_groups() const override {
    absl::MutexLock l(&mu_);
    return groups_.size();
  }
  gloo::rendezvous::Store* rendezvous_store() const override { return options_.store.get(); }
  bool transport_open() const override { return endpoint_ != nullptr && endpoint_->opened(); }

 private:
  const CollectivesOptions options_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<GroupCommunicator>> groups_ ABSL_GUARDED_BY(mu_);
  // The newest epoch key seen for each set of devices.
  absl::flat_hash_map<std::string, EpochKey> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CommunicatorRegistry>> NewCommunicatorRegistry(
    CollectivesOptions options) {
  if (options.self.empty())
    return absl::InvalidArgumentError("collectives: `self` (this worker's address) is empty");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("collectives: timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  if (options.logger == nullptr) {
    options.logger = std::make_shared<spdlog::logger>(
        "collectives", std::make_shared<spdlog::sinks::null_sink_mt>());
  }
  std::shared_ptr<GlooEndpoint> endpoint;
  if (options.store != nullptr) {
    if (!GlooPeerNameGuardActive()) {
      options.logger->warn(
          "this executable does not export the guard for Gloo's connect (worker/gloo_guard.h): a "
          "peer that resets a connection while it is set up will terminate this process");
    }
    SetGlooGuardLogger(options.logger);
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    endpoint = std::make_shared<GlooEndpoint>(options.store, std::move(attr));
    // A hostname Gloo cannot use fails the worker's start, not its first collective.
    TESSEL_RETURN_IF_ERROR(endpoint->Probe());
  }
  return std::make_unique<Registry>(std::move(options), std::move(endpoint));
}

}  // namespace tessel::worker
