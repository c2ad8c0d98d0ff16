#include "worker/checkpoint_io.h"

#include <fcntl.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessel::worker {

namespace fs = std::filesystem;
using absl::StrCat;

namespace {

absl::Status Errno(absl::string_view what, const std::string& path) {
  const int e = errno;
  std::string text = StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(text);
  if (e == EACCES || e == EPERM || e == EROFS) return absl::PermissionDeniedError(text);
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(text);
  return absl::InternalError(text);
}

// Writes all of `n` bytes; EINTR and short writes retried.
absl::Status WriteAll(int fd, const char* p, int64_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<int64_t>(n, int64_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    p += w;
    n -= w;
  }
  return absl::OkStatus();
}

// Reads exactly `n` bytes at `offset`, or fails naming the file as torn.
absl::Status ReadAll(int fd, char* p, int64_t n, int64_t offset, const std::string& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<int64_t>(n, int64_t{1} << 30), offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot read", path);
    }
    if (r == 0) return absl::DataLossError(StrCat(path, " ends early: the chunk is torn"));
    p += r;
    n -= r;
    offset += r;
  }
  return absl::OkStatus();
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status SyncDirectory(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY));
  if (fd.get() < 0) return Errno("cannot open directory", dir);
  if (::fsync(fd.get()) != 0) return Errno("cannot sync directory", dir);
  return absl::OkStatus();
}

// Writes `contents` to `path` (its directories made), and syncs it unless told not to.
absl::Status WriteSmallFile(const std::string& path, absl::string_view contents, bool sync = true) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec)
    return absl::PermissionDeniedError(
        StrCat("cannot make the directory of ", path, ": ", ec.message()));
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Errno("cannot create", path);
  TESSEL_RETURN_IF_ERROR(WriteAll(fd.get(), contents.data(), contents.size(), path));
  if (sync && ::fsync(fd.get()) != 0) return Errno("cannot sync", path);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return fs::exists(path) ? absl::PermissionDeniedError(StrCat("cannot read ", path))
                            : absl::NotFoundError(StrCat(path, " does not exist"));
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A relative name inside a checkpoint: no absolute path, no "." or "..".
absl::Status CheckRelative(absl::string_view name) {
  if (name.empty() || name.front() == '/') {
    return absl::InvalidArgumentError(StrCat("file name '", name, "' must be relative"));
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(
          StrCat("file name '", name, "' has a '", part, "' component; expected plain names"));
    }
  }
  return absl::OkStatus();
}

bool IsHostMemory(const Device& device) { return device.kind() == "cpu"; }

// Buffers and file offsets O_DIRECT transfers must be aligned to.
constexpr int64_t kDirectAlign = 4096;

