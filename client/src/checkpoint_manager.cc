// CheckpointManager over Session's checkpoint calls (the workers write and
// read every byte; this client names steps and prunes).
#include "tessel/checkpoint_manager.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/json.h"
#include "core/status.h"

namespace tessel {

absl::StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Open(
    Session& session, std::string directory, CheckpointManagerOptions options) {
  if (directory.empty() || directory.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory '", directory, "': expected an absolute path"));
  }
  if (options.save_interval_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("save_interval_steps ", options.save_interval_steps, ": expected at least 1"));
  }
  if (options.max_to_keep && *options.max_to_keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_to_keep ", *options.max_to_keep, ": expected at least 1, or none"));
  }
  if (options.keep_period && *options.keep_period < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_period ", *options.keep_period, ": expected at least 1, or none"));
  }
  TESSEL_RETURN_IF_ERROR(session.HoldCheckpoints(directory));
  return std::unique_ptr<CheckpointManager>(
      new CheckpointManager(session, std::move(directory), options));
}

CheckpointManager::~CheckpointManager() {
  (void)WaitUntilFinished();
  (void)session_.HoldCheckpoints(directory_, /*release=*/true);
}

std::string CheckpointManager::Path(int64_t step) const {
  return absl::StrCat(directory_, "/", step);
}

absl::StatusOr<std::vector<int64_t>> CheckpointManager::AllSteps() {
  TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> names, session_.ListCheckpoints(directory_));
  std::vector<int64_t> steps;
  for (const std::string& n : names) {
    int64_t step = 0;
    if (!n.empty() &&
        std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
        absl::SimpleAtoi(n, &step)) {
      steps.push_back(step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::optional<int64_t>> CheckpointManager::LatestStep() {
  TESSEL_ASSIGN_OR_RETURN(std::vector<int64_t> steps, AllSteps());
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

absl::StatusOr<bool> CheckpointManager::ShouldSave(int64_t step) {
  if (step % options_.save_interval_steps != 0) return false;
  TESSEL_ASSIGN_OR_RETURN(std::vector<int64_t> steps, AllSteps());
  return std::find(steps.begin(), steps.end(), step) == steps.end();
}

absl::StatusOr<bool> CheckpointManager::Save(
    int64_t step, const std::vector<std::pair<std::string, Array>>& arrays, bool wait, bool force) {
  TESSEL_RETURN_IF_ERROR(
      WaitUntilFinished());  // the one before, which AllSteps counts once committed
  if (!force) {
    TESSEL_ASSIGN_OR_RETURN(bool due, ShouldSave(step));
    if (!due) return false;
  }
  std::vector<std::string> leaves;
  for (const auto& [name, array] : arrays) {
    leaves.push_back(
        absl::StrCat("{\"name\": ", JsonString(name), ", \"keys\": [", JsonString(name), "]}"));
  }
  const std::string manifest = absl::StrCat("{\"step\": ", step, ", \"leaves\": [",
                                            absl::StrJoin(leaves, ", "), "], \"user\": {}}");
  TESSEL_ASSIGN_OR_RETURN(PendingCheckpoint save,
                          session_.SaveCheckpoint(Path(step), arrays, manifest));
  pending_ = std::async(std::launch::async, [this, save] {
    TESSEL_RETURN_IF_ERROR(session_.CommitCheckpoint(save));
    return Prune();
  });
  if (wait) TESSEL_RETURN_IF_ERROR(WaitUntilFinished());
  return true;
}

absl::Status CheckpointManager::Prune() {
  if (!options_.max_to_keep) return absl::OkStatus();
  TESSEL_ASSIGN_OR_RETURN(std::vector<int64_t> steps, AllSteps());
  const int keep = *options_.max_to_keep;
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    if (options_.keep_period && steps[i] % *options_.keep_period == 0) continue;
    TESSEL_RETURN_IF_ERROR(session_.RemoveCheckpoint(Path(steps[i])));
  }
  return absl::OkStatus();
}

absl::Status CheckpointManager::WaitUntilFinished() {
  if (!pending_.valid()) return absl::OkStatus();
  return pending_.get();
}

absl::StatusOr<std::vector<Array>> CheckpointManager::Restore(
    std::optional<int64_t> step, const std::vector<CheckpointTarget>& targets) {
  if (!step) {
    TESSEL_ASSIGN_OR_RETURN(step, LatestStep());
    if (!step) return absl::NotFoundError(absl::StrCat("no checkpoint in ", directory_));
  }
  return session_.RestoreCheckpoint(Path(*step), targets);
}

}  // namespace tessel
