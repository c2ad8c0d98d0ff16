// Integration tests: a real coordinator and real worker processes on
// loopback, driven through the C++ SDK, the CLI and raw gRPC.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cstring>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include <google/protobuf/descriptor.pb.h>
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "tessel/v1/session.grpc.pb.h"

namespace tessel {
namespace {

std::unique_ptr<LocalCluster> StartCluster(int workers, int devices,
                                           std::vector<std::string> worker_flags = {}) {
  LocalCluster::Options o;
  o.workers = workers;
  o.devices_per_worker = devices;
  o.worker_flags = std::move(worker_flags);
  o.heartbeat_timeout_ms = 1500;
  auto c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cluster_ = StartCluster(2, 2).release(); }
  static void TearDownTestSuite() { delete cluster_; }
  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    auto s = Session::Connect(cluster_->address());
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
  }
  static LocalCluster* cluster_;
  std::unique_ptr<Session> session_;
};
LocalCluster* ClusterTest::cluster_ = nullptr;

Graph AffineTanh(int64_t n) {
  GraphBuilder g("affine_tanh");
  Value x = g.Parameter({DType::kF32, {n}}, "x");
  Value w = g.Parameter({DType::kF32, {n}}, "w");
  Value y = g.Tanh(g.Add(g.Mul(x, w), g.Broadcast(g.Scalar(DType::kF32, 0.25), {n})));
  Value s = g.Reduce(y, ReduceKind::kSum, {0});
  return *g.Build({y, s});
}

TEST(Connect, ARefusedPortFailsAtOnceNamingTheAddress) {
  // A port nobody listens on: bound, then closed.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  const auto t0 = std::chrono::steady_clock::now();
  auto s = Session::Connect(address, {.connect_timeout_ms = 10000});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find("no coordinator at " + address), std::string::npos)
      << s.status();
  EXPECT_LT(seconds, 1.0);
}

TEST(ClusterDevices, WorkersRegisterEachDeviceKindAndFindNoGpusWhereThereAreNone) {
  // Asking for both kinds gives the CPU devices, plus every GPU the CUDA runtime sees.
  auto cluster = StartCluster(1, 2, {"--device_kind=both"});
  ASSERT_NE(cluster, nullptr);
  auto s = Session::Connect(cluster->address());
  ASSERT_TRUE(s.ok()) << s.status();
  auto st = (*s)->Cluster();
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->workers.size(), 1u);
  const std::vector<std::string>& kinds = st->workers[0].device_kinds;
  ASSERT_GE(kinds.size(), 2u);
  EXPECT_EQ(kinds[0], "cpu");
  EXPECT_EQ(kinds[1], "cpu");
  for (size_t i = 2; i < kinds.size(); ++i) EXPECT_EQ(kinds[i], "cuda");
  EXPECT_EQ(int(kinds.size()), st->num_devices());
}

TEST_F(ClusterTest, ComputesOnEveryDeviceAndOnlyFetchedBytesComeBack) {
  const int64_t n = 10000;
  Graph graph = AffineTanh(n);
  auto exe = session_->Compile(graph);
  ASSERT_TRUE(exe.ok()) << exe.status();
  std::vector<float> x(n), w(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::sin(i * 0.01f);
    w[i] = 0.5f + (i % 7) * 0.1f;
  }
  for (int device = 0; device < 4; ++device) {
    auto xa = session_->Put(HostArray::From<float>({n}, x), Placement::Device(device));
    auto wa = session_->Put(HostArray::From<float>({n}, w), Placement::Device(device));
    ASSERT_TRUE(xa.ok() && wa.ok());
    auto outs = session_->Execute(*exe, {*xa, *wa}, {Placement::Device(device)});
    ASSERT_TRUE(outs.ok()) << outs.status();
    auto before = session_->Stats();
    auto y = session_->Fetch((*outs)[0]);
    ASSERT_TRUE(y.ok()) << y.status();
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      float want = std::tanh(x[i] * w[i] + 0.25f);
      ASSERT_NEAR(y->as<float>()[i], want, 1e-6) << i;
      sum += want;
    }
    auto after = session_->Stats();
    EXPECT_EQ(after->bytes_device_to_host - before->bytes_device_to_host, n * 4);
    auto s = session_->Fetch((*outs)[1]);
    ASSERT_TRUE(s.ok());
    EXPECT_NEAR(s->as<float>()[0], sum, 1e-2);
    auto info = session_->Info((*outs)[0]);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->devices, std::vector<int>{device});
    EXPECT_EQ(info->state, ArrayState::kReady);
    ASSERT_TRUE(session_->Delete({*xa, *wa, (*outs)[0], (*outs)[1]}).ok());
  }
  auto again = session_->Compile(AffineTanh(n));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->cache_hit());
  EXPECT_EQ(again->id(), exe->id());
}

