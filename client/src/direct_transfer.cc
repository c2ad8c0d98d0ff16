#include "client/src/direct_transfer_internal.h"

#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/rpc_status.h"
#include "core/status.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace tessel {

BoxRuns::BoxRuns(int64_t elem_bytes, absl::Span<const int64_t> dims,
                 absl::Span<const int64_t> start, absl::Span<const int64_t> shape)
    : start_(start.begin(), start.end()), shape_(shape.begin(), shape.end()), stride_(dims.size()) {
  const int rank = int(dims.size());
  int64_t s = elem_bytes;
  for (int d = rank - 1; d >= 0; --d) {
    stride_[d] = s;
    s *= dims[d];
  }
  // The innermost dimensions the box spans whole, and the one before them,
  // make one contiguous run; the dimensions before those are walked.
  int k = rank - 1;
  while (k >= 0 && shape_[k] == dims[k]) --k;
  if (k < 0) {
    run_bytes_ = s;
  } else {
    run_bytes_ = shape_[k] * stride_[k];
    outer_ = k;
    for (int d = 0; d < k; ++d) num_runs_ *= shape_[d];
  }
  if (run_bytes_ == 0) num_runs_ = 0;
  index_.assign(outer_, 0);
}

int64_t BoxRuns::Next() {
  int64_t base = 0;
  for (int d = 0; d < outer_; ++d) base += (start_[d] + index_[d]) * stride_[d];
  if (outer_ < int(start_.size())) base += start_[outer_] * stride_[outer_];
  for (int d = outer_ - 1; d >= 0; --d) {
    if (++index_[d] < shape_[d]) break;
    index_[d] = 0;
  }
  return base;
}

BoxWriter::BoxWriter(uint8_t* dst, int64_t elem_bytes, absl::Span<const int64_t> dims,
                     absl::Span<const int64_t> start, absl::Span<const int64_t> shape)
    : dst_(dst), runs_(elem_bytes, dims, start, shape) {
  if (runs_.num_runs() > 0) run_base_ = runs_.Next();
}

bool BoxWriter::Write(const uint8_t* data, int64_t n) {
  while (n > 0) {
    if (full()) return false;
    const int64_t take = std::min(n, runs_.run_bytes() - run_off_);
    std::memcpy(dst_ + run_base_ + run_off_, data, take);
    data += take;
    n -= take;
    run_off_ += take;
    if (run_off_ == runs_.run_bytes()) {
      run_off_ = 0;
      if (++run_ < runs_.num_runs()) run_base_ = runs_.Next();
    }
  }
  return true;
}

std::shared_ptr<grpc::Channel> WorkerChannels::Get(const std::string& address) {
  absl::MutexLock l(&mu_);
  std::shared_ptr<grpc::Channel>& ch = channels_[address];
  if (ch == nullptr) ch = grpc::CreateCustomChannel(address, creds_, args_);
  return ch;
}

absl::Status WorkerChannels::Usable(const std::string& address, absl::Time now) {
  absl::MutexLock l(&mu_);
  auto it = failed_.find(address);
  if (it == failed_.end() || now >= it->second.until) return absl::OkStatus();
  return absl::Status(
      it->second.why.code(),
      absl::StrCat(it->second.why.message(), " (not retried until ",
                   absl::FormatTime("%H:%M:%S", it->second.until, absl::LocalTimeZone()), ")"));
}

void WorkerChannels::MarkUnreachable(const std::string& address, const absl::Status& why,
                                     absl::Time now) {
  absl::MutexLock l(&mu_);
  Failure& f = failed_[address];
  f.in_a_row = std::min(f.in_a_row + 1, 16);
  f.until = now + std::min(retry_after_ * (1 << (f.in_a_row - 1)), absl::Minutes(10));
  f.why = why;
}

void WorkerChannels::MarkReachable(const std::string& address) {
  absl::MutexLock l(&mu_);
  failed_.erase(address);
}

