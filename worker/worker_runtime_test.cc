// The worker runtime's step reports on a device whose work finishes after
// Run returns (a GPU stream): a step is reported only once its work has,
// the device's next steps are queued meanwhile, reports leave in step order,
// and work that fails after Run returned fails its own step and outputs.
// And transfers between two host devices of one worker: a reader of the
// target runs on its bytes however late the sender comes, and a failed send
// fails the receiver and every reader of the target.
#include "worker/worker_runtime.h"

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <deque>

#include "absl/synchronization/notification.h"
#include "spdlog/sinks/null_sink.h"
#include "worker/collectives.h"
#include "worker/cpu/cpu_device.h"
#include "worker/transfer.h"

namespace tessel::worker {
namespace {

// A CPU device whose steps "finish" when the test opens their gate.
class GatedDevice final : public Device {
 public:
  std::string kind() const override { return "gated"; }
  int local_index() const override { return 0; }
  absl::StatusOr<BufferPtr> Allocate(int64_t bytes) override { return cpu_.Allocate(bytes); }
  absl::Status CopyFromHost(Buffer& dst, int64_t offset, const void* src, int64_t n) override {
    return cpu_.CopyFromHost(dst, offset, src, n);
  }
  absl::Status CopyToHost(const Buffer& src, int64_t offset, void* dst, int64_t n) override {
    return cpu_.CopyToHost(src, offset, dst, n);
  }
  absl::Status CopyWithin(const Buffer& src, int64_t so, Buffer& dst, int64_t d,
                          int64_t n) override {
    return cpu_.CopyWithin(src, so, dst, d, n);
  }
  absl::StatusOr<std::unique_ptr<Executable>> Load(const v1::Program& p) override {
    return cpu_.Load(p);
  }
  MemoryStats memory_stats() const override { return cpu_.memory_stats(); }
  bool asynchronous() const override { return true; }
  std::function<absl::Status()> Fence() override {
    auto gate = std::make_shared<Gate>();
    absl::MutexLock l(&mu_);
    gates_.push_back(gate);
    return [gate] {
      gate->open.WaitForNotification();
      return gate->status;
    };
  }

  // Waits until `n` fences were asked for (n steps ran their Run).
  bool AwaitFences(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gates_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
  void Open(size_t i, absl::Status s) {
    std::shared_ptr<Gate> g;
    {
      absl::MutexLock l(&mu_);
      g = gates_.at(i);
    }
    g->status = std::move(s);
    g->open.Notify();
  }

 private:
  struct Gate {
    absl::Notification open;
    absl::Status status;
  };
  cpu::CpuDevice cpu_{cpu::CpuDevice::Options{}};
  absl::Mutex mu_;
  std::deque<std::shared_ptr<Gate>> gates_ ABSL_GUARDED_BY(mu_);
};

constexpr char kProgram[] = R"pb(
  executable_id: "twos"
  instructions { node { name: "c" op: CONSTANT type { dtype: F32 dims: 4 } constant { fill { f: 2 } } } }
  outputs: "c"
  output_types { dtype: F32 dims: 4 }
)pb";

constexpr char kDouble[] = R"pb(
  executable_id: "double"
  parameters { name: "x" op: PARAMETER type { dtype: F32 dims: 4 } }
  instructions { node { name: "y" op: ADD operands: "x" operands: "x" type { dtype: F32 dims: 4 } } }
  outputs: "y"
  output_types { dtype: F32 dims: 4 }
)pb";

struct Report {
  absl::Notification done;
  absl::StatusOr<v1::RunResponse> result;
};

// A runtime over `devices` (and `collectives`, when given) with "twos" and
// "double" loaded.
std::unique_ptr<WorkerRuntime> NewRuntime(
    std::vector<std::unique_ptr<Device>> devices,
    std::shared_ptr<CommunicatorRegistry> collectives = nullptr) {
  WorkerRuntime::Options options;
  options.devices = std::move(devices);
  options.collectives = std::move(collectives);
  options.logger =
      std::make_shared<spdlog::logger>("test", std::make_shared<spdlog::sinks::null_sink_mt>());
  auto runtime = WorkerRuntime::Create(std::move(options));
  EXPECT_TRUE(runtime.ok()) << runtime.status();
  if (!runtime.ok()) return nullptr;
  for (const char* text : {kProgram, kDouble}) {
    v1::Program p;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &p));
    EXPECT_TRUE((*runtime)->LoadProgram(p).ok());
  }
  return std::move(*runtime);
}

