#include "core/trace.h"

#include <cmath>
#include <map>
#include <memory>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/json.h"

namespace tessel::trace {
namespace {

thread_local int thread_device = -1;

uint64_t ThreadId() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t id = next.fetch_add(1, std::memory_order_relaxed);
  return id;
}

// Microseconds (trace-event JSON's unit) with nanosecond digits.
std::string Micros(int64_t ns) { return absl::StrFormat("%.3f", double(ns) / 1e3); }

}  // namespace

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

namespace {

// Interned strings, for the life of the process (only traces add to it);
// bounded: past the bound every new string is one placeholder.
class Names {
 public:
  Names() { strings_.emplace_back(); }
  Name Intern(absl::string_view s) {
    if (s.empty()) return 0;
    absl::MutexLock l(&mu_);
    if (auto it = ids_.find(s); it != ids_.end()) return it->second;
    if (bytes_ > kMaxBytes) return Overflow();
    bytes_ += s.size();
    strings_.emplace_back(std::make_unique<std::string>(s));
    const Name id = Name(strings_.size() - 1);
    ids_.emplace(*strings_.back(), id);
    return id;
  }
  std::string Get(Name id) {
    absl::MutexLock l(&mu_);
    return id < strings_.size() && strings_[id] ? *strings_[id] : std::string();
  }

 private:
  static constexpr size_t kMaxBytes = size_t{64} << 20;
  Name Overflow() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    static constexpr absl::string_view kFull = "(the trace's table of names is full)";
    if (auto it = ids_.find(kFull); it != ids_.end()) return it->second;
    strings_.emplace_back(std::make_unique<std::string>(kFull));
    ids_.emplace(*strings_.back(), Name(strings_.size() - 1));
    return Name(strings_.size() - 1);
  }
  absl::Mutex mu_;
  std::vector<std::unique_ptr<std::string>> strings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<absl::string_view, Name> ids_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

Names& TheNames() {
  static Names* n = new Names();  // never destroyed: threads may record at exit
  return *n;
}

}  // namespace

Name Intern(absl::string_view s) { return TheNames().Intern(s); }

Recorder& Recorder::Get() {
  static Recorder* r = new Recorder();  // never destroyed: threads may record at exit
  return *r;
}

void Recorder::Start(int64_t capacity, absl::Time until) {
  absl::MutexLock l(&mu_);
  ring_.assign(size_t(std::max<int64_t>(1, capacity)), Event());
  head_ = size_ = 0;
  dropped_ = 0;
  until_ns_ = until == absl::InfiniteFuture() ? INT64_MAX : absl::ToUnixNanos(until);
  internal::enabled.store(true, std::memory_order_relaxed);
}

void Recorder::Stop(v1::TraceEvents* out) {
  std::vector<Event> events;
  {
    absl::MutexLock l(&mu_);
    internal::enabled.store(false, std::memory_order_relaxed);
    until_ns_ = INT64_MAX;
    events.reserve(size_);
    for (size_t i = 0; i < size_; ++i) events.push_back(ring_[(head_ + i) % ring_.size()]);
    ring_.clear();
    ring_.shrink_to_fit();
    head_ = size_ = 0;
    out->Clear();
    out->set_dropped(dropped_);
    dropped_ = 0;
    out->set_clock_offset_ns(offset_error_ns_ < 0 ? 0 : offset_ns_);
    out->set_clock_error_ns(offset_error_ns_);
  }
  Names& names = TheNames();
  for (const Event& e : events) {
    v1::TraceEvent* t = out->add_events();
    t->set_kind(e.kind);
    t->set_category(e.category);
    std::string name = e.name;
    if (e.detail != 0) absl::StrAppend(&name, name.empty() ? "" : " ", names.Get(e.detail));
    t->set_name(std::move(name));
    t->set_device(e.track == nullptr ? e.device : -1);
    if (e.track != nullptr) t->set_track(e.track);
    t->set_thread(e.thread);
    t->set_start_ns(e.start_ns);
    t->set_duration_ns(e.duration_ns);
    t->set_value(e.value);
    auto& args = *t->mutable_args();
    for (int k = 0; k < e.num_args; ++k) args[e.arg_keys[k]] = absl::StrCat(e.arg_values[k]);
    for (int k = 0; k < e.num_texts; ++k) args[e.text_keys[k]] = names.Get(e.text_values[k]);
  }
}