namespace {

std::string Where(const v1::DirectBlock& b) {
  return absl::StrCat("block of device ", b.global_device(), " at worker ", b.address());
}
std::string Where(const v1::DirectWrite& w) {
  return absl::StrCat("block for device", w.global_devices_size() > 1 ? "s " : " ",
                      absl::StrJoin(w.global_devices(), ","), " at worker ", w.address());
}

// A channel to `address` once connected; UNAVAILABLE, and the worker marked
// unreachable, as soon as a connection attempt fails or when none succeeds
// within `timeout`.
absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect(WorkerChannels& channels,
                                                       const std::string& address,
                                                       const std::string& where,
                                                       absl::Duration timeout) {
  std::shared_ptr<grpc::Channel> ch = channels.Get(address);
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
  absl::Status failed;
  for (grpc_connectivity_state st = ch->GetState(/*try_to_connect=*/true); st != GRPC_CHANNEL_READY;
       st = ch->GetState(true)) {
    if (st == GRPC_CHANNEL_TRANSIENT_FAILURE || st == GRPC_CHANNEL_SHUTDOWN) {
      failed = absl::UnavailableError(absl::StrCat(where, ": cannot connect"));
      break;
    }
    if (!ch->WaitForStateChange(st, deadline)) {
      failed = absl::UnavailableError(
          absl::StrCat(where, ": no connection within ", absl::FormatDuration(timeout)));
      break;
    }
  }
  if (!failed.ok()) {
    channels.MarkUnreachable(address, failed, absl::Now());
    return failed;
  }
  channels.MarkReachable(address);
  return ch;
}

// OK when the box [start, start+shape) lies in `type` and holds `bytes`.
absl::Status CheckBox(const std::string& where,
                      const google::protobuf::RepeatedField<int64_t>& start,
                      const google::protobuf::RepeatedField<int64_t>& shape, int64_t bytes,
                      const ArrayType& type) {
  const int rank = int(type.dims.size());
  int64_t want = DTypeBytes(type.dtype);
  bool fits = start.size() == rank && shape.size() == rank;
  for (int d = 0; fits && d < rank; ++d) {
    fits = start[d] >= 0 && shape[d] >= 0 && start[d] + shape[d] <= type.dims[d];
    want *= shape[d];
  }
  if (fits && want == bytes) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat(
      "%s: box start [%s] shape [%s] (%d bytes) does not fit %s", where, absl::StrJoin(start, ","),
      absl::StrJoin(shape, ","), bytes, type.ToString()));
}

// Runs fn(0..n-1) at once, fn(0) on this thread; the first error.
absl::Status RunAll(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back([&, i] { status[i] = fn(i); });
  if (n > 0) status[0] = fn(0);
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) TESSEL_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Writes the `data` field of one serialized FetchShardResponse to `box`
// straight from gRPC's slices: the bytes are copied once, into place.
// Returns how many bytes it held.
absl::StatusOr<int64_t> WriteResponse(grpc::ByteBuffer& msg, BoxWriter& box,
                                      const v1::DirectBlock& b) {
  const size_t total = msg.Length();
  if (total == 0) return 0;
  std::vector<grpc::Slice> slices;
  if (!msg.Dump(&slices).ok())
    return absl::InternalError(absl::StrCat(Where(b), ": unreadable message"));
  size_t si = 0, off = 0;
  auto next = [&](uint8_t* c) {
    while (si < slices.size() && off == slices[si].size()) {
      ++si;
      off = 0;
    }
    if (si == slices.size()) return false;
    *c = slices[si].begin()[off++];
    return true;
  };
  // Field 1, length-delimited: tag 0x0a, then the length as a varint.
  uint8_t c = 0;
  uint64_t len = 0;
  size_t header = 1;
  bool plain = next(&c) && c == 0x0a;
  for (int shift = 0; plain; shift += 7) {
    plain = shift < 64 && next(&c);
    if (!plain) break;
    ++header;
    len |= uint64_t(c & 0x7f) << shift;
    if ((c & 0x80) == 0) break;
  }
  if (!plain || header + len != total) {
    // Anything else (fields this client does not know): parse it whole.
    v1::FetchShardResponse m;
    if (!grpc::SerializationTraits<v1::FetchShardResponse>::Deserialize(&msg, &m).ok()) {
      return absl::DataLossError(absl::StrCat(Where(b), ": a message that does not parse"));
    }
    if (!box.Write(reinterpret_cast<const uint8_t*>(m.data().data()), m.data().size())) return -1;
    return int64_t(m.data().size());
  }
  for (; si < slices.size(); ++si, off = 0) {
    if (!box.Write(slices[si].begin() + off, slices[si].size() - off)) return -1;
  }
  return int64_t(len);
}

