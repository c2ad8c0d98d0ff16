// Direct transfers: reading and writing an array's blocks straight from and
// to the workers that hold them, with the tickets the coordinator granted
// (FetchRequest.direct, PutDirect), instead of through its relay.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tessel/types.h"
#include "tessel/v1/session.pb.h"

namespace tessel {

// The box [start, start + shape) of a row-major array as contiguous runs of
// its bytes, in the box's own row-major order.
class BoxRuns {
 public:
  BoxRuns(int64_t elem_bytes, absl::Span<const int64_t> dims, absl::Span<const int64_t> start,
          absl::Span<const int64_t> shape);
  int64_t run_bytes() const { return run_bytes_; }
  int64_t num_runs() const { return num_runs_; }
  // The byte offset in the array of the next run; call num_runs() times.
  int64_t Next();

 private:
  std::vector<int64_t> start_, shape_, stride_;  // stride_: bytes, per dimension
  int outer_ = 0;                                // dimensions walked run by run: 0..outer_-1
  std::vector<int64_t> index_;                   // over those
  int64_t run_bytes_ = 0, num_runs_ = 1;
};

// Scatters a block's row-major bytes, arriving in pieces of any size, into
// the box [start, start + shape) of a row-major array at `dst`.
class BoxWriter {
 public:
  BoxWriter(uint8_t* dst, int64_t elem_bytes, absl::Span<const int64_t> dims,
            absl::Span<const int64_t> start, absl::Span<const int64_t> shape);
  // False, writing nothing more, once the box is full.
  bool Write(const uint8_t* data, int64_t n);
  bool full() const { return run_ == runs_.num_runs(); }

 private:
  uint8_t* const dst_;
  BoxRuns runs_;
  int64_t run_ = 0, run_off_ = 0, run_base_ = 0;
};

// Channels to workers, one per address, made on first use. A worker that
// could not be reached is not tried again for `retry_after`, twice that
// after a second failure in a row, and so on up to 10 minutes: transfers
// that need it go straight to the relay meanwhile.
class WorkerChannels {
 public:
  WorkerChannels(std::shared_ptr<grpc::ChannelCredentials> creds, grpc::ChannelArguments args,
                 absl::Duration retry_after = absl::Seconds(30))
      : creds_(std::move(creds)), args_(std::move(args)), retry_after_(retry_after) {}
  std::shared_ptr<grpc::Channel> Get(const std::string& address);
  // Why `address` is not to be tried now, or OK.
  absl::Status Usable(const std::string& address, absl::Time now);
  void MarkUnreachable(const std::string& address, const absl::Status& why, absl::Time now);
  void MarkReachable(const std::string& address);

 private:
  struct Failure {
    absl::Time until;
    absl::Status why;
    int in_a_row = 0;
  };
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  const grpc::ChannelArguments args_;
  const absl::Duration retry_after_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Failure> failed_ ABSL_GUARDED_BY(mu_);
};

// Reads every block of `blocks` into `out` (allocated for the whole array),
// one stream per block, all at once. UNAVAILABLE when a worker cannot be
// reached within `connect_timeout`; any error names the block's device and
// address. The caller falls back to the relay on error.
absl::Status ReadDirectBlocks(WorkerChannels& channels, absl::Span<const v1::DirectBlock> blocks,
                              int64_t chunk_bytes, absl::Duration connect_timeout, HostArray* out);

// Writes every block of `blocks` from `array`, one PutShard stream per
// (block, worker), all at once; runs of 64 KiB and more go to gRPC without a
// copy. UNAVAILABLE when a worker cannot be reached within
// `connect_timeout`; any error names the block's devices and address.
// `receipts`: each block's worker's receipt, in order, for the coordinator.
absl::Status WriteDirectBlocks(WorkerChannels& channels, absl::Span<const v1::DirectWrite> blocks,
                               int64_t chunk_bytes, absl::Duration connect_timeout,
                               const HostArray& array, std::vector<std::string>* receipts);

}  // namespace tessel