std::unique_ptr<WorkerRuntime> NewRuntime(std::unique_ptr<Device> device) {
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(std::move(device));
  return NewRuntime(std::move(devices));
}

// The header of a put of f32[4] `handle` onto device 0.
v1::PutShardRequest::Header PutF32x4(uint64_t handle) {
  v1::PutShardRequest::Header h;
  h.set_buffer(handle);
  h.mutable_type()->set_dtype(v1::F32);
  h.mutable_type()->add_dims(4);
  h.add_devices(0);
  return h;
}

void RunInto(WorkerRuntime& runtime, const v1::RunRequest& r, Report* rep) {
  runtime.Run(r, [rep](absl::StatusOr<v1::RunResponse> result) {
    rep->result = std::move(result);
    rep->done.Notify();
  });
}

TEST(WorkerRuntime, AStepOnAnAsynchronousDeviceIsReportedOnceItsWorkHasFinished) {
  auto device = std::make_unique<GatedDevice>();
  GatedDevice* gated = device.get();
  auto runtime = NewRuntime(std::move(device));
  ASSERT_NE(runtime, nullptr);

  Report reports[2];
  for (int i = 0; i < 2; ++i) {
    v1::RunRequest r;
    r.set_executable_id("twos");
    r.set_seq(i);
    r.set_execution_id(100 + i);
    r.add_outputs(i + 1);
    RunInto(*runtime, r, &reports[i]);
  }
  // Both steps ran their Run (the second did not wait for the first's work)...
  ASSERT_TRUE(gated->AwaitFences(2));
  // ...and neither is reported while its work is running; the second's
  // finishing first does not report it ahead of the first.
  gated->Open(1, absl::OkStatus());
  EXPECT_FALSE(reports[0].done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  EXPECT_FALSE(reports[1].done.HasBeenNotified());
  // The first step's work fails after its Run returned: the step fails, and
  // so do its outputs; the second is reported as it finished.
  gated->Open(0, absl::InternalError("an illegal memory access was encountered"));
  ASSERT_TRUE(reports[0].done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(reports[1].done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_FALSE(reports[0].result.ok());
  EXPECT_EQ(reports[0].result.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(reports[0].result.status().message().find(
                "execution 100: its kernels failed: an illegal memory"),
            std::string::npos)
      << reports[0].result.status();
  EXPECT_TRUE(reports[1].result.ok()) << reports[1].result.status();
  auto first = runtime->GetForFetch(0, 1);
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.status().message().find("illegal memory access"), std::string::npos)
      << first.status();
  auto second = runtime->GetForFetch(0, 2);
  ASSERT_TRUE(second.ok()) << second.status();
  float host[4];
  ASSERT_TRUE(gated->CopyToHost(*second->buffer, 0, host, sizeof(host)).ok());
  for (float v : host) EXPECT_EQ(v, 2.0f);
}

// A step queued before the verdict on the step whose output it reads ran
// on what that step left: when that step's work fails, the reader fails
// too, naming the cause, though its own work finished; so does a fetch of
// either's output. Never READY over a failed input.
TEST(WorkerRuntime, AStepThatReadAFailedStepsOutputFailsThoughItsOwnWorkFinished) {
  auto device = std::make_unique<GatedDevice>();
  GatedDevice* gated = device.get();
  auto runtime = NewRuntime(std::move(device));
  ASSERT_NE(runtime, nullptr);
  Report reports[2];
  for (int i = 0; i < 2; ++i) {
    v1::RunRequest r;
    r.set_executable_id(i == 0 ? "twos" : "double");
    r.set_seq(i);
    r.set_execution_id(200 + i);
    if (i == 1) r.add_arguments(1);
    r.add_outputs(i + 1);
    RunInto(*runtime, r, &reports[i]);
  }
  ASSERT_TRUE(
      gated->AwaitFences(2));  // the reader's Run read the output before its producer's verdict
  gated->Open(1, absl::OkStatus());
  gated->Open(0, absl::InternalError("NCCL all_reduce aborted: a peer stalled"));
  ASSERT_TRUE(reports[0].done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(reports[1].done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_FALSE(reports[0].result.ok());
  ASSERT_FALSE(reports[1].result.ok());
  EXPECT_NE(reports[1].result.status().message().find("a peer stalled"), std::string::npos)
      << reports[1].result.status();
  EXPECT_NE(reports[1].result.status().message().find("execution 201"), std::string::npos)
      << reports[1].result.status();
  for (uint64_t h : {1, 2}) {
    auto a = runtime->GetForFetch(0, h);
    ASSERT_FALSE(a.ok()) << h;
    EXPECT_NE(a.status().message().find("a peer stalled"), std::string::npos) << a.status();
  }
}

// ---- Transfers ---------------------------------------------------------------

// Two host devices of one worker (their ranks meet in memory), with the
// programs above loaded and x = [1, 2, 3, 4] put as array 1 on device 0.
std::unique_ptr<WorkerRuntime> TwoHostDevices() {
  std::vector<std::unique_ptr<Device>> devices;
  for (int i = 0; i < 2; ++i) {
    devices.push_back(std::make_unique<cpu::CpuDevice>(cpu::CpuDevice::Options{.local_index = i}));
  }
  CollectivesOptions c;
  c.self = "w0";
  c.timeout = absl::Seconds(20);
  auto registry = NewCommunicatorRegistry(c);
  EXPECT_TRUE(registry.ok()) << registry.status();
  if (!registry.ok()) return nullptr;
  auto runtime = NewRuntime(std::move(devices), std::move(*registry));
  if (runtime == nullptr) return nullptr;
  const v1::PutShardRequest::Header h = PutF32x4(1);
  auto put = runtime->BeginPut(h);
  EXPECT_TRUE(put.ok()) << put.status();
  if (!put.ok()) return nullptr;
  const float x[4] = {1, 2, 3, 4};
  EXPECT_TRUE((*put)->Write(std::string(reinterpret_cast<const char*>(x), sizeof(x))).ok());
  EXPECT_TRUE((*put)->Finish().ok());
  return runtime;
}

// Device `device`'s part of moving f32[4] from device 0 (array `source`)
// to device 1 (array `target`) in one round.
v1::RunRequest TransferPart(int device, int64_t execution, uint64_t source, uint64_t target) {
  v1::RunRequest r;
  r.set_device(device);
  r.set_seq(0);
  r.set_execution_id(execution);
  r.set_collective_epoch("t.0");
  v1::Transfer* t = r.mutable_transfer();
  for (int d = 0; d < 2; ++d) {
    t->add_rank_workers("w0");
    t->add_rank_devices(d);
  }
  t->set_rank(device);
  for (v1::TensorType* b : {t->mutable_source_block(), t->mutable_target_block()}) {
    b->set_dtype(v1::F32);
    b->add_dims(4);
  }
  t->set_rounds(1);
  v1::TransferPiece* p = t->add_pieces();
  p->set_round(0);
  p->set_source(0);
  p->set_target(1);
  for (v1::Region* g : {p->mutable_from(), p->mutable_to()}) {
    g->add_starts(0);
    g->add_sizes(4);
  }
  if (device == 0) r.add_arguments(source);
  if (device == 1) r.add_outputs(target);
  return r;
}

// TransferPart of a one-way transfer (Transfer.one_way): device 0 only
// sends, device 1 only receives.
v1::RunRequest OneWayPart(int device, int64_t execution, uint64_t source, uint64_t target) {
  v1::RunRequest r = TransferPart(device, execution, source, target);
  r.mutable_transfer()->set_one_way(true);
  return r;
}

v1::RunRequest Double(int device, uint64_t seq, int64_t execution, uint64_t in, uint64_t out) {
  v1::RunRequest r;
  r.set_executable_id("double");
  r.set_device(device);
  r.set_seq(seq);
  r.set_execution_id(execution);
  r.add_arguments(in);
  r.add_outputs(out);
  return r;
}

std::vector<float> Read(WorkerRuntime& runtime, int device, uint64_t handle) {
  auto a = runtime.GetForFetch(device, handle);
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return {};
  std::vector<float> v(a->buffer->size() / sizeof(float));
  EXPECT_TRUE(runtime.device(device).CopyToHost(*a->buffer, 0, v.data(), a->buffer->size()).ok());
  return v;
}

// Queues device 1's part of execution `execution` (target: array 3), then
// a step that doubles the target into array 4.
void ReceiveAndRead(WorkerRuntime& runtime, int64_t execution, Report* receive, Report* reader) {
  RunInto(runtime, TransferPart(1, execution, 0, 3), receive);
  RunInto(runtime, Double(1, 1, execution + 1, 3, 4), reader);
}

// A step queued behind a receive reads the target only once its bytes are
// in, however late the sender comes.
TEST(WorkerRuntime, AStepThatReadsATransfersTargetWaitsForItsBytes) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  Report receive, reader, send;
  ReceiveAndRead(*runtime, 310, &receive, &reader);
  absl::SleepFor(absl::Milliseconds(50));  // ample time to read a target whose bytes have not come
  EXPECT_FALSE(reader.done.HasBeenNotified()) << "the reader ran before the sender sent";
  RunInto(*runtime, TransferPart(0, 310, 1, 0), &send);
  for (Report* r : {&send, &receive, &reader}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(r->result.ok()) << r->result.status();
  }
  EXPECT_EQ(Read(*runtime, 1, 4), (std::vector<float>{2, 4, 6, 8}));
}

// A send that fails (its source is gone) fails the receive, the step that
// reads the target and a fetch of it, each naming the cause; never a target
// of whatever the buffer held.
TEST(WorkerRuntime, AFailedSendFailsTheReceiverAndEveryReaderOfTheTarget) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  Report receive, reader, send;
  ReceiveAndRead(*runtime, 320, &receive, &reader);
  RunInto(*runtime, TransferPart(0, 320, 0x77, 0), &send);  // array 0x77 was never put
  for (Report* r : {&send, &receive, &reader}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_FALSE(r->result.ok());
    EXPECT_NE(r->result.status().message().find("0x77"), std::string::npos) << r->result.status();
  }
  EXPECT_NE(reader.result.status().message().find("argument 0"), std::string::npos)
      << reader.result.status();
  for (uint64_t h : {3, 4}) {
    auto a = runtime->GetForFetch(1, h);
    ASSERT_FALSE(a.ok()) << h;
    EXPECT_NE(a.status().message().find("0x77"), std::string::npos) << a.status();
  }
}

// One-way (Transfer.one_way): the sender's step is done when its send is
// queued on its lane, so the device's next steps run, and a free of the
// source does not touch the bytes in flight; the receiver, queued later,
// gets them.
TEST(WorkerRuntime, AOneWaySendIsDoneBeforeItsReceiverComesAndKeepsItsBytes) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  v1::RunRequest send = OneWayPart(0, 330, 1, 0), receive = OneWayPart(1, 330, 0, 3);
  ASSERT_TRUE(IsDetachedSend(send));
  ASSERT_FALSE(IsDetachedSend(receive));
  Report sent, after;
  RunInto(*runtime, send, &sent);
  RunInto(*runtime, Double(0, 1, 331, 1, 5), &after);
  for (Report* r : {&sent, &after}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)))
        << "the device waited for the receiver";
    ASSERT_TRUE(r->result.ok()) << r->result.status();
  }
  absl::Notification freed;
  v1::FreeRequest free;
  free.set_device(0);
  free.set_seq(2);
  free.add_buffers(1);
  runtime->Free(free, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    freed.Notify();
  });
  ASSERT_TRUE(freed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_FALSE(runtime->GetForFetch(0, 1).ok()) << "the source is still held by its handle";
  Report received, reader;
  RunInto(*runtime, receive, &received);
  RunInto(*runtime, Double(1, 1, 332, 3, 4), &reader);
  for (Report* r : {&received, &reader}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(r->result.ok()) << r->result.status();
  }
  EXPECT_EQ(Read(*runtime, 1, 4), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(Read(*runtime, 0, 5), (std::vector<float>{2, 4, 6, 8}));
}

// A one-way sender whose source is gone fails its step, and its receiver
// learns at once (through the lane), naming the cause.
TEST(WorkerRuntime, AOneWaySendThatFailsFailsItsReceiverPromptly) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  v1::RunRequest send = OneWayPart(0, 340, 0x77, 0), receive = OneWayPart(1, 340, 0, 3);
  Report sent, received;
  RunInto(*runtime, send, &sent);
  RunInto(*runtime, receive, &received);
  for (Report* r : {&sent, &received}) {
    // Well inside the group's 20 s timeout: the receiver was told, not left waiting.
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_FALSE(r->result.ok());
    EXPECT_NE(r->result.status().message().find("0x77"), std::string::npos) << r->result.status();
  }
}