// The parsed zarr.json of an array, checked against what the step expects.
absl::Status CheckZarrJson(const std::string& path, const v1::TensorType& global,
                           absl::Span<const int64_t> chunk_shape) {
  TESSEL_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  google::protobuf::Struct meta;
  if (!google::protobuf::util::JsonStringToMessage(text, &meta).ok()) {
    return absl::DataLossError(StrCat(path, " is not valid JSON"));
  }
  auto ints = [&](const google::protobuf::Value& v) {
    std::vector<int64_t> out;
    for (const auto& x : v.list_value().values()) out.push_back(int64_t(x.number_value()));
    return out;
  };
  const auto& f = meta.fields();
  const std::vector<int64_t> want(global.dims().begin(), global.dims().end());
  const std::vector<int64_t> shape =
      f.contains("shape") ? ints(f.at("shape")) : std::vector<int64_t>{};
  const std::string dtype = f.contains("data_type") ? f.at("data_type").string_value() : "";
  if (shape != want || dtype != ZarrDType(global.dtype())) {
    return absl::InvalidArgumentError(
        StrCat(path, ": the array is ", dtype, "[", absl::StrJoin(shape, ","), "]; expected ",
               ZarrDType(global.dtype()), "[", absl::StrJoin(want, ","), "]"));
  }
  std::vector<int64_t> chunks;
  if (f.contains("chunk_grid")) {
    const auto& grid = f.at("chunk_grid").struct_value().fields();
    if (grid.contains("configuration")) {
      const auto& conf = grid.at("configuration").struct_value().fields();
      if (conf.contains("chunk_shape")) chunks = ints(conf.at("chunk_shape"));
    }
  }
  if (chunks != std::vector<int64_t>(chunk_shape.begin(), chunk_shape.end())) {
    return absl::InvalidArgumentError(StrCat(path, ": chunks of [", absl::StrJoin(chunks, ","),
                                             "]; the restore planned [",
                                             absl::StrJoin(chunk_shape, ","), "]"));
  }
  std::vector<std::string> codecs;
  if (f.contains("codecs")) {
    for (const auto& c : f.at("codecs").list_value().values()) {
      const auto& cf = c.struct_value().fields();
      std::string name = cf.contains("name") ? cf.at("name").string_value() : "";
      if (name == "bytes" && cf.contains("configuration")) {
        const auto& conf = cf.at("configuration").struct_value().fields();
        if (conf.contains("endian")) name += "/" + conf.at("endian").string_value();
      }
      codecs.push_back(name);
    }
  }
  const std::vector<std::string> ours = {"bytes/little", "crc32c"};
  if (codecs != ours &&
      !(DTypeSize(global.dtype()) == 1 && codecs == std::vector<std::string>{"bytes", "crc32c"})) {
    return absl::UnimplementedError(StrCat(path, ": codecs [", absl::StrJoin(codecs, ", "),
                                           "]; Tessel reads [bytes (little-endian), crc32c]"));
  }
  return absl::OkStatus();
}

}  // namespace

void CopyBox(const char* src, absl::Span<const int64_t> from_dims, absl::Span<const int64_t> from,
             char* dst, absl::Span<const int64_t> to_dims, absl::Span<const int64_t> to,
             absl::Span<const int64_t> sizes, int64_t esize) {
  const int rank = sizes.size();
  if (rank == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  for (int64_t s : sizes) {
    if (s == 0) return;
  }
  // Row-major strides in elements.
  std::vector<int64_t> fs(rank, 1), ts(rank, 1);
  for (int d = rank - 2; d >= 0; --d) {
    fs[d] = fs[d + 1] * from_dims[d + 1];
    ts[d] = ts[d + 1] * to_dims[d + 1];
  }
  const int64_t row = sizes[rank - 1] * esize;
  std::vector<int64_t> i(rank, 0);  // the index within the box, last dimension fixed at 0
  while (true) {
    int64_t fo = 0, to_off = 0;
    for (int d = 0; d < rank; ++d) {
      fo += (from[d] + i[d]) * fs[d];
      to_off += (to[d] + i[d]) * ts[d];
    }
    std::memcpy(dst + to_off * esize, src + fo * esize, row);
    int d = rank - 2;
    for (; d >= 0; --d) {
      if (++i[d] < sizes[d]) break;
      i[d] = 0;
    }
    if (d < 0) return;
  }
}

CheckpointIO::CheckpointIO(Options options) : options_(std::move(options)) {
  writer_ = std::thread([this] { WriterLoop(); });
}

CheckpointIO::~CheckpointIO() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  writer_.join();
}

int64_t CheckpointIO::staged_bytes() const {
  absl::MutexLock l(&mu_);
  return staged_;
}

