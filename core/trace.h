// The profiler's recorder: each process (coordinator, worker) keeps the
// events of a trace in a bounded buffer while tracing is on (the oldest go
// first, counted), and hands them over when it stops. Off, recording costs
// one relaxed atomic load at each point that would record.
//
// Events carry this process's clock (Unix nanoseconds). The coordinator
// aligns every worker's events to its own clock by the offset each worker
// estimates over its heartbeats (SetClockOffset), and writes the whole as
// Chrome/Perfetto trace-event JSON (WriteChromeTrace).
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "tessel/v1/trace.pb.h"

namespace tessel::trace {

// This process's clock, as events carry it.
int64_t NowNs();

// An interned string (Intern): a name or text recorded many times costs a
// table lookup, not a copy. 0 is the empty string.
using Name = uint32_t;
Name Intern(absl::string_view s);

// One event as recorded: plain values, no allocation. `name` and the keys
// are static strings; the event's name on the timeline is `name`, then
// `detail` (interned) after a space.
struct Event {
  static constexpr int kMaxArgs = 4;
  static constexpr int kMaxTexts = 5;
  int64_t start_ns = 0;
  int64_t duration_ns = 0;
  double value = 0;  // a counter's
  uint64_t thread = 0;
  const char* category = "";
  const char* name = "";
  const char* track = nullptr;  // null: the device's
  Name detail = 0;
  int32_t device = -1;
  v1::TraceEvent::Kind kind = v1::TraceEvent::SPAN;
  uint8_t num_args = 0, num_texts = 0;
  std::array<const char*, kMaxArgs> arg_keys{};
  std::array<int64_t, kMaxArgs> arg_values{};
  std::array<const char*, kMaxTexts> text_keys{};
  std::array<Name, kMaxTexts> text_values{};
};

class Recorder {
 public:
  // The process's recorder.
  static Recorder& Get();

  // Starts a trace: drops what was held, keeps at most `capacity` events.
  // Tracing stops by itself at `until` (a client that went away leaves no
  // tracing on).
  void Start(int64_t capacity, absl::Time until = absl::InfiniteFuture());
  // Stops, and writes the events held (oldest first) into `out`, with how
  // many were dropped for want of room. Stopping when off hands over what
  // the last trace left (nothing, once taken).
  void Stop(v1::TraceEvents* out);
  // Appends an event (when on; a full buffer drops its oldest).
  void Record(const Event& event);

  // The heartbeats' estimate: the coordinator's clock is this process's
  // plus `offset_ns`, within `error_ns`. A worker keeps the estimate with
  // the smallest error among its recent beats.
  void SetClockOffset(int64_t offset_ns, int64_t error_ns);

 private:
  absl::Mutex mu_;
  std::vector<Event> ring_ ABSL_GUARDED_BY(mu_);  // capacity slots, from `head_`
  size_t head_ ABSL_GUARDED_BY(mu_) = 0;
  size_t size_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t until_ns_ ABSL_GUARDED_BY(mu_) = INT64_MAX;
  int64_t offset_ns_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t offset_error_ns_ ABSL_GUARDED_BY(mu_) = -1;  // -1: no estimate (the coordinator itself)
};

// Whether this process records: one relaxed load,
// inlined where it is asked.
namespace internal {
inline constinit std::atomic<bool> enabled{false};  // Recorder's; constant-initialized
}  // namespace internal
inline bool Enabled() { return internal::enabled.load(std::memory_order_relaxed); }

// The local device whose queue runs on this thread (-1: none): spans that
// name no track land on its track.
void SetThreadDevice(int local_device);

// A span from construction to destruction, recorded if tracing was on at
// construction. `track` names a non-device track ("dispatch", "transfers");
// null means the thread's device (SetThreadDevice). Off, the calls below
// do nothing; build what they take under active().
class Span {
 public:
  Span(const char* category, const char* name, const char* track = nullptr) {
    if (Enabled()) Begin(category, name, track);
  }
  ~Span() {
    if (e_.has_value()) End();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  bool active() const { return e_.has_value(); }
  void Detail(Name detail) {
    if (e_) e_->detail = detail;
  }
  void Detail(absl::string_view detail) {
    if (e_) e_->detail = Intern(detail);
  }
  // Up to Event::kMaxArgs numbers and kMaxTexts texts; `key` is static.
  void Arg(const char* key, int64_t value);
  void Text(const char* key, absl::string_view value);

 private:
  void Begin(const char* category, const char* name, const char* track);
  void End();
  std::optional<Event> e_;  // engaged while recording
};

// A counter's value now on `local_device`'s track (when tracing is on).
void Counter(const char* name, int local_device, double value);
// An instant event now on `local_device`'s track, with up to
// Event::kMaxArgs numbers (static keys), when tracing is on.
void Instant(const char* category, const char* name, int local_device,
             std::initializer_list<std::pair<const char*, int64_t>> args);

// A trace's events from each process, as one Chrome trace-event JSON
// document on the coordinator's clock.
struct ProcessEvents {
  std::string name;                // "coordinator", "worker w-1 (127.0.0.1:5001)"
  v1::TraceEvents events;          // this process's clock
  std::vector<int> global_device;  // by local index: the device's cluster-wide id
};
std::string WriteChromeTrace(const std::vector<ProcessEvents>& processes);

}  // namespace tessel::trace