TEST_F(ClusterTest, ReplicatedExecutionRunsOnAllDevices) {
  GraphBuilder g("double");
  Value x = g.Parameter({DType::kS32, {3}}, "x");
  Graph graph = *g.Build({g.Add(x, x)});
  auto exe = session_->Compile(graph);
  ASSERT_TRUE(exe.ok());
  auto xa = session_->Put(HostArray::From<int32_t>({3}, {1, -2, 3}), Placement::Replicated());
  ASSERT_TRUE(xa.ok()) << xa.status();
  auto outs = session_->Execute(*exe, {*xa}, {Placement::Replicated(), /*wait=*/true});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto info = session_->Info((*outs)[0]);
  EXPECT_EQ(info->devices, (std::vector<int>{0, 1, 2, 3}));
  auto y = session_->Fetch((*outs)[0]);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(std::vector<int32_t>(y->as<int32_t>().begin(), y->as<int32_t>().end()),
            (std::vector<int32_t>{2, -4, 6}));
}

TEST_F(ClusterTest, BadRequestsGetClearErrorsAndTheClusterKeepsServing) {
  GraphBuilder g("neg");
  Value x = g.Parameter({DType::kF32, {4}}, "x");
  auto exe = session_->Compile(*g.Build({g.Neg(x)}));
  ASSERT_TRUE(exe.ok());
  // Wrong dtype argument.
  auto bad = session_->Put(HostArray::From<int32_t>({4}, {1, 2, 3, 4}));
  ASSERT_TRUE(bad.ok());
  // Pipelined: the rejection travels on the output handles.
  auto r = session_->Execute(*exe, {*bad});
  ASSERT_TRUE(r.ok());
  absl::Status waited = session_->Await(*r);
  EXPECT_EQ(waited.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(waited.message().find("argument 0 'x'"), absl::string_view::npos) << waited;
  EXPECT_NE(waited.message().find("expected f32[4], got s32[4] (dtype differs)"),
            absl::string_view::npos)
      << waited;
  // Waiting for the reply returns it directly.
  r = session_->Execute(*exe, {*bad}, {.wait = true});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  // Argument on another device (another worker) than the step: the guard
  // allows the implicit move by default, and counts it.
  auto good = session_->Put(HostArray::From<float>({4}, {1, 2, 3, 4}), Placement::Device(2));
  r = session_->Execute(*exe, {*good}, {Placement::Device(0), /*wait=*/true});
  ASSERT_TRUE(r.ok()) << r.status();
  auto moved = session_->Fetch((*r)[0]);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->as<float>()[1], -2.f);
  auto counted = session_->Stats();
  EXPECT_EQ(counted->bytes_device_to_device, 16);
  auto still = session_->Info(*good);
  EXPECT_EQ(still->devices, std::vector<int>{2});  // the move was for that step only
  // A donated argument cannot change devices.
  r = session_->Execute(*exe, {*good}, {Placement::Device(0), /*wait=*/true, {0}});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("a donated buffer cannot change devices"),
            absl::string_view::npos)
      << r.status();
  // A device that does not exist.
  r = session_->Execute(*exe, {*good}, {Placement::Device(17), /*wait=*/true});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("device 17 does not exist"), absl::string_view::npos)
      << r.status();
  // Another session's array.
  auto other = Session::Connect(cluster_->address());
  ASSERT_TRUE(other.ok());
  auto foreign = (*other)->Fetch(*good);
  ASSERT_FALSE(foreign.ok());
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied);
  // A deleted array.
  ASSERT_TRUE(session_->Delete({*good}).ok());
  auto gone = session_->Fetch(*good);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  // Shape errors are caught while building.
  GraphBuilder b("bad");
  Value p = b.Parameter({DType::kF32, {2, 3}});
  Value q = b.Parameter({DType::kF32, {3, 2}});
  b.Add(p, q);
  EXPECT_FALSE(b.status().ok());
  EXPECT_NE(b.status().message().find("expected f32[2,3], got f32[3,2]"), absl::string_view::npos);
  // Still serving.
  auto ok = session_->Put(HostArray::From<float>({4}, {1, 2, 3, 4}));
  auto outs = session_->Execute(*exe, {*ok});
  ASSERT_TRUE(outs.ok());
  auto y = session_->Fetch((*outs)[0]);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(y->as<float>()[3], -4.f);
}

