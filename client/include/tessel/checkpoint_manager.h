// A directory of checkpoints, one per step (`directory/<step>`), as Orbax's
// CheckpointManager and the Python SDK's tessel.checkpoints.CheckpointManager:
// save every `save_interval_steps`, keep the `max_to_keep` latest and every
// step divisible by `keep_period`. A save returns once the devices have
// snapshotted their blocks (the arrays may be donated at once); it is
// committed, and older steps pruned, in the background. One save is written
// at a time: a save waits for the one before. Another manager on the same
// directory is refused while this one lives.
//
// The manifest it writes is the Python SDK's ({"step", "leaves", "user"}),
// so tessel.checkpoints.restore reads its checkpoints as a dict of arrays.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tessel/session.h"

namespace tessel {

struct CheckpointManagerOptions {
  std::optional<int> max_to_keep;  // none: keep every step
  int64_t save_interval_steps = 1;
  std::optional<int64_t> keep_period;  // steps divisible by it are never pruned
};

class CheckpointManager {
 public:
  // `directory`: absolute, on a volume every worker shares.
  static absl::StatusOr<std::unique_ptr<CheckpointManager>> Open(
      Session& session, std::string directory, CheckpointManagerOptions options = {});
  // Waits for the save in progress and releases the directory.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const std::string& directory() const { return directory_; }
  // The committed steps, ascending.
  absl::StatusOr<std::vector<int64_t>> AllSteps();
  absl::StatusOr<std::optional<int64_t>> LatestStep();
  // Due by the interval and not saved already.
  absl::StatusOr<bool> ShouldSave(int64_t step);
  // Saves `arrays` (each under its name) as step `step` when due, or with
  // `force`; returns whether it did. `wait`: committed before it returns.
  absl::StatusOr<bool> Save(int64_t step, const std::vector<std::pair<std::string, Array>>& arrays,
                            bool wait = false, bool force = false);
  // The save in progress, committed and pruned after; its error, if any.
  absl::Status WaitUntilFinished();
  // The arrays of step `step` (none: the latest) as `targets` ask.
  absl::StatusOr<std::vector<Array>> Restore(std::optional<int64_t> step,
                                             const std::vector<CheckpointTarget>& targets);

 private:
  CheckpointManager(Session& session, std::string directory, CheckpointManagerOptions options)
      : session_(session), directory_(std::move(directory)), options_(options) {}
  std::string Path(int64_t step) const;
  absl::Status Prune();

  Session& session_;
  const std::string directory_;
  const CheckpointManagerOptions options_;
  std::future<absl::Status> pending_;  // the save being committed
};

}  // namespace tessel
