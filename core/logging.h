// The daemons' logs: spdlog to stdout, as text (the default) or as JSON
// lines for log collectors (--log_format=json): one object per line with
// "time" (UTC, RFC 3339 with microseconds), "level", "logger", "thread" and
// "message", the message escaped as JSON requires.
#pragma once

#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "spdlog/formatter.h"
#include "spdlog/logger.h"

namespace tessel {

// A formatter writing each record as one JSON object per line.
std::unique_ptr<spdlog::formatter> NewJsonFormatter();

// The daemon's logger `name` on stdout, at `level` (trace, debug, info,
// warn, error) in `format` (text or json). INVALID_ARGUMENT naming the flag
// for a level or format it does not know.
absl::StatusOr<std::shared_ptr<spdlog::logger>> MakeDaemonLogger(const std::string& name,
                                                                 const std::string& level,
                                                                 const std::string& format);

// How a daemon starts (StartDaemon): its name ("coordinator", "worker";
// "tessel-<name>" in messages), its usage line, the main file whose flags
// --help lists, and its --log_level, --log_format and --parent_pid flags.
struct DaemonStart {
  std::string name;
  const char* usage = "";
  std::string main_file;
  const absl::Flag<std::string>* log_level = nullptr;
  const absl::Flag<std::string>* log_format = nullptr;
  const absl::Flag<int>* parent_pid = nullptr;
};

// What every daemon does first: blocks the termination signals (they are
// waited for), tunes the allocator for streaming, skips absl's mutex cycle
// detection, parses the flags, makes the logger and, with --parent_pid,
// stops with that process. The logger; null after saying why (on stderr,
// or in the log), with the exit code in *exit_code (2: a flag; 1: the
// parent is gone).
std::shared_ptr<spdlog::logger> StartDaemon(int argc, char** argv, const DaemonStart& d,
                                            int* exit_code);

}  // namespace tessel