// A sender's one-way sends leave in step order, each met by its own receive.
TEST(WorkerRuntime, OneWaySendsOfOneRankMeetTheirReceivesInOrder) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  Report doubled;
  RunInto(*runtime, Double(0, 0, 350, 1, 2), &doubled);  // array 2 = [2, 4, 6, 8]
  Report sends[2], receives[2];
  for (int i = 0; i < 2; ++i) {
    v1::RunRequest send = OneWayPart(0, 351 + i, 1 + i, 0);
    send.set_seq(1 + i);
    RunInto(*runtime, send, &sends[i]);
  }
  for (int i = 0; i < 2; ++i) {
    v1::RunRequest receive = OneWayPart(1, 351 + i, 0, 10 + i);
    receive.set_seq(i);
    RunInto(*runtime, receive, &receives[i]);
  }
  for (Report* r : {&doubled, &sends[0], &sends[1], &receives[0], &receives[1]}) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(r->result.ok()) << r->result.status();
  }
  EXPECT_EQ(Read(*runtime, 1, 10), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(Read(*runtime, 1, 11), (std::vector<float>{2, 4, 6, 8}));
}

// A group that broke moves to a new epoch: the rank's lane of the old one
// gets no more sends, and goes once idle, so lanes do not pile up.
TEST(WorkerRuntime, ASendLaneOfAnEarlierEpochGoesOnceIdle) {
  auto runtime = TwoHostDevices();
  ASSERT_NE(runtime, nullptr);
  auto run_epoch = [&](int epoch) {
    v1::RunRequest send = OneWayPart(0, 360 + epoch, 1, 0),
                   receive = OneWayPart(1, 360 + epoch, 0, 20 + epoch);
    for (v1::RunRequest* r : {&send, &receive}) {
      r->set_seq(epoch);
      r->set_collective_epoch("t." + std::to_string(epoch));
    }
    Report sent, received;
    RunInto(*runtime, send, &sent);
    RunInto(*runtime, receive, &received);
    for (Report* r : {&sent, &received}) {
      ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
      ASSERT_TRUE(r->result.ok()) << r->result.status();
    }
    EXPECT_EQ(Read(*runtime, 1, 20 + epoch), (std::vector<float>{1, 2, 3, 4})) << "epoch " << epoch;
  };
  constexpr int kEpochs = 6;
  for (int epoch = 0; epoch < kEpochs; ++epoch) run_epoch(epoch);
  // A retired lane whose sender is still returning (its step reported, its
  // thread not yet back: on a loaded machine, for several epochs) is kept
  // until the next epoch's lane finds it idle. So the lanes do not grow
  // with the epochs: once the old ones are idle, the next epoch leaves its
  // own lane and at most the one it retired (kEpochs + 1 without retiring).
  int lanes = runtime->num_send_lanes();
  for (int epoch = kEpochs; epoch < kEpochs + 200 && lanes > 2; ++epoch) {
    absl::SleepFor(absl::Milliseconds(10));
    run_epoch(epoch);
    lanes = runtime->num_send_lanes();
  }
  EXPECT_LE(lanes, 2);
}

