// Direct transfers: the client writes and reads an array's blocks straight
// to and from the workers holding them, with tickets the coordinator
// signed, and falls back to the coordinator's relay when it cannot reach a
// worker. The reference for every array is the host array that was put;
// what goes one way directly comes back the other through the relay, whose
// block routing is the coordinator's own code.
#include <gtest/gtest.h>

#include <grpcpp/grpcpp.h>

#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/src/direct_transfer_internal.h"
#include "core/security.h"
#include "core/status.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tessel/v1/session.grpc.pb.h"
#include "tessel/v1/worker.grpc.pb.h"
#include "tests/cluster_fixture.h"

namespace tessel {
namespace {

HostArray Random(DType dtype, std::vector<int64_t> dims, int seed) {
  HostArray a(ArrayType{dtype, std::move(dims)});
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < a.size_bytes(); ++i) a.mutable_data()[i] = uint8_t(rng());
  return a;
}

std::vector<uint8_t> Bytes(const HostArray& a) { return {a.data(), a.data() + a.size_bytes()}; }

// The box [start, start+shape) of a row-major array, element by element.
std::vector<uint8_t> NaiveBox(const HostArray& a, const std::vector<int64_t>& start,
                              const std::vector<int64_t>& shape) {
  const int rank = int(shape.size());
  const int64_t elem = DTypeBytes(a.type().dtype);
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<uint8_t> out;
  std::vector<int64_t> idx(rank, 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = 0;
    for (int d = 0; d < rank; ++d) off = off * a.type().dims[d] + start[d] + idx[d];
    out.insert(out.end(), a.data() + off * elem, a.data() + (off + 1) * elem);
    for (int d = rank - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// Puts and fetches `x` where no direct transfer was granted: both relayed,
// with no failure to report, and the bytes the same.
void ExpectRelayedBothWays(Session& s, const HostArray& x, Placement placement) {
  TransferReceipt receipt;
  auto a = s.Put(x, placement, {.receipt = &receipt});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(receipt.direct);
  EXPECT_EQ(receipt.relayed_because, "");
  auto back = s.Fetch(*a, {.receipt = &receipt});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), Bytes(x));
  EXPECT_FALSE(receipt.direct);
  EXPECT_EQ(receipt.relayed_because, "");
}

TEST(BoxWriter, ScattersABlockArrivingInAnyPiecesAsANaiveIndexLoopPlacesIt) {
  struct Case {
    std::vector<int64_t> dims, start, shape;
  };
  const std::vector<Case> cases = {
      {{8, 6}, {4, 0}, {4, 6}},             // rows: one run
      {{8, 6}, {0, 3}, {8, 3}},             // columns: a run per row
      {{4, 6, 10}, {2, 3, 0}, {2, 3, 10}},  // inner dimension whole
      {{4, 6, 10}, {0, 0, 5}, {4, 6, 5}},   // last dimension split
      {{3, 4, 2, 6}, {1, 2, 0, 2}, {1, 2, 2, 2}},
      {{}, {}, {}},  // a scalar
      {{5}, {0}, {5}},
  };
  for (const Case& c : cases) {
    for (int64_t piece : {int64_t{1}, int64_t{7}, int64_t{1} << 20}) {
      const HostArray src = Random(DType::kF32, c.dims, 3);
      const std::vector<uint8_t> block = NaiveBox(src, c.start, c.shape);
      HostArray dst(src.type());
      BoxWriter w(dst.mutable_data(), 4, c.dims, c.start, c.shape);
      for (size_t off = 0; off < block.size(); off += piece) {
        ASSERT_TRUE(w.Write(block.data() + off, std::min<int64_t>(piece, block.size() - off)));
      }
      EXPECT_TRUE(w.full());
      EXPECT_EQ(NaiveBox(dst, c.start, c.shape), block)
          << src.type().ToString() << " piece " << piece;
      const uint8_t extra = 0;
      EXPECT_FALSE(w.Write(&extra, 1)) << "a byte past the box";
    }
  }
}

TEST(Ticket, OnlyTheSignedGrantAndSecretPassUntilItExpires) {
  const std::string secret = RandomSecret();
  const absl::Time now = absl::Now();
  const std::string t = SignTicket(secret, ReadGrant(1, 0xabc), now + absl::Minutes(1));
  EXPECT_TRUE(CheckTicket(secret, t, ReadGrant(1, 0xabc), now).ok());
  EXPECT_EQ(CheckTicket(secret, t, ReadGrant(1, 0xabd), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(secret, t, ReadGrant(0, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(RandomSecret(), t, ReadGrant(1, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
  const absl::Status late = CheckTicket(secret, t, ReadGrant(1, 0xabc), now + absl::Minutes(2));
  EXPECT_EQ(late.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(late.message(), "expired")) << late;
  // A later expiry written over the signed one does not verify.
  std::string moved = t;
  moved[0] = moved[0] == '9' ? '8' : '9';
  EXPECT_EQ(CheckTicket(secret, moved, ReadGrant(1, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(secret, "garbage", ReadGrant(1, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(secret, "", ReadGrant(1, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
  // A write grant names the type and the devices: neither can be changed.
  const std::string w =
      SignTicket(secret, WriteGrant(0xabc, "f32[4]", {0, 1}), now + absl::Minutes(1));
  EXPECT_TRUE(CheckTicket(secret, w, WriteGrant(0xabc, "f32[4]", {0, 1}), now).ok());
  EXPECT_EQ(CheckTicket(secret, w, WriteGrant(0xabc, "f32[8]", {0, 1}), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(secret, w, WriteGrant(0xabc, "f32[4]", {0}), now).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckTicket(secret, w, ReadGrant(0, 0xabc), now).code(),
            absl::StatusCode::kPermissionDenied);
}

class DirectTransferTest : public ClusterFixture<2, 2> {
 protected:
  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    ConnectOptions o;
    o.direct_min_bytes = 0;  // every array, however small
    auto s = Session::Connect(cluster_->address(), o);
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
  }
  const Mesh mesh_{{{"data", 2}, {"model", 2}}};

  // Puts `x` as placed directly and fetches it through the relay, then puts
  // it through the relay and fetches it directly: the same bytes each way.
  void RoundTrip(const HostArray& x, Placement placement, int blocks, int writes) {
    SCOPED_TRACE(x.type().ToString());
    auto before = session_->Stats();
    ASSERT_TRUE(before.ok()) << before.status();
    TransferReceipt receipt;
    auto a = session_->Put(x, placement, {.receipt = &receipt});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(receipt.direct) << receipt.relayed_because;
    EXPECT_EQ(receipt.blocks, writes);
    EXPECT_EQ(receipt.relayed_because, "");
    auto info = session_->Info(*a);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state, ArrayState::kReady);
    auto back = session_->Fetch(*a, {.receipt = &receipt, .direct = false});
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_FALSE(receipt.direct);
    EXPECT_EQ(back->type(), x.type());
    EXPECT_EQ(back->bytes(), Bytes(x));

    auto b = session_->Put(x, placement, {.direct = false});
    ASSERT_TRUE(b.ok()) << b.status();
    auto mid = session_->Stats();
    ASSERT_TRUE(mid.ok()) << mid.status();
    back = session_->Fetch(*b, {.receipt = &receipt});
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->bytes(), Bytes(x));
    EXPECT_TRUE(receipt.direct) << receipt.relayed_because;
    EXPECT_EQ(receipt.blocks, blocks);
    EXPECT_EQ(receipt.relayed_because, "");
    // The coordinator counts what it authorised, each way: a fetch reads
    // each block once; both puts wrote every device's copy.
    auto after = session_->Stats();
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->bytes_device_to_host - mid->bytes_device_to_host, x.size_bytes());
    EXPECT_EQ(after->bytes_host_to_device - before->bytes_host_to_device,
              2 * info->bytes_per_device * int64_t(info->devices.size()));
    EXPECT_TRUE(session_->Delete({*a, *b}).ok());
  }
};

TEST_F(DirectTransferTest, WholeArraysGoStraightToAndFromTheirDevice) {
  RoundTrip(Random(DType::kF32, {1000, 37}, 1), Placement::Device(3), 1, 1);
  RoundTrip(Random(DType::kS64, {}, 2), Placement::Device(0), 1, 1);
  RoundTrip(Random(DType::kU8, {0, 5}, 3), Placement::Device(1), 1, 1);
  // One block, a copy on every device: one stream per worker.
  RoundTrip(Random(DType::kF64, {64, 3}, 4), Placement::Replicated(), 1, 2);
}

TEST_F(DirectTransferTest, ShardedArraysMoveEveryBlockInParallel) {
  // Rows over `data`, copied over `model`: 2 blocks, each on both devices of one worker.
  RoundTrip(Random(DType::kF32, {8, 6}, 5),
            Placement::Sharded(mesh_, Sharding::Split({"data", ""})), 2, 2);
  // Columns over `model`, copied over `data`: each block on a device of both workers.
  RoundTrip(Random(DType::kF32, {8, 6}, 6),
            Placement::Sharded(mesh_, Sharding::Split({"", "model"})), 2, 4);
  RoundTrip(Random(DType::kS32, {6, 10}, 7),
            Placement::Sharded(mesh_, Sharding::Split({"data", "model"})), 4, 4);
  RoundTrip(Random(DType::kF32, {4, 6, 8}, 8),
            Placement::Sharded(mesh_, Sharding::Split({"", "model", "data"})), 4, 4);
  // Large enough that each block streams as many messages, with runs both
  // longer and shorter than what goes to gRPC in place.
  RoundTrip(Random(DType::kF32, {512, 2048}, 9),
            Placement::Sharded(mesh_, Sharding::Split({"model", "data"})), 4, 4);
  RoundTrip(Random(DType::kF32, {64, 65536}, 10),
            Placement::Sharded(mesh_, Sharding::Split({"", "data"})), 2, 2);
}

TEST_F(DirectTransferTest, ADirectlyPutArrayIsWhatStepsRead) {
  // An independent reader of the worker's buffers: a step summing rows.
  GraphBuilder g("rowsum");
  auto x = g.Parameter({DType::kF32, {8, 6}}, "x");
  auto graph = g.Build({g.Reduce(x, ReduceKind::kSum, {1})});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session_->Compile(*graph);
  ASSERT_TRUE(exe.ok()) << exe.status();
  const HostArray host = Random(DType::kF32, {8, 6}, 11);
  TransferReceipt receipt;
  auto a = session_->Put(host, Placement::Device(2), {.receipt = &receipt});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(receipt.direct);
  auto out = session_->Execute(*exe, {*a}, {.placement = Placement::Device(2)});
  ASSERT_TRUE(out.ok()) << out.status();
  auto sums = session_->Fetch((*out)[0]);
  ASSERT_TRUE(sums.ok()) << sums.status();
  for (int r = 0; r < 8; ++r) {
    float want = 0;
    for (int c = 0; c < 6; ++c) want += host.as<float>()[r * 6 + c];
    EXPECT_NEAR(sums->as<float>()[r], want, 1e-5) << "row " << r;
  }
}

TEST_F(DirectTransferTest, SmallArraysGoThroughTheCoordinatorByDefault) {
  auto connected = Session::Connect(cluster_->address());
  ASSERT_TRUE(connected.ok()) << connected.status();
  Session* s = connected->get();
  const HostArray small = Random(DType::kF32, {16}, 12), big = Random(DType::kF32, {1 << 18}, 13);
  TransferReceipt receipt;
  auto a = s->Put(small, {}, {.receipt = &receipt});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(receipt.direct);
  auto back = s->Fetch(*a, {.receipt = &receipt});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), Bytes(small));
  EXPECT_FALSE(receipt.direct);
  auto b = s->Put(big, {}, {.receipt = &receipt});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(receipt.direct);
  back = s->Fetch(*b, {.receipt = &receipt});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), Bytes(big));
  EXPECT_TRUE(receipt.direct);
}

TEST_F(DirectTransferTest, ASessionThatOptsOutIsRelayed) {
  ConnectOptions o;
  o.direct_transfers = false;
  auto connected = Session::Connect(cluster_->address(), o);
  ASSERT_TRUE(connected.ok()) << connected.status();
  Session* s = connected->get();
  ExpectRelayedBothWays(*s, Random(DType::kF32, {8, 6}, 10),
                        Placement::Sharded(mesh_, Sharding::Split({"data", "model"})));
}

// The worker serves a read only with a ticket signed for that buffer, or
// the secret only the coordinator holds.
TEST_F(DirectTransferTest, WorkersRefuseReadsWithoutAValidTicket) {
  const HostArray x = Random(DType::kF32, {16}, 11);
  auto a = session_->Put(x, Placement::Device(2));
  ASSERT_TRUE(a.ok()) << a.status();
  auto other = session_->Put(Random(DType::kF32, {16}, 12), Placement::Device(2));
  ASSERT_TRUE(other.ok()) << other.status();

  auto coordinator = v1::Session::NewStub(
      grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::FetchRequest req;
  req.set_session_id(session_->id());
  req.set_handle(a->handle());
  req.set_direct(true);
  auto reader = coordinator->Fetch(&ctx, req);
  v1::FetchResponse plan;
  ASSERT_TRUE(reader->Read(&plan));
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(plan.direct_blocks_size(), 1);
  ASSERT_EQ(plan.data(), "");
  const v1::DirectBlock& b = plan.direct_blocks(0);
  EXPECT_EQ(b.global_device(), 2);

  auto worker =
      v1::Worker::NewStub(grpc::CreateChannel(b.address(), grpc::InsecureChannelCredentials()));
  auto read = [&](const std::string& ticket, uint64_t buffer, std::string* bytes) {
    grpc::ClientContext c;
    v1::FetchShardRequest r;
    r.set_device(b.device());
    r.set_buffer(buffer);
    r.set_ticket(ticket);
    auto rd = worker->FetchShard(&c, r);
    v1::FetchShardResponse m;
    while (rd->Read(&m)) bytes->append(m.data());
    return rd->Finish();
  };
  std::string got;
  ASSERT_TRUE(read(b.ticket(), b.buffer(), &got).ok());
  EXPECT_EQ(got, std::string(reinterpret_cast<const char*>(x.data()), x.size_bytes()));

  std::string ignored;
  grpc::Status s = read(b.ticket(), other->handle(), &ignored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  std::string forged = b.ticket();
  forged.back() = forged.back() == '0' ? '1' : '0';
  s = read(forged, b.buffer(), &ignored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = read("", b.buffer(), &ignored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_EQ(ignored, "");
}

// The raw calls of a direct put, for the tests that play a client that
// misbehaves: PutDirect's first message for f32[16] as `handle` on global
// device `device`; one PutShard stream of `header`, then `data`; and the
// coordinator's ArrayInfo of a handle.
v1::PutDirectRequest F32x16PutHeader(const std::string& session, uint64_t handle, int device) {
  v1::PutDirectRequest req;
  v1::PutRequest::Header* h = req.mutable_header();
  h->set_session_id(session);
  h->set_handle(handle);
  h->mutable_type()->set_dtype(v1::F32);
  h->mutable_type()->add_dims(16);
  h->mutable_placement()->set_device(device);
  return req;
}

v1::PutShardRequest::Header WriteHeader(const v1::DirectWrite& w) {
  v1::PutShardRequest::Header h;
  h.set_buffer(w.buffer());
  *h.mutable_type() = w.type();
  *h.mutable_devices() = w.devices();
  h.set_ticket(w.ticket());
  return h;
}

grpc::Status WriteShard(const std::string& address, const v1::PutShardRequest::Header& header,
                        const std::string& data, std::string* receipt = nullptr) {
  auto worker =
      v1::Worker::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext c;
  v1::PutShardResponse r;
  auto wr = worker->PutShard(&c, &r);
  v1::PutShardRequest m;
  *m.mutable_header() = header;
  wr->Write(m);
  m.set_data(data);
  wr->Write(m);
  wr->WritesDone();
  grpc::Status s = wr->Finish();
  if (receipt != nullptr) *receipt = r.receipt();
  return s;
}

v1::ArrayInfoResponse Info(v1::Session::Stub& coordinator, const std::string& session,
                           uint64_t handle) {
  grpc::ClientContext ic;
  v1::ArrayInfoRequest ir;
  ir.set_session_id(session);
  ir.set_handle(handle);
  v1::ArrayInfoResponse info;
  EXPECT_TRUE(coordinator.ArrayInfo(&ic, ir, &info).ok());
  return info;
}

// The worker takes a write only with a ticket signed for that buffer, type
// and devices; a put whose client never says it is done is freed.
TEST_F(DirectTransferTest, WorkersRefuseWritesWithoutAValidTicketAndUnfinishedPutsAreFreed) {
  auto channel = grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials());
  auto coordinator = v1::Session::NewStub(channel);
  const uint64_t handle = 0x5eed0001;
  v1::DirectWrite w;
  {
    grpc::ClientContext ctx;
    auto stream = coordinator->PutDirect(&ctx);
    ASSERT_TRUE(stream->Write(F32x16PutHeader(session_->id(), handle, 2)));
    v1::PutDirectResponse plan;
    ASSERT_TRUE(stream->Read(&plan));
    ASSERT_EQ(plan.blocks_size(), 1);
    w = plan.blocks(0);
    EXPECT_EQ(w.global_devices(0), 2);

    auto write = [&](const v1::PutShardRequest::Header& header, int64_t bytes) {
      return WriteShard(w.address(), header, std::string(bytes, '\1'));
    };
    v1::PutShardRequest::Header bigger = WriteHeader(w);
    bigger.mutable_type()->set_dims(0, 32);
    grpc::Status st = write(bigger, 128);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    v1::PutShardRequest::Header elsewhere = WriteHeader(w);
    elsewhere.clear_devices();
    elsewhere.add_devices(w.devices(0) == 0 ? 1 : 0);
    st = write(elsewhere, 64);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    v1::PutShardRequest::Header unsigned_header = elsewhere;
    unsigned_header.clear_ticket();
    st = write(unsigned_header, 64);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
    // The array is pending while the client writes.
    EXPECT_EQ(Info(*coordinator, session_->id(), handle).state(), v1::PENDING);
    ctx.TryCancel();  // gone without `done`
    (void)stream->Finish();
  }
  // Freed: retired like a deleted array, so no step waits on it.
  v1::ArrayInfoResponse info;
  for (int i = 0; i < 200 && info.error().empty(); ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    info = Info(*coordinator, session_->id(), handle);
  }
  EXPECT_TRUE(absl::StrContains(info.error(), "deleted")) << info.ShortDebugString();
  EXPECT_NE(info.state(), v1::PENDING);
  // The ticket is still good, but a write now (a client that kept writing
  // after giving up) is refused once the worker has retired the array,
  // which closed the write the coordinator opened for it: it cannot leave a
  // buffer behind that nothing would free.
  // Until the worker's queued free runs, a write may still open and then be
  // refused as "freed while it was written" if the free lands during it:
  // that too is a refusal that leaves nothing behind.
  grpc::Status late;
  for (int i = 0; i < 200 && !absl::StrContains(late.error_message(), "has no open write"); ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    late = WriteShard(w.address(), WriteHeader(w), std::string(64, '\1'));
    if (!late.ok() && !absl::StrContains(late.error_message(), "has no open write")) {
      EXPECT_EQ(late.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << late.error_message();
      EXPECT_TRUE(absl::StrContains(late.error_message(), "freed while it was written"))
          << late.error_message();
    }
  }
  EXPECT_EQ(late.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << late.error_message();
  EXPECT_TRUE(absl::StrContains(late.error_message(), "has no open write")) << late.error_message();
}

// A direct put becomes ready only on its workers' word: each block's worker
// answers a whole write with a receipt signed with its secret, and the
// coordinator checks one per block. A client that says "done" with a block
// unwritten, or shows anything but that worker's receipt for that block,
// gets ABORTED naming the block, and the array is freed, never ready.
TEST_F(DirectTransferTest, ADirectPutIsReadyOnlyWithEachWorkersReceipt) {
  auto channel = grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials());
  auto coordinator = v1::Session::NewStub(channel);
  const std::string data(64, '\7');  // f32[16]
  auto write = [&](const v1::DirectWrite& w, std::string* receipt) {
    return WriteShard(w.address(), WriteHeader(w), data, receipt);
  };
  // One put of f32[16] to device `device`: `act` writes (or not) and says
  // which receipts to show; returns how the coordinator ended the put.
  auto put = [&](uint64_t handle, int device,
                 const std::function<std::vector<std::string>(const v1::DirectWrite&)>& act) {
    grpc::ClientContext ctx;
    auto stream = coordinator->PutDirect(&ctx);
    EXPECT_TRUE(stream->Write(F32x16PutHeader(session_->id(), handle, device)));
    v1::PutDirectResponse plan;
    EXPECT_TRUE(stream->Read(&plan));
    EXPECT_EQ(plan.blocks_size(), 1);
    const std::vector<std::string> receipts =
        plan.blocks_size() == 1 ? act(plan.blocks(0)) : std::vector<std::string>{};
    v1::PutDirectRequest done;
    done.mutable_done()->mutable_receipts()->Add(receipts.begin(), receipts.end());
    stream->Write(done);
    stream->WritesDone();
    while (stream->Read(&plan)) {
    }
    return stream->Finish();
  };
  auto expect_freed = [&](uint64_t handle, const grpc::Status& s, const std::string& says) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), says)) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), absl::StrFormat("put of array %#x", handle)))
        << s.error_message();
    const v1::ArrayInfoResponse info = Info(*coordinator, session_->id(), handle);
    EXPECT_NE(info.state(), v1::READY) << info.ShortDebugString();
    EXPECT_NE(info.state(), v1::PENDING) << info.ShortDebugString();
    EXPECT_TRUE(absl::StrContains(info.error(), "deleted")) << info.ShortDebugString();
  };

  // Nothing written, "done" anyway.
  grpc::Status s =
      put(0x5eed0101, 2, [](const v1::DirectWrite&) { return std::vector<std::string>{}; });
  expect_freed(0x5eed0101, s, "expected a receipt from the worker for each of its 1 blocks, got 0");
  s = put(0x5eed0102, 2, [](const v1::DirectWrite&) { return std::vector<std::string>{""}; });
  expect_freed(0x5eed0102, s, "block 0 (devices [2] at worker");
  // Written, but the client shows its write ticket instead of the receipt.
  s = put(0x5eed0103, 2, [&](const v1::DirectWrite& w) {
    std::string receipt;
    EXPECT_TRUE(write(w, &receipt).ok());
    EXPECT_FALSE(receipt.empty());
    return std::vector<std::string>{w.ticket()};
  });
  expect_freed(0x5eed0103, s, "has no valid receipt from its worker");
  // A real receipt, but for another put's block (another buffer).
  std::string other;
  s = put(0x5eed0104, 2, [&](const v1::DirectWrite& w) {
    EXPECT_TRUE(write(w, &other).ok());
    return std::vector<std::string>{};
  });
  expect_freed(0x5eed0104, s, "got 0");
  s = put(0x5eed0105, 2, [&](const v1::DirectWrite& w) {
    std::string receipt;
    EXPECT_TRUE(write(w, &receipt).ok());
    return std::vector<std::string>{other};
  });
  expect_freed(0x5eed0105, s, "is not signed by worker");
  // A receipt of the same buffer from a worker that did not hold the block:
  // device 0 is on the other worker.
  std::string elsewhere;
  v1::DirectWrite first;
  s = put(0x5eed0106, 0, [&](const v1::DirectWrite& w) {
    first = w;
    EXPECT_TRUE(write(w, &elsewhere).ok());
    return std::vector<std::string>{};
  });
  expect_freed(0x5eed0106, s, "got 0");
  s = put(0x5eed0106, 2, [&](const v1::DirectWrite& w) {
    // The same grant (buffer, type, local devices), from the other worker.
    EXPECT_NE(w.address(), first.address());
    EXPECT_EQ(WrittenGrant(WriteHeader(w)), WrittenGrant(WriteHeader(first)));
    std::string receipt;
    EXPECT_TRUE(write(w, &receipt).ok());
    return std::vector<std::string>{elsewhere};
  });
  expect_freed(0x5eed0106, s, "is not signed by worker");
  // The worker's own receipt: ready, with the bytes written.
  s = put(0x5eed0107, 2, [&](const v1::DirectWrite& w) {
    std::string receipt;
    EXPECT_TRUE(write(w, &receipt).ok());
    return std::vector<std::string>{receipt};
  });
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Info(*coordinator, session_->id(), 0x5eed0107).state(), v1::READY);
  grpc::ClientContext fc;
  v1::FetchRequest fr;
  fr.set_session_id(session_->id());
  fr.set_handle(0x5eed0107);
  auto reader = coordinator->Fetch(&fc, fr);
  std::string got;
  for (v1::FetchResponse m; reader->Read(&m);) got += m.data();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(got, data);
}

// A cluster of its own, and a session on it moving every array directly.
struct OwnCluster {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Session> session;
};
absl::StatusOr<OwnCluster> StartCluster(LocalCluster::Options o) {
  OwnCluster out;
  TESSEL_ASSIGN_OR_RETURN(out.cluster, LocalCluster::Start(std::move(o)));
  ConnectOptions co;
  co.direct_min_bytes = 0;
  TESSEL_ASSIGN_OR_RETURN(out.session, Session::Connect(out.cluster->address(), co));
  return out;
}

// A worker advertising an address this client cannot reach: puts and
// fetches are relayed, the receipt says why, and the bytes are the same.
TEST(DirectTransferFallback, AnUnreachableWorkerIsReachedThroughTheCoordinator) {
  auto own = StartCluster({.workers = 2, .worker_flags = {"--client_address=127.0.0.1:1"}});
  ASSERT_TRUE(own.ok()) << own.status();
  std::unique_ptr<Session>& s = own->session;
  const HostArray x = Random(DType::kF32, {300, 7}, 13);
  TransferReceipt receipt;
  auto a = s->Put(x, Placement::Sharded(Mesh({{"data", 2}}), Sharding::Split({"data", ""})),
                  {.receipt = &receipt});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(receipt.direct);
  EXPECT_TRUE(absl::StrContains(receipt.relayed_because, "127.0.0.1:1")) << receipt.relayed_because;
  EXPECT_TRUE(absl::StrContains(receipt.relayed_because, "UNAVAILABLE")) << receipt.relayed_because;
  auto info = s->Info(*a);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, ArrayState::kReady);
  // The worker is not tried again for a while.
  auto back = s->Fetch(*a, {.receipt = &receipt});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), Bytes(x));
  EXPECT_FALSE(receipt.direct);
  EXPECT_TRUE(absl::StrContains(receipt.relayed_because, "not retried until"))
      << receipt.relayed_because;
  // A fresh client tries, and fails over, on its own.
  ConnectOptions co;
  co.direct_min_bytes = 0;
  auto fresh = Session::Connect(own->cluster->address(), co);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto c = (*fresh)->Put(x, {}, {.receipt = &receipt});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(absl::StrContains(receipt.relayed_because, "cannot connect"))
      << receipt.relayed_because;
  back = (*fresh)->Fetch(*c, {.receipt = &receipt, .direct = true});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), Bytes(x));
  EXPECT_FALSE(receipt.direct);
  EXPECT_TRUE(absl::StrContains(receipt.relayed_because, "not retried until"))
      << receipt.relayed_because;
}

TEST(DirectTransferFallback, ACoordinatorThatRelaysEverythingGrantsNoDirectTransfer) {
  auto own = StartCluster({.workers = 1, .coordinator_flags = {"--direct_transfers=false"}});
  ASSERT_TRUE(own.ok()) << own.status();
  ExpectRelayedBothWays(*own->session, Random(DType::kF32, {100}, 14), {});
}

}  // namespace
}  // namespace tessel
