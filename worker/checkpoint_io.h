// CheckpointIO: a worker's side of checkpoints (docs/checkpoints.md). Each
// array of a checkpoint is a zarr v3 array in its own directory: zarr.json,
// and one file per chunk, named by zarr's default key encoding ("c/0/1"),
// holding the chunk's little-endian bytes followed by their CRC32C (zarr's
// "bytes" and "crc32c" codecs). A chunk is one distinct block of the saved
// layout, written by one device that holds it.
//
// Save: a step on the device's queue snapshots its block (WriteChunk) and
// returns; a background thread writes it out and syncs it. On a host-memory
// device the snapshot is the buffer itself, held until written: buffers are
// immutable, and a later step donating the array then writes its output
// into a fresh buffer (copy-on-write). Elsewhere it is a copy into host
// memory. Either way the bytes held for writing are bounded
// (Options::staging_bytes): a step waits for room, and a chunk larger than
// the bound goes alone. Restore: a step reads the chunks its block
// overlaps, verifies each one's CRC32C, and makes the block (ReadBlock).
//
// Every path is absolute, normalized and under Options::root: the
// coordinator names them for its clients, and this process writes there
// with its own rights.
//
// Thread-safety: every public method may be called from any thread. The
// destructor waits for the background writes.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/zarr.h"
#include "spdlog/logger.h"
#include "tessel/v1/worker.pb.h"
#include "worker/device.h"

namespace tessel::worker {

// Copies the box of `sizes` at `from` in a row-major array of `from_dims`
// to the box at `to` in one of `to_dims` (elements of `esize` bytes).
void CopyBox(const char* src, absl::Span<const int64_t> from_dims, absl::Span<const int64_t> from,
             char* dst, absl::Span<const int64_t> to_dims, absl::Span<const int64_t> to,
             absl::Span<const int64_t> sizes, int64_t esize);

class CheckpointIO {
 public:
  struct Options {
    std::string root = "/";
    int64_t staging_bytes = int64_t{1} << 30;
    std::shared_ptr<spdlog::logger> logger;
  };
  explicit CheckpointIO(Options options);
  ~CheckpointIO();
  CheckpointIO(const CheckpointIO&) = delete;
  CheckpointIO& operator=(const CheckpointIO&) = delete;

  // A save step on `device`: snapshots `source` (the block `c.block` of the
  // array) and queues its write; returns once snapshotted.
  absl::Status WriteChunk(const v1::CheckpointChunk& c, Device& device, BufferPtr source);
  // A restore step: the block `c.block` of the array, of `block_type`, read
  // from the chunks it overlaps into a new buffer on `device`.
  absl::StatusOr<BufferPtr> ReadBlock(const v1::CheckpointChunk& c, Device& device,
                                      const v1::TensorType& block_type);
  // The checkpoint's other files (CheckpointFilesRequest).
  absl::StatusOr<v1::CheckpointFilesResponse> Files(const v1::CheckpointFilesRequest& r);

  // Bytes held for writing now, for tests.
  int64_t staged_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    std::string checkpoint, file;
    BufferPtr held;             // a host-memory device's buffer, or null
    std::vector<char> staging;  // otherwise, the copy
    int64_t bytes = 0;
  };
  struct Pending {
    int jobs = 0;
    int64_t bytes_written = 0;
    absl::Status error;
  };
  void WriterLoop();
  absl::Status WriteFile(const Job& job);
  // Waits for `checkpoint`'s writes; their first error, else the bytes written.
  absl::StatusOr<int64_t> Finish(const std::string& checkpoint) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t staged_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;
};

}  // namespace tessel::worker