// A put still being written when the coordinator frees its array (the
// client gave up on it, and its ticket is still good) is refused when it
// finishes, naming why, and leaves no buffer behind that nothing would free.
TEST(WorkerRuntime, APutFinishedAfterItsArrayWasFreedLeavesNothingBehind) {
  auto runtime = NewRuntime(std::make_unique<cpu::CpuDevice>(cpu::CpuDevice::Options{}));
  ASSERT_NE(runtime, nullptr);
  const int64_t before = runtime->device(0).memory_stats().num_buffers;
  const v1::PutShardRequest::Header h = PutF32x4(0xabad0ff);
  auto put = runtime->BeginPut(h);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(runtime->device(0).memory_stats().num_buffers,
            before + 1);  // the put's buffer, counted
  const float x[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*put)->Write(std::string(reinterpret_cast<const char*>(x), sizeof(x))).ok());
  v1::FreeRequest free;
  free.set_device(0);
  free.set_seq(0);
  free.add_buffers(h.buffer());
  absl::Notification freed;
  runtime->Free(free, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    freed.Notify();
  });
  ASSERT_TRUE(freed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const absl::Status finished = (*put)->Finish();
  EXPECT_EQ(finished.code(), absl::StatusCode::kFailedPrecondition) << finished;
  EXPECT_NE(finished.message().find("was freed before it was written"), absl::string_view::npos)
      << finished;
  put->reset();
  EXPECT_EQ(runtime->GetForFetch(0, h.buffer()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(runtime->device(0).memory_stats().num_buffers, before);
}

// Frees `request` (device 0) and waits for it to run.
void FreeAndWait(WorkerRuntime& runtime, v1::FreeRequest request) {
  absl::Notification freed;
  runtime.Free(request, [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    freed.Notify();
  });
  ASSERT_TRUE(freed.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

// A client's write by ticket lands only under a write the coordinator
// opened: not without one, not twice, not after the buffer was freed, not
// once expired.
TEST(WorkerRuntime, AClientsWriteNeedsAnOpenWriteAndClosesIt) {
  auto runtime = NewRuntime(std::make_unique<cpu::CpuDevice>(cpu::CpuDevice::Options{}));
  ASSERT_NE(runtime, nullptr);
  const int64_t before = runtime->device(0).memory_stats().num_buffers;
  const std::string data(16, '\0');
  EXPECT_EQ(runtime->BeginPut(PutF32x4(0x1), /*granted=*/true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  v1::OpenWritesRequest open;
  open.set_buffer(0x1);
  open.add_devices(0);
  open.set_expiry_unix_ms(absl::ToUnixMillis(absl::Now() + absl::Minutes(1)));
  ASSERT_TRUE(runtime->OpenWrites(open).ok());
  auto put = runtime->BeginPut(PutF32x4(0x1), true);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(runtime->BeginPut(PutF32x4(0x1), true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*put)->Write(data).ok());
  ASSERT_TRUE((*put)->Finish().ok());
  EXPECT_TRUE(runtime->GetForFetch(0, 0x1).ok());
  EXPECT_EQ(runtime->BeginPut(PutF32x4(0x1), true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Freed while it was written: nothing stays.
  open.set_buffer(0x2);
  ASSERT_TRUE(runtime->OpenWrites(open).ok());
  auto late = runtime->BeginPut(PutF32x4(0x2), true);
  ASSERT_TRUE(late.ok()) << late.status();
  ASSERT_TRUE((*late)->Write(data).ok());
  v1::FreeRequest free;
  free.set_device(0);
  free.set_seq(0);
  free.add_buffers(0x2);
  FreeAndWait(*runtime, free);
  EXPECT_EQ((*late)->Finish().code(), absl::StatusCode::kFailedPrecondition);
  late->reset();
  // Expired: refused.
  open.set_buffer(0x3);
  open.set_expiry_unix_ms(absl::ToUnixMillis(absl::Now() - absl::Seconds(1)));
  ASSERT_TRUE(runtime->OpenWrites(open).ok());
  EXPECT_EQ(runtime->BeginPut(PutF32x4(0x3), true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(runtime->device(0).memory_stats().num_buffers, before + 1);  // 0x1 alone
}

// A program dropped by a free's unload gives its memory back; an unload of
// an earlier load leaves a later one in place; a step after the drop is
// refused until the program is loaded again.
TEST(WorkerRuntime, AnUnloadDropsAProgramUnlessLoadedAgainSince) {
  auto runtime = NewRuntime(std::make_unique<cpu::CpuDevice>(cpu::CpuDevice::Options{}));
  ASSERT_NE(runtime, nullptr);
  ASSERT_EQ(runtime->num_programs(), 2);
  v1::Program twos;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kProgram, &twos));
  ASSERT_TRUE(runtime->LoadProgram(twos, 2).ok());
  v1::FreeRequest free;
  free.set_device(0);
  free.set_seq(0);
  v1::ProgramUnload* u = free.add_unload();
  u->set_executable_id("twos");
  u->set_generation(1);  // an older load's: ignored
  FreeAndWait(*runtime, free);
  EXPECT_EQ(runtime->num_programs(), 2);
  free.set_seq(1);
  u->set_generation(2);
  FreeAndWait(*runtime, free);
  EXPECT_EQ(runtime->num_programs(), 1);
  v1::RunRequest r;
  r.set_executable_id("twos");
  r.set_device(0);
  r.set_seq(2);
  r.add_outputs(0x10);
  Report rep;
  RunInto(*runtime, r, &rep);
  ASSERT_TRUE(rep.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(rep.result.status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(runtime->LoadProgram(twos, 3).ok());
  r.set_seq(3);
  r.set_outputs(0, 0x11);
  Report again;
  RunInto(*runtime, r, &again);
  ASSERT_TRUE(again.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(again.result.ok()) << again.result.status();
}

}  // namespace
}  // namespace tessel::worker