// Reflection v1 (what newer grpcurl speaks) on both daemons: the services
// are listed, and each, the health service included, is described by its
// file with the files it imports.
TEST_F(ClusterTest, ReflectionV1ListsAndDescribesEveryService) {
  namespace rv1 = grpc::reflection::v1;
  auto ask = [](const std::string& address, const rv1::ServerReflectionRequest& req) {
    auto stub = rv1::ServerReflection::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->ServerReflectionInfo(&ctx);
    EXPECT_TRUE(stream->Write(req));
    stream->WritesDone();
    rv1::ServerReflectionResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    EXPECT_TRUE(stream->Finish().ok());
    return resp;
  };
  auto files_of = [](const rv1::ServerReflectionResponse& resp) {
    std::vector<std::string> names;
    for (const std::string& bytes : resp.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto f;
      EXPECT_TRUE(f.ParseFromString(bytes));
      names.push_back(f.name());
    }
    return names;
  };
  auto admin = v1::Admin::NewStub(
      grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext cctx;
  v1::GetClusterResponse cluster;
  ASSERT_TRUE(admin->GetCluster(&cctx, v1::GetClusterRequest(), &cluster).ok());
  for (const auto& [address, own] : {std::pair{cluster_->address(), "tessel.v1.Session"},
                                     {cluster.workers(0).address(), "tessel.v1.Worker"}}) {
    rv1::ServerReflectionRequest list;
    list.set_list_services("");
    std::vector<std::string> services;
    const rv1::ServerReflectionResponse listed = ask(address, list);
    for (const auto& s : listed.list_services_response().service()) services.push_back(s.name());
    EXPECT_NE(std::find(services.begin(), services.end(), own), services.end()) << address;
    EXPECT_NE(std::find(services.begin(), services.end(), "grpc.health.v1.Health"), services.end())
        << address;

    rv1::ServerReflectionRequest health;
    health.set_file_containing_symbol("grpc.health.v1.Health");
    EXPECT_EQ(files_of(ask(address, health)),
              std::vector<std::string>{"grpc/health/v1/health.proto"})
        << address;
    rv1::ServerReflectionRequest mine;
    mine.set_file_containing_symbol(own);
    const std::vector<std::string> files = files_of(ask(address, mine));
    ASSERT_FALSE(files.empty());
    EXPECT_NE(std::find(files.begin(), files.end(), "tessel/v1/common.proto"),
              files.end());  // an import
    rv1::ServerReflectionRequest unknown;
    unknown.set_file_containing_symbol("tessel.v1.NoSuchThing");
    const auto err = ask(address, unknown);
    EXPECT_EQ(err.error_response().error_code(), int(grpc::StatusCode::NOT_FOUND));
    EXPECT_NE(err.error_response().error_message().find("tessel.v1.NoSuchThing"),
              std::string::npos);
  }
}

TEST_F(ClusterTest, TruncatedAndOversizedPutStreamsAreRejected) {
  auto channel = grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Session::NewStub(channel);
  auto put = [&](int64_t send_bytes, int64_t chunk) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto w = stub->Put(&ctx, &resp);
    v1::PutRequest msg;
    msg.mutable_header()->set_session_id(session_->id());
    msg.mutable_header()->set_handle(0xfeed + send_bytes);
    msg.mutable_header()->mutable_type()->set_dtype(v1::U8);
    msg.mutable_header()->mutable_type()->add_dims(1000);
    w->Write(msg);
    for (int64_t off = 0; off < send_bytes; off += chunk) {
      msg.set_data(std::string(std::min(chunk, send_bytes - off), 'x'));
      if (!w->Write(msg)) break;
    }
    w->WritesDone();
    return w->Finish();
  };
  grpc::Status truncated = put(600, 100);
  EXPECT_EQ(truncated.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(truncated.error_message().find("expected 1000 bytes, got 600"), std::string::npos)
      << truncated.error_message();
  grpc::Status too_long = put(1200, 400);
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::Status oversized = put(100 << 20, 100 << 20);  // one 100 MiB message
  EXPECT_EQ(oversized.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << oversized.error_message();
  // Nothing is left half-loaded, and the cluster still serves.
  auto stats = session_->Stats();
  ASSERT_TRUE(stats.ok());
  for (const auto& d : stats->devices) EXPECT_LT(d.bytes_in_use, 1 << 20);
  EXPECT_TRUE(session_->Put(HostArray::From<float>({2}, {1, 2})).ok());
}

// The bytes of array `h`, read with the bare Fetch RPC; empty (and the
// test failed) when the fetch fails.
std::string FetchRaw(v1::Session::Stub* stub, const std::string& session, uint64_t h) {
  grpc::ClientContext ctx;
  v1::FetchRequest req;
  req.set_session_id(session);
  req.set_handle(h);
  auto reader = stub->Fetch(&ctx, req);
  std::string bytes;
  for (v1::FetchResponse msg; reader->Read(&msg);) bytes += msg.data();
  if (grpc::Status s = reader->Finish(); !s.ok()) {
    ADD_FAILURE() << "fetch of " << h << ": " << s.error_message();
    return "";
  }
  return bytes;
}

// A call that waits is answered once, on the Dispatch stream, when its
// outputs are done: the reply carries their states; a later pipelined call
// in the same batch is still dispatched, and its reply does not wait.
TEST_F(ClusterTest, AWaitingDispatchCallIsAnsweredWhenItsOutputsAreDone) {
  GraphBuilder g("neg");
  Value x = g.Parameter({DType::kF32, {4}}, "x");
  auto exe = session_->Compile(*g.Build({g.Neg(x)}));
  ASSERT_TRUE(exe.ok());
  auto xa = session_->Put(HostArray::From<float>({4}, {1, 2, 3, 4}));
  ASSERT_TRUE(xa.ok());
  auto bad = session_->Put(HostArray::From<int32_t>({4}, {1, 2, 3, 4}));
  ASSERT_TRUE(bad.ok());
  auto stub = v1::Session::NewStub(
      grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->Dispatch(&ctx);
  auto call = [&](const Array& arg, uint64_t out, bool await) {
    v1::ExecuteRequest r;
    r.set_session_id(session_->id());
    r.set_executable_id(exe->id());
    r.add_arguments(arg.handle());
    r.add_outputs(out);
    r.set_wait(await);
    r.set_await_outputs(await);
    return r;
  };
  v1::DispatchBatch batch;
  *batch.add_calls() = call(*xa, 0xa1, true);
  *batch.add_calls() = call(*xa, 0xa2, false);
  ASSERT_TRUE(stream->Write(batch));
  v1::DispatchReplies replies;
  ASSERT_TRUE(stream->Read(&replies));
  ASSERT_EQ(replies.replies_size(), 2);
  EXPECT_EQ(replies.replies(0).code(), 0) << replies.replies(0).error();
  ASSERT_TRUE(replies.replies(0).has_outputs());
  ASSERT_EQ(replies.replies(0).outputs().states_size(), 1);
  EXPECT_EQ(replies.replies(0).outputs().states(0), v1::READY);
  EXPECT_FALSE(replies.replies(1).has_outputs());
  // A step that fails at run time: the state and the error come back.
  batch.Clear();
  *batch.add_calls() = call(*bad, 0xa3, true);
  ASSERT_TRUE(stream->Write(batch));
  ASSERT_TRUE(stream->Read(&replies));
  ASSERT_EQ(replies.replies_size(), 1);
  const v1::DispatchReply& failed = replies.replies(0);
  if (failed.code() == 0) {  // accepted, then failed on the device
    ASSERT_EQ(failed.outputs().states_size(), 1);
    EXPECT_EQ(failed.outputs().states(0), v1::ERROR);
    EXPECT_NE(failed.outputs().errors(0).find("expected f32[4], got s32[4]"), std::string::npos);
  } else {  // refused when dispatched
    EXPECT_EQ(failed.code(), int(grpc::StatusCode::INVALID_ARGUMENT)) << failed.error();
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  // The outputs are the session's arrays, with the right values.
  for (uint64_t h : {0xa1, 0xa2}) {
    const std::string bytes = FetchRaw(stub.get(), session_->id(), h);
    ASSERT_EQ(bytes.size(), 16u);
    float last;
    std::memcpy(&last, bytes.data() + 12, 4);
    EXPECT_EQ(last, -4.f) << h;
  }
}

// The coordinator holds a Dispatch batch's steps and sends them to each
// worker together, once the batch is dispatched. A call that moves an
// earlier call's output to another worker waits for that output first: the
// steps held must go out before it waits, or the batch would wait for
// itself. A chain of such calls, alternating between the workers, must
// finish, and with the right value.
TEST_F(ClusterTest, ADispatchBatchThatMovesItsOwnOutputsBetweenWorkersFinishes) {
  GraphBuilder g("neg");
  Value x = g.Parameter({DType::kF32, {4}}, "x");
  auto exe = session_->Compile(*g.Build({g.Neg(x)}));
  ASSERT_TRUE(exe.ok());
  auto xa = session_->Put(HostArray::From<float>({4}, {1, -2, 3, -4}), Placement::Device(0));
  ASSERT_TRUE(xa.ok());
  auto stub = v1::Session::NewStub(
      grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::seconds(60));  // a hang fails, not stalls
  auto stream = stub->Dispatch(&ctx);
  constexpr int kCalls = 301;  // odd: the result is -x
  v1::DispatchBatch batch;
  uint64_t arg = xa->handle();
  for (int i = 0; i < kCalls; ++i) {
    v1::ExecuteRequest* r = batch.add_calls();
    r->set_session_id(session_->id());
    r->set_executable_id(exe->id());
    r->add_arguments(arg);
    arg = 0xc000 + i;
    r->add_outputs(arg);
    r->mutable_placement()->set_device(i % 2 == 0 ? 2 : 0);  // device 2 is the other worker's
    r->set_await_outputs(i == kCalls - 1);
  }
  ASSERT_TRUE(stream->Write(batch));
  v1::DispatchReplies replies;
  ASSERT_TRUE(stream->Read(&replies)) << stream->Finish().error_message();
  ASSERT_EQ(replies.replies_size(), kCalls);
  for (const v1::DispatchReply& r : replies.replies()) ASSERT_EQ(r.code(), 0) << r.error();
  const v1::DispatchReply& last = replies.replies(kCalls - 1);
  ASSERT_EQ(last.outputs().states_size(), 1);
  EXPECT_EQ(last.outputs().states(0), v1::READY) << last.outputs().errors(0);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  const std::string bytes = FetchRaw(stub.get(), session_->id(), arg);
  std::vector<float> got(4);
  ASSERT_EQ(bytes.size(), sizeof(float) * got.size());
  std::memcpy(got.data(), bytes.data(), bytes.size());
  EXPECT_EQ(got, (std::vector<float>{-1, 2, -3, 4}));
  auto stats = session_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->bytes_device_to_device, int64_t{16} * kCalls);  // every call moved its argument
}

TEST_F(ClusterTest, ArraysOverTwoGibibytesRoundTrip) {
  const int64_t n = (int64_t{2} << 30) + 4096 + 3;
  HostArray a(ArrayType{DType::kU8, {n}});
  uint8_t* p = a.mutable_data();
  for (int64_t i = 0; i < n; ++i) p[i] = uint8_t(i * 2654435761u >> 24);
  auto arr = session_->Put(a, Placement::Device(1));
  ASSERT_TRUE(arr.ok()) << arr.status();
  auto back = session_->Fetch(*arr);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size_bytes(), n);
  EXPECT_EQ(std::memcmp(back->data(), a.data(), n), 0);
  ASSERT_TRUE(session_->Delete({*arr}).ok());
}

TEST_F(ClusterTest, CliStatusListsEveryWorker) {
  std::string cmd =
      "TESSEL_COORDINATOR=" + cluster_->address() + " " + TESSEL_BIN_DIR + "/tessel status";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  EXPECT_EQ(pclose(f), 0) << out;
  EXPECT_NE(out.find("w0"), std::string::npos) << out;
  EXPECT_NE(out.find("w1"), std::string::npos) << out;
  EXPECT_NE(out.find("4 live devices"), std::string::npos) << out;
}

// sum(broadcast(x)) through 16 MiB: out of memory on the 4 MiB devices below.
Graph SixteenMiBStep() {
  GraphBuilder g("grow");
  Value x = g.Parameter({DType::kF32, {1}}, "x");
  return *g.Build({g.Reduce(g.BroadcastInDim(x, {4 << 20}, {0}), ReduceKind::kSum, {0})});
}

TEST(FailureTest, OutOfMemoryTravelsOnHandlesAsResourceExhausted) {
  auto cluster = StartCluster(1, 1, {"--device_memory_bytes=4194304"});
  ASSERT_NE(cluster, nullptr);
  auto s = Session::Connect(cluster->address());
  ASSERT_TRUE(s.ok());
  auto exe = (*s)->Compile(SixteenMiBStep());
  ASSERT_TRUE(exe.ok());
  auto xa = (*s)->Put(HostArray::From<float>({1}, {1.f}));
  auto outs = (*s)->Execute(*exe, {*xa});
  ASSERT_TRUE(outs.ok());  // accepted; the failure surfaces on the handle
  absl::Status st = (*s)->Await(*outs);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("cpu:0"), absl::string_view::npos) << st;
  auto f = (*s)->Fetch((*outs)[0]);
  EXPECT_FALSE(f.ok());
  // A step reading the failed array fails too, naming why.
  GraphBuilder g2("use");
  Value p = g2.Parameter({DType::kF32, {}}, "p");
  auto exe2 = (*s)->Compile(*g2.Build({g2.Neg(p)}));
  auto outs2 = (*s)->Execute(*exe2, {(*outs)[0]});
  ASSERT_TRUE(outs2.ok());
  absl::Status st2 = (*s)->Await(*outs2);
  EXPECT_NE(st2.message().find("failed earlier"), absl::string_view::npos) << st2;
  // Waiting in the call: the failure comes back from Execute itself, with
  // its code and the array it fell on.
  auto waited = (*s)->Execute(*exe, {*xa}, {.wait = true});
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kResourceExhausted) << waited.status();
  EXPECT_NE(waited.status().message().find("failed: array 0x"), absl::string_view::npos)
      << waited.status();
  EXPECT_NE(waited.status().message().find("cpu:0"), absl::string_view::npos) << waited.status();
  // The worker keeps serving.
  auto small = (*s)->Execute(*exe2, {*(*s)->Put(HostArray::From<float>({}, {3.f}))});
  ASSERT_TRUE(small.ok());
  auto v = (*s)->Fetch((*small)[0]);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->as<float>()[0], -3.f);
}