void Recorder::Record(const Event& event) {
  absl::MutexLock l(&mu_);
  if (!internal::enabled.load(std::memory_order_relaxed)) return;
  if (event.start_ns >= until_ns_) {
    // The duration ran out: events from then on are not kept.
    internal::enabled.store(false, std::memory_order_relaxed);
    return;
  }
  if (size_ == ring_.size()) {
    ring_[head_] = event;
    head_ = (head_ + 1) % ring_.size();
    ++dropped_;
    return;
  }
  ring_[(head_ + size_) % ring_.size()] = event;
  ++size_;
}

void Recorder::SetClockOffset(int64_t offset_ns, int64_t error_ns) {
  absl::MutexLock l(&mu_);
  offset_ns_ = offset_ns;
  offset_error_ns_ = error_ns;
}

void SetThreadDevice(int local_device) { thread_device = local_device; }

void Span::Begin(const char* category, const char* name, const char* track) {
  Event& e = e_.emplace();
  e.category = category;
  e.name = name;
  e.device = thread_device;
  e.track = track != nullptr || thread_device >= 0 ? track : "host";
  e.thread = ThreadId();
  e.start_ns = NowNs();
}

void Span::End() {
  e_->duration_ns = std::max<int64_t>(0, NowNs() - e_->start_ns);
  Recorder::Get().Record(*e_);
}

void Span::Arg(const char* key, int64_t value) {
  if (!e_ || e_->num_args == Event::kMaxArgs) return;
  e_->arg_keys[e_->num_args] = key;
  e_->arg_values[e_->num_args++] = value;
}

void Span::Text(const char* key, absl::string_view value) {
  if (!e_ || e_->num_texts == Event::kMaxTexts) return;
  e_->text_keys[e_->num_texts] = key;
  e_->text_values[e_->num_texts++] = Intern(value);
}

// A counter's value in JSON: exact for whole numbers (byte counts beyond
// six digits, which %g would round), 17 digits otherwise; 0 for NaN or inf.
static std::string CounterValue(double v) {
  if (!std::isfinite(v)) return "0";
  if (v == std::floor(v) && std::fabs(v) < 9.0e15) return absl::StrCat(static_cast<int64_t>(v));
  return absl::StrFormat("%.17g", v);
}

void Instant(const char* category, const char* name, int local_device,
             std::initializer_list<std::pair<const char*, int64_t>> args) {
  if (!Enabled()) return;
  Event e;
  e.kind = v1::TraceEvent::INSTANT;
  e.category = category;
  e.name = name;
  e.device = local_device;
  e.thread = ThreadId();
  e.start_ns = NowNs();
  for (const auto& [key, value] : args) {
    if (e.num_args == Event::kMaxArgs) break;
    e.arg_keys[e.num_args] = key;
    e.arg_values[e.num_args++] = value;
  }
  Recorder::Get().Record(e);
}

void Counter(const char* name, int local_device, double value) {
  if (!Enabled()) return;
  Event e;
  e.kind = v1::TraceEvent::COUNTER;
  e.category = "memory";
  e.name = name;
  e.device = local_device;
  e.thread = ThreadId();
  e.start_ns = NowNs();
  e.value = value;
  Recorder::Get().Record(e);
}