absl::Status CheckpointIO::WriteChunk(const v1::CheckpointChunk& c, Device& device,
                                      BufferPtr source) {
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath(options_.root, c.path()));
  TESSEL_RETURN_IF_ERROR(CheckRelative(c.array_dir()));
  if (c.block().starts_size() != c.global().dims_size() ||
      c.chunk_shape_size() != c.global().dims_size()) {
    return absl::InvalidArgumentError(StrCat("checkpoint ", c.checkpoint(), ": chunk of array ",
                                             c.array_dir(), " has the wrong rank"));
  }
  std::vector<int64_t> index;
  for (int d = 0; d < c.global().dims_size(); ++d) {
    if (c.chunk_shape(d) <= 0 || c.block().starts(d) % c.chunk_shape(d) != 0) {
      return absl::InvalidArgumentError(StrCat("checkpoint ", c.checkpoint(), ": array ",
                                               c.array_dir(), ": block is not on the chunk grid"));
    }
    index.push_back(c.block().starts(d) / c.chunk_shape(d));
  }
  Job job;
  job.checkpoint = c.checkpoint();
  job.file = StrCat(c.path(), "/", c.array_dir(), "/", ChunkKey(index));
  job.bytes = source->size();
  {
    // Room for the snapshot: what waits to be written stays within the
    // bound, and a chunk larger than the bound goes alone.
    absl::MutexLock l(&mu_);
    auto room = [this, &job]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return staged_ == 0 || staged_ + job.bytes <= options_.staging_bytes;
    };
    mu_.Await(absl::Condition(&room));
    staged_ += job.bytes;
    ++pending_[job.checkpoint].jobs;
  }
  if (IsHostMemory(device)) {
    job.held = std::move(source);
  } else {
    job.staging.resize(job.bytes);
    if (absl::Status s = device.CopyToHost(*source, 0, job.staging.data(), job.bytes); !s.ok()) {
      absl::MutexLock l(&mu_);
      staged_ -= job.bytes;
      Pending& p = pending_[job.checkpoint];
      --p.jobs;
      if (p.error.ok()) p.error = s;
      return s;
    }
  }
  absl::MutexLock l(&mu_);
  jobs_.push_back(std::move(job));
  return absl::OkStatus();
}

void CheckpointIO::WriterLoop() {
  // Below the steps' threads: a core they need goes to them first.
  (void)::setpriority(PRIO_PROCESS, ::syscall(SYS_gettid), 10);
  while (true) {
    Job job;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || !jobs_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    absl::Status s = WriteFile(job);
    if (!s.ok() && options_.logger) {
      options_.logger->warn("checkpoint {}: {}", job.checkpoint, s.ToString());
    }
    const int64_t bytes = job.bytes;
    job.held.reset();  // outside the lock: the last owner's free takes the allocator's
    absl::MutexLock l(&mu_);
    staged_ -= bytes;
    Pending& p = pending_[job.checkpoint];
    --p.jobs;
    if (s.ok()) p.bytes_written += bytes;
    if (!s.ok() && p.error.ok()) p.error = s;
  }
}

absl::Status CheckpointIO::WriteFile(const Job& job) {
  const char* data =
      job.held != nullptr ? static_cast<const char*>(job.held->opaque()) : job.staging.data();
  std::error_code ec;
  fs::create_directories(fs::path(job.file).parent_path(), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        StrCat("cannot make the directory of ", job.file, ": ", ec.message()));
  }
  // The aligned bulk goes with O_DIRECT where the filesystem takes it: from
  // the buffer to the disk, without a copy into the page cache (which would
  // take a core, and memory bandwidth, from the steps running meanwhile).
  // The tail and the CRC32C follow through the page cache.
  int64_t direct = reinterpret_cast<uintptr_t>(data) % kDirectAlign == 0 && job.bytes >= (1 << 20)
                       ? job.bytes / kDirectAlign * kDirectAlign
                       : 0;
  if (direct > 0) {
    Fd fd(::open(job.file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644));
    if (fd.get() < 0 && errno != EINVAL) return Errno("cannot create", job.file);
    absl::Status s = fd.get() < 0 ? absl::InvalidArgumentError("no O_DIRECT")
                                  : WriteAll(fd.get(), data, direct, job.file);
    if (!s.ok()) direct = 0;  // not on this filesystem: all of it buffered
  }
  Fd fd(
      ::open(job.file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (direct > 0 ? 0 : O_TRUNC), 0644));
  if (fd.get() < 0) return Errno("cannot create", job.file);
  if (::lseek(fd.get(), direct, SEEK_SET) != direct) return Errno("cannot seek in", job.file);
  TESSEL_RETURN_IF_ERROR(WriteAll(fd.get(), data + direct, job.bytes - direct, job.file));
  const uint32_t crc = Crc32c(data, job.bytes);
  const char le[4] = {char(crc & 0xff), char((crc >> 8) & 0xff), char((crc >> 16) & 0xff),
                      char(crc >> 24)};
  TESSEL_RETURN_IF_ERROR(WriteAll(fd.get(), le, 4, job.file));
  if (::fsync(fd.get()) != 0) return Errno("cannot sync", job.file);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CheckpointIO::Finish(const std::string& checkpoint) {
  absl::MutexLock l(&mu_);
  auto done = [this, &checkpoint]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto it = pending_.find(checkpoint);
    return it == pending_.end() || it->second.jobs == 0;
  };
  mu_.Await(absl::Condition(&done));
  auto it = pending_.find(checkpoint);
  if (it == pending_.end()) return 0;
  Pending p = std::move(it->second);
  pending_.erase(it);
  if (!p.error.ok()) return p.error;
  return p.bytes_written;
}