// A failure spreads to every step that reads its result, but each of those
// errors quotes the root cause once, with a count: after 5,000 dependent
// steps the message is still short and still names the original failure
// (it used to grow by a prefix per step, past gRPC's metadata limit).
TEST(FailureTest, DependentErrorsQuoteTheRootCauseOnceWithACount) {
  auto cluster = StartCluster(1, 1, {"--device_memory_bytes=4194304"});
  ASSERT_NE(cluster, nullptr);
  auto s = Session::Connect(cluster->address());
  ASSERT_TRUE(s.ok());
  auto grow = (*s)->Compile(SixteenMiBStep());
  ASSERT_TRUE(grow.ok());
  GraphBuilder g2("use");
  Value p = g2.Parameter({DType::kF32, {}}, "p");
  auto use = (*s)->Compile(*g2.Build({g2.Neg(p)}));
  ASSERT_TRUE(use.ok());
  auto first = (*s)->Execute(*grow, {*(*s)->Put(HostArray::From<float>({1}, {1.f}))});
  ASSERT_TRUE(first.ok());
  Array prev = (*first)[0];
  for (int i = 0; i < 5000; ++i) {
    auto o = (*s)->Execute(*use, {prev});
    ASSERT_TRUE(o.ok()) << i << ": " << o.status();
    prev = (*o)[0];
  }
  absl::Status last = (*s)->Await({prev});
  ASSERT_FALSE(last.ok());
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_LT(last.message().size(), 1024u) << last.message().substr(0, 2048);
  // The count: the step's place in the chain. The worker (for steps sent
  // before the coordinator learned of the failure) and the coordinator (for
  // the rest) each count their part of the chain, quoting the cause the same way.
  int64_t steps = 0;
  const std::string m(last.message());
  const size_t at = m.find("dependent step ");
  ASSERT_NE(at, std::string::npos) << m;
  steps = std::stoll(m.substr(at + 15));
  EXPECT_GE(steps, 1) << m;
  EXPECT_LE(steps, 5000) << m;
  // The root cause, quoted once.
  size_t quoted = 0;
  for (size_t i = m.find("out of memory"); i != std::string::npos;
       i = m.find("out of memory", i + 1))
    ++quoted;
  EXPECT_EQ(quoted, 1u) << m;
  EXPECT_NE(m.find("device cpu:0 out of memory"), std::string::npos) << m;
}

