#include "core/logging.h"

#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/process_tuning.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace tessel {
namespace {

void AppendEscaped(spdlog::memory_buf_t& out, spdlog::string_view_t s) {
  for (char c : s) {
    switch (c) {
      case '"': out.append(std::string_view("\\\"")); break;
      case '\\': out.append(std::string_view("\\\\")); break;
      case '\n': out.append(std::string_view("\\n")); break;
      case '\r': out.append(std::string_view("\\r")); break;
      case '\t': out.append(std::string_view("\\t")); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          const std::string u = absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
          out.append(std::string_view(u));
        } else {
          out.push_back(c);
        }
    }
  }
}

// The execution a message speaks of ("execution 12 on device 0 failed"),
// or -1: a JSON line carries it as a field, so one step can be followed
// through the coordinator's and the workers' logs.
int64_t ExecutionOf(spdlog::string_view_t s) {
  constexpr std::string_view kWord = "execution ";
  const std::string_view text(s.data(), s.size());
  for (size_t at = text.find(kWord); at != std::string_view::npos; at = text.find(kWord, at + 1)) {
    if (at > 0 && (std::isalnum(static_cast<unsigned char>(text[at - 1])) || text[at - 1] == '_'))
      continue;
    size_t i = at + kWord.size();
    int64_t n = 0;
    const size_t first = i;
    while (i < text.size() && i - first < 18 && std::isdigit(static_cast<unsigned char>(text[i])))
      n = n * 10 + (text[i++] - '0');
    if (i > first) return n;
  }
  return -1;
}

class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(since_epoch - secs).count();
    const std::time_t t = secs.count();
    std::tm tm{};
    gmtime_r(&t, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
    const std::string head = absl::StrFormat("{\"time\":\"%s.%06dZ\",\"level\":\"", stamp, micros);
    dest.append(std::string_view(head));
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    dest.append(level.data(), level.data() + level.size());
    dest.append(std::string_view("\",\"logger\":\""));
    AppendEscaped(dest, msg.logger_name);
    const std::string thread = absl::StrCat("\",\"thread\":", msg.thread_id, ",\"message\":\"");
    dest.append(std::string_view(thread));
    AppendEscaped(dest, msg.payload);
    if (const int64_t execution = ExecutionOf(msg.payload); execution >= 0) {
      const std::string field = absl::StrCat("\",\"execution\":", execution, "}\n");
      dest.append(std::string_view(field));
      return;
    }
    dest.append(std::string_view("\"}\n"));
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

std::unique_ptr<spdlog::formatter> NewJsonFormatter() { return std::make_unique<JsonFormatter>(); }

absl::StatusOr<std::shared_ptr<spdlog::logger>> MakeDaemonLogger(const std::string& name,
                                                                 const std::string& level,
                                                                 const std::string& format) {
  const spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log_level: expected trace, debug, info, warn, error or off, got '", level, "'"));
  }
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format: expected text or json, got '", format, "'"));
  }
  auto log = spdlog::stdout_color_mt(name);
  log->set_level(lvl);
  if (format == "json") log->set_formatter(NewJsonFormatter());
  return log;
}

std::shared_ptr<spdlog::logger> StartDaemon(int argc, char** argv, const DaemonStart& d,
                                            int* exit_code) {
  BlockTerminationSignals();
  TuneAllocatorForStreaming();
  SkipMutexCycleDetection();
  absl::SetProgramUsageMessage(d.usage);
  SetDaemonFlagsUsage(d.main_file);
  absl::ParseCommandLine(argc, argv);
  auto made = MakeDaemonLogger(d.name, absl::GetFlag(*d.log_level), absl::GetFlag(*d.log_format));
  if (!made.ok()) {
    std::fprintf(stderr, "tessel-%s: %s\n", d.name.c_str(),
                 std::string(made.status().message()).c_str());
    *exit_code = 2;
    return nullptr;
  }
  if (const int parent = absl::GetFlag(*d.parent_pid); parent > 0 && !StopWithParent(parent)) {
    (*made)->error("--parent_pid={}: that process has already exited", parent);
    *exit_code = 1;
    return nullptr;
  }
  return *made;
}

}  // namespace tessel