std::string WriteChromeTrace(const std::vector<ProcessEvents>& processes) {
  // The origin: the earliest event, on the coordinator's clock.
  int64_t origin = INT64_MAX;
  for (const ProcessEvents& p : processes) {
    for (const v1::TraceEvent& e : p.events.events()) {
      origin = std::min(origin, e.start_ns() + p.events.clock_offset_ns());
    }
  }
  if (origin == INT64_MAX) origin = NowNs();
  std::string out = "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"origin_unix_ns\":";
  absl::StrAppend(&out, origin, ",\"processes\":[");
  for (size_t i = 0; i < processes.size(); ++i) {
    const ProcessEvents& p = processes[i];
    if (i > 0) out += ",";
    out += "{\"name\":";
    AppendJsonString(out, p.name);
    absl::StrAppend(&out, ",\"pid\":", i + 1, ",\"events\":", p.events.events_size(),
                    ",\"dropped\":", p.events.dropped(),
                    ",\"clock_offset_ns\":", p.events.clock_offset_ns(),
                    ",\"clock_error_ns\":", p.events.clock_error_ns(), "}");
  }
  out += "]},\"traceEvents\":[\n";
  bool first = true;
  auto begin_event = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  for (size_t i = 0; i < processes.size(); ++i) {
    const ProcessEvents& p = processes[i];
    const int pid = int(i) + 1;
    begin_event();
    absl::StrAppend(&out, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":", pid,
                    ",\"args\":{\"name\":");
    AppendJsonString(out, p.name);
    out += "}}";
    // Tracks: a device's by its cluster-wide id (tid = 1 + id); a named
    // track per (name, thread) after them, so a track's spans nest.
    std::map<int, int> device_tid;
    std::map<std::pair<std::string, uint64_t>, int> named_tid;
    std::map<std::string, int> named_count;
    int next_named = 100000;
    auto tid_of = [&](const v1::TraceEvent& e) {
      if (e.device() >= 0) {
        const int global = e.device() < int(p.global_device.size()) ? p.global_device[e.device()]
                                                                    : 10000 + e.device();
        auto [it, fresh] = device_tid.emplace(global, 1 + global);
        if (fresh) {
          begin_event();
          absl::StrAppend(&out, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":", pid,
                          ",\"tid\":", it->second, ",\"args\":{\"name\":\"device ", global, "\"}}");
          begin_event();
          absl::StrAppend(&out, "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":", pid,
                          ",\"tid\":", it->second, ",\"args\":{\"sort_index\":", global, "}}");
        }
        return it->second;
      }
      auto [it, fresh] = named_tid.emplace(std::make_pair(e.track(), e.thread()), next_named);
      if (fresh) {
        ++next_named;
        const int k = named_count[e.track()]++;
        begin_event();
        absl::StrAppend(&out, "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":", pid,
                        ",\"tid\":", it->second, ",\"args\":{\"name\":");
        AppendJsonString(out, k == 0 ? e.track() : absl::StrCat(e.track(), " #", k + 1));
        out += "}}";
      }
      return it->second;
    };
    for (const v1::TraceEvent& e : p.events.events()) {
      const int tid = tid_of(e);
      const int64_t ts = e.start_ns() + p.events.clock_offset_ns() - origin;
      begin_event();
      out += "{\"name\":";
      AppendJsonString(out, e.name());
      out += ",\"cat\":";
      AppendJsonString(out, e.category());
      absl::StrAppend(&out, ",\"pid\":", pid, ",\"tid\":", tid, ",\"ts\":", Micros(ts));
      switch (e.kind()) {
        case v1::TraceEvent::COUNTER:
          // A counter's track is named by the event's name (per process);
          // one per device.
          absl::StrAppend(&out, ",\"ph\":\"C\",\"args\":{\"",
                          e.device() >= 0 ? absl::StrCat("device ", tid - 1) : e.track(),
                          "\":", CounterValue(e.value()), "}}");
          continue;
        case v1::TraceEvent::INSTANT: out += ",\"ph\":\"i\",\"s\":\"t\""; break;
        default: absl::StrAppend(&out, ",\"ph\":\"X\",\"dur\":", Micros(e.duration_ns()));
      }
      out += ",\"args\":{";
      // Sorted keys: the same trace writes the same bytes.
      std::map<std::string, std::string> args(e.args().begin(), e.args().end());
      bool first_arg = true;
      for (const auto& [k, v] : args) {
        if (!first_arg) out += ",";
        first_arg = false;
        AppendJsonString(out, k);
        out += ":";
        AppendJsonString(out, v);
      }
      out += "}}";
    }
  }
  out += "\n]}\n";
  return out;
}

}  // namespace tessel::trace