absl::Status ReadBlock(WorkerChannels& channels, const v1::DirectBlock& b, int64_t chunk_bytes,
                       absl::Duration connect_timeout, const ArrayType& type, HostArray* out) {
  TESSEL_RETURN_IF_ERROR(CheckBox(Where(b), b.start(), b.shape(), b.bytes(), type));
  TESSEL_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> ch,
                          Connect(channels, b.address(), Where(b), connect_timeout));
  grpc::ClientContext ctx;
  v1::FetchShardRequest req;
  req.set_device(b.device());
  req.set_buffer(b.buffer());
  req.set_ticket(b.ticket());
  req.set_chunk_bytes(chunk_bytes);
  // tessel.v1.Worker/FetchShard with its replies left serialized, so their
  // bytes go from gRPC's buffers straight into place.
  const grpc::internal::RpcMethod method("/tessel.v1.Worker/FetchShard",
                                         grpc::internal::RpcMethod::SERVER_STREAMING, ch);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(ch.get(), method, &ctx, req));
  BoxWriter box(out->mutable_data(), DTypeBytes(type.dtype), type.dims, b.start(), b.shape());
  grpc::ByteBuffer msg;
  int64_t got = 0;
  while (reader->Read(&msg)) {
    absl::StatusOr<int64_t> n = WriteResponse(msg, box, b);
    if (!n.ok() || *n < 0) {
      ctx.TryCancel();
      (void)reader->Finish();
      return n.ok() ? absl::DataLossError(absl::StrFormat("%s: more than the %d bytes expected",
                                                          Where(b), b.bytes()))
                    : n.status();
    }
    got += *n;
  }
  if (grpc::Status s = reader->Finish(); !s.ok()) {
    return absl::Status(FromGrpc(s).code(), absl::StrCat(Where(b), ": ", s.error_message()));
  }
  if (got != b.bytes()) {
    return absl::DataLossError(
        absl::StrFormat("%s: expected %d bytes, got %d", Where(b), b.bytes(), got));
  }
  return absl::OkStatus();
}

// The framing of a PutShardRequest whose `data` (field 2) holds `n` bytes.
grpc::Slice DataFraming(size_t n) {
  uint8_t head[11];
  size_t len = 0;
  head[len++] = 0x12;
  do {
    head[len++] = uint8_t(n & 0x7f) | (n > 0x7f ? 0x80 : 0);
    n >>= 7;
  } while (n > 0);
  return grpc::Slice(head, len);
}