absl::StatusOr<BufferPtr> CheckpointIO::ReadBlock(const v1::CheckpointChunk& c, Device& device,
                                                  const v1::TensorType& block_type) {
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath(options_.root, c.path()));
  TESSEL_RETURN_IF_ERROR(CheckRelative(c.array_dir()));
  const int rank = c.global().dims_size();
  if (c.chunk_shape_size() != rank || c.block().starts_size() != rank ||
      c.block().sizes_size() != rank || block_type.dims_size() != rank) {
    return absl::InvalidArgumentError(
        StrCat("restore of array ", c.array_dir(), ": the block or chunks have the wrong rank"));
  }
  const std::string array_path = StrCat(c.path(), "/", c.array_dir());
  if (!fs::exists(StrCat(c.path(), "/", kCommitMarker))) {
    return absl::FailedPreconditionError(
        StrCat("checkpoint ", c.path(), " is not complete: it has no commit marker"));
  }
  const std::vector<int64_t> chunk(c.chunk_shape().begin(), c.chunk_shape().end());
  TESSEL_RETURN_IF_ERROR(CheckZarrJson(StrCat(array_path, "/zarr.json"), c.global(), chunk));
  const int64_t esize = DTypeSize(c.global().dtype());
  const int64_t bytes = ByteSizeUnchecked(block_type);
  TESSEL_ASSIGN_OR_RETURN(BufferPtr out, device.Allocate(bytes));
  std::vector<char> host;
  char* block = nullptr;
  if (IsHostMemory(device)) {
    block = static_cast<char*>(out->opaque());
  } else {
    host.resize(bytes);
    block = host.data();
  }
  const std::vector<int64_t> block_start(c.block().starts().begin(), c.block().starts().end());
  const std::vector<int64_t> block_dims(block_type.dims().begin(), block_type.dims().end());
  // Every chunk the block overlaps, in row-major order of their indices.
  std::vector<int64_t> first(rank), last(rank), index(rank);
  for (int d = 0; d < rank; ++d) {
    if (c.block().sizes(d) == 0) return out;
    first[d] = c.block().starts(d) / chunk[d];
    last[d] = (c.block().starts(d) + c.block().sizes(d) - 1) / chunk[d];
    index[d] = first[d];
  }
  std::vector<char> staging;
  while (true) {
    const std::string file = StrCat(array_path, "/", ChunkKey(index));
    // The chunk's box, clipped to the array, and its overlap with the block.
    std::vector<int64_t> chunk_dims(rank), from(rank), to(rank), sizes(rank);
    bool whole = true;
    for (int d = 0; d < rank; ++d) {
      const int64_t lo = index[d] * chunk[d];
      chunk_dims[d] = chunk[d];
      const int64_t a = std::max(lo, c.block().starts(d));
      const int64_t b = std::min(lo + chunk[d], c.block().starts(d) + c.block().sizes(d));
      from[d] = a - lo;
      to[d] = a - c.block().starts(d);
      sizes[d] = b - a;
      whole = whole && sizes[d] == chunk[d];
    }
    int64_t chunk_bytes = esize;
    for (int64_t x : chunk_dims) chunk_bytes *= x;
    Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      absl::Status s = Errno("cannot open chunk", file);
      return absl::Status(s.code(), StrCat("array ", c.array_dir(), ": ", s.message()));
    }
    const off_t size = ::lseek(fd.get(), 0, SEEK_END);
    if (size != chunk_bytes + 4) {
      return absl::DataLossError(StrCat("array ", c.array_dir(), ": chunk ", file, " holds ", size,
                                        " bytes; expected ", chunk_bytes + 4,
                                        " (its data and CRC32C): it is torn"));
    }
    // A block that is the chunk is read in place; otherwise through staging.
    const bool in_place = whole && chunk_dims == block_dims;
    char* dst = in_place ? block : (staging.resize(chunk_bytes), staging.data());
    // The aligned bulk with O_DIRECT where the filesystem takes it (no copy
    // through the page cache, which would also crowd the memory the next
    // buffers are made from); the rest through the page cache.
    int64_t direct =
        reinterpret_cast<uintptr_t>(dst) % kDirectAlign == 0 && chunk_bytes >= (1 << 20)
            ? chunk_bytes / kDirectAlign * kDirectAlign
            : 0;
    if (direct > 0) {
      Fd dfd(::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
      if (dfd.get() < 0 || !ReadAll(dfd.get(), dst, direct, 0, file).ok()) direct = 0;
    }
    TESSEL_RETURN_IF_ERROR(ReadAll(fd.get(), dst + direct, chunk_bytes - direct, direct, file));
    unsigned char le[4];
    TESSEL_RETURN_IF_ERROR(ReadAll(fd.get(), reinterpret_cast<char*>(le), 4, chunk_bytes, file));
    const uint32_t stored = StoredCrc32c(le);
    if (const uint32_t crc = Crc32c(dst, chunk_bytes); crc != stored) {
      return absl::DataLossError(StrCat("array ", c.array_dir(), ": chunk ", file,
                                        " is corrupt: its CRC32C is ", absl::Hex(crc),
                                        ", the stored one ", absl::Hex(stored)));
    }
    if (!in_place) CopyBox(dst, chunk_dims, from, block, block_dims, to, sizes, esize);
    int d = rank - 1;
    for (; d >= 0; --d) {
      if (++index[d] <= last[d]) break;
      index[d] = first[d];
    }
    if (d < 0) break;
  }
  if (!IsHostMemory(device))
    TESSEL_RETURN_IF_ERROR(device.CopyFromHost(*out, 0, host.data(), bytes));
  return out;
}