// The C++ SDK renews its session's lease in the background: idle for four
// leases, a session keeps its arrays. A session that stops renewing (its
// client gone: here a raw OpenSession with no keep-alive) ends, and a call
// naming it afterwards says it expired.
TEST(SessionLease, TheSdkKeepsAnIdleSessionAliveAndAnAbandonedOneExpires) {
  LocalCluster::Options o;
  o.workers = 1;
  o.coordinator_flags = {"--session_lease_s=1"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto s = Session::Connect((*cluster)->address());
  ASSERT_TRUE(s.ok()) << s.status();
  auto kept = (*s)->Put(HostArray::From<float>({3}, {1, 2, 3}));
  ASSERT_TRUE(kept.ok()) << kept.status();
  absl::SleepFor(absl::Seconds(4));
  auto back = (*s)->Fetch(*kept);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->as<float>()[2], 3.f);

  auto channel = grpc::CreateChannel((*cluster)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Session::NewStub(channel);
  grpc::ClientContext open_ctx;
  v1::OpenSessionRequest open;
  v1::OpenSessionResponse opened;
  ASSERT_TRUE(stub->OpenSession(&open_ctx, open, &opened).ok());
  EXPECT_EQ(opened.lease_ms(), 1000);
  absl::SleepFor(absl::Seconds(3));
  grpc::ClientContext ctx;
  v1::KeepAliveRequest req;
  req.set_session_id(opened.session_id());
  v1::KeepAliveResponse resp;
  const grpc::Status late = stub->KeepAlive(&ctx, req, &resp);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(late.error_message().find("expired: no call or keep-alive from its client for 1s"),
            std::string::npos)
      << late.error_message();
}

TEST(FailureTest, LostWorkerMarksItsArraysLostAndTheRestServes) {
  auto cluster = StartCluster(2, 1);
  ASSERT_NE(cluster, nullptr);
  auto s = Session::Connect(cluster->address());
  ASSERT_TRUE(s.ok());
  auto on1 = (*s)->Put(HostArray::From<float>({2}, {1, 2}), Placement::Device(1));
  auto on0 = (*s)->Put(HostArray::From<float>({2}, {3, 4}), Placement::Device(0));
  ASSERT_TRUE(on1.ok() && on0.ok());
  ASSERT_TRUE(cluster->SignalWorker(1, SIGKILL).ok());
  for (int i = 0; i < 100; ++i) {
    auto c = (*s)->Cluster();
    if (c.ok() && !c->workers[1].alive) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  auto c = (*s)->Cluster();
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->workers[1].alive);
  auto lost = (*s)->Fetch(*on1);
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(lost.status().message().find("stopped heartbeating"), absl::string_view::npos)
      << lost.status();
  auto kept = (*s)->Fetch(*on0);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->as<float>()[1], 4.f);
}

}  // namespace
}  // namespace tessel