absl::Status WriteBlock(WorkerChannels& channels, const v1::DirectWrite& w, int64_t chunk_bytes,
                        absl::Duration connect_timeout, const HostArray& array,
                        std::string* receipt) {
  const ArrayType& type = array.type();
  const int64_t elem = DTypeBytes(type.dtype);
  int64_t bytes = elem;
  for (int64_t d : w.shape()) bytes *= d;
  TESSEL_RETURN_IF_ERROR(CheckBox(Where(w), w.start(), w.shape(), bytes, type));
  TESSEL_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> ch,
                          Connect(channels, w.address(), Where(w), connect_timeout));
  grpc::ClientContext ctx;
  v1::PutShardResponse resp;
  // tessel.v1.Worker/PutShard with its messages framed here, so the array's
  // runs go to gRPC where they lie.
  const grpc::internal::RpcMethod method("/tessel.v1.Worker/PutShard",
                                         grpc::internal::RpcMethod::CLIENT_STREAMING, ch);
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(ch.get(), method, &ctx, &resp));
  v1::PutShardRequest header;
  v1::PutShardRequest::Header* h = header.mutable_header();
  h->set_buffer(w.buffer());
  *h->mutable_type() = w.type();
  *h->mutable_devices() = w.devices();
  h->set_ticket(w.ticket());
  grpc::ByteBuffer msg;
  bool own = false;
  bool ok = grpc::SerializationTraits<v1::PutShardRequest>::Serialize(header, &msg, &own).ok() &&
            writer->Write(msg);
  // Each message: the framing, then runs as they lie (64 KiB or more, which
  // live until Finish) or gathered into a buffer gRPC owns (shorter ones).
  constexpr int64_t kInPlace = 64 << 10;
  std::vector<grpc::Slice> parts(1);
  int64_t pending = 0;
  std::string* gather = nullptr;
  auto end_gather = [&] {
    if (gather == nullptr) return;
    parts.emplace_back(
        gather->data(), gather->size(), [](void* p) { delete static_cast<std::string*>(p); },
        gather);
    gather = nullptr;
  };
  auto send = [&] {
    end_gather();
    if (pending == 0) return;
    parts[0] = DataFraming(pending);
    grpc::ByteBuffer m(parts.data(), parts.size());
    ok = ok && writer->Write(m);
    parts.resize(1);
    pending = 0;
  };
  chunk_bytes = std::max<int64_t>(chunk_bytes, 4096);
  BoxRuns runs(elem, type.dims, w.start(), w.shape());
  for (int64_t r = 0; ok && r < runs.num_runs(); ++r) {
    const uint8_t* p = array.data() + runs.Next();
    for (int64_t left = runs.run_bytes(); ok && left > 0;) {
      const int64_t take = std::min(left, chunk_bytes - pending);
      if (take >= kInPlace) {
        end_gather();
        parts.emplace_back(p, take, grpc::Slice::STATIC_SLICE);
      } else {
        if (gather == nullptr) gather = new std::string;
        gather->append(reinterpret_cast<const char*>(p), take);
      }
      p += take;
      left -= take;
      pending += take;
      if (pending == chunk_bytes) send();
    }
  }
  send();
  delete gather;  // only when a write failed mid-message
  if (ok) writer->WritesDone();
  if (grpc::Status s = writer->Finish(); !s.ok()) {
    return absl::Status(FromGrpc(s).code(), absl::StrCat(Where(w), ": ", s.error_message()));
  }
  if (!ok) return absl::UnavailableError(absl::StrCat(Where(w), ": the stream closed early"));
  *receipt = std::move(*resp.mutable_receipt());
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadDirectBlocks(WorkerChannels& channels, absl::Span<const v1::DirectBlock> blocks,
                              int64_t chunk_bytes, absl::Duration connect_timeout, HostArray* out) {
  const ArrayType type = out->type();
  const absl::Time now = absl::Now();
  for (const v1::DirectBlock& b : blocks) TESSEL_RETURN_IF_ERROR(channels.Usable(b.address(), now));
  return RunAll(blocks.size(), [&](size_t i) {
    return ReadBlock(channels, blocks[i], chunk_bytes, connect_timeout, type, out);
  });
}

absl::Status WriteDirectBlocks(WorkerChannels& channels, absl::Span<const v1::DirectWrite> blocks,
                               int64_t chunk_bytes, absl::Duration connect_timeout,
                               const HostArray& array, std::vector<std::string>* receipts) {
  const absl::Time now = absl::Now();
  for (const v1::DirectWrite& w : blocks) TESSEL_RETURN_IF_ERROR(channels.Usable(w.address(), now));
  receipts->assign(blocks.size(), "");
  return RunAll(blocks.size(), [&](size_t i) {
    return WriteBlock(channels, blocks[i], chunk_bytes, connect_timeout, array, &(*receipts)[i]);
  });
}

}  // namespace tessel