absl::StatusOr<v1::CheckpointFilesResponse> CheckpointIO::Files(
    const v1::CheckpointFilesRequest& r) {
  using R = v1::CheckpointFilesRequest;
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath(options_.root, r.path()));
  const std::string& path = r.path();
  v1::CheckpointFilesResponse resp;
  std::error_code ec;
  switch (r.action()) {
    case R::PREPARE: {
      if (fs::exists(r.final_path(), ec)) {
        return absl::AlreadyExistsError(StrCat("checkpoint ", r.final_path(), " already exists"));
      }
      fs::create_directories(path, ec);
      if (ec) {
        return absl::PermissionDeniedError(
            StrCat("cannot make checkpoint directory ", path, ": ", ec.message()));
      }
      // Only read back by the other workers now: no need to sync it.
      TESSEL_RETURN_IF_ERROR(WriteSmallFile(StrCat(path, "/", kProbe), r.token(), /*sync=*/false));
      return resp;
    }
    case R::PROBE: {
      auto seen = ReadSmallFile(StrCat(path, "/", kProbe));
      if (!seen.ok() || *seen != r.token()) {
        return absl::FailedPreconditionError(
            StrCat("does not see the checkpoint directory ", path,
                   " that another worker made (the path must be a volume every worker shares)"));
      }
      return resp;
    }
    case R::WRITE:
      for (const auto& f : r.files()) {
        TESSEL_RETURN_IF_ERROR(CheckRelative(f.name()));
        TESSEL_RETURN_IF_ERROR(WriteSmallFile(StrCat(path, "/", f.name()), f.contents()));
      }
      return resp;
    case R::FINISH: {
      TESSEL_ASSIGN_OR_RETURN(int64_t written, Finish(r.checkpoint()));
      resp.set_bytes_written(written);
      return resp;
    }
    case R::COMMIT: {
      TESSEL_RETURN_IF_ERROR(CheckCheckpointPath(options_.root, r.final_path()));
      fs::remove(StrCat(path, "/", kProbe), ec);
      // Every directory the chunks made, then the marker, then the rename.
      for (auto it = fs::recursive_directory_iterator(path, ec);
           !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        if (it->is_directory()) TESSEL_RETURN_IF_ERROR(SyncDirectory(it->path().string()));
      }
      TESSEL_RETURN_IF_ERROR(WriteSmallFile(StrCat(path, "/", kCommitMarker), "committed\n"));
      TESSEL_RETURN_IF_ERROR(SyncDirectory(path));
      if (::rename(path.c_str(), r.final_path().c_str()) != 0) {
        return Errno(StrCat("cannot rename ", path, " to"), r.final_path());
      }
      TESSEL_RETURN_IF_ERROR(SyncDirectory(fs::path(r.final_path()).parent_path().string()));
      return resp;
    }
    case R::READ: {
      if (!fs::exists(path, ec)) {
        return absl::NotFoundError(StrCat("checkpoint ", path, " does not exist"));
      }
      if (!fs::exists(StrCat(path, "/", kCommitMarker), ec)) {
        return absl::FailedPreconditionError(
            StrCat("checkpoint ", path,
                   " is not complete: it has no commit marker (a save still being written, or "
                   "one that failed)"));
      }
      for (const auto& f : r.files()) {
        TESSEL_RETURN_IF_ERROR(CheckRelative(f.name()));
        TESSEL_ASSIGN_OR_RETURN(std::string contents, ReadSmallFile(StrCat(path, "/", f.name())));
        auto* out = resp.add_files();
        out->set_name(f.name());
        out->set_contents(std::move(contents));
      }
      return resp;
    }
    case R::LIST: {
      if (!fs::exists(path, ec)) return resp;
      for (const auto& e : fs::directory_iterator(path, ec)) {
        auto* out = resp.add_listed();
        out->set_name(e.path().filename().string());
        out->set_directory(e.is_directory());
        out->set_committed(e.is_directory() && fs::exists(e.path() / kCommitMarker));
      }
      if (ec) return absl::PermissionDeniedError(StrCat("cannot list ", path, ": ", ec.message()));
      return resp;
    }
    case R::ABANDON: (void)Finish(r.checkpoint()); [[fallthrough]];
    case R::REMOVE: {
      if (!fs::exists(path, ec)) return resp;
      // Only what a save made: a directory holding a manifest, a marker or a probe.
      if (!fs::exists(StrCat(path, "/", kManifest)) &&
          !fs::exists(StrCat(path, "/", kCommitMarker)) && !fs::exists(StrCat(path, "/", kProbe))) {
        return absl::FailedPreconditionError(
            StrCat(path, " is not a Tessel checkpoint (no ", kManifest, "); not removed"));
      }
      // The marker first: a removal cut short leaves no checkpoint that looks whole.
      fs::remove(StrCat(path, "/", kCommitMarker), ec);
      fs::remove_all(path, ec);
      if (ec)
        return absl::PermissionDeniedError(StrCat("cannot remove ", path, ": ", ec.message()));
      return resp;
    }
    default:
      return absl::InvalidArgumentError(StrCat("unknown checkpoint action ", int(r.action())));
  }
}

}  // namespace tessel::worker
