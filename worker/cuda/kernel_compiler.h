// KernelCompiler: CUDA C++ source to device code through NVRTC, cached by
// the source's content in memory and on disk, so that a program loaded
// again (by this worker, or by the next worker process on the machine)
// compiles nothing. NVRTC needs no GPU: compiling runs on any machine.
//
// A disk entry holds the source it was compiled from and is used only when
// that source matches byte for byte; entries are written to a temporary
// file and renamed, so concurrent workers never read a partial one.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tessel::cuda {

class KernelCompiler {
 public:
  struct Options {
    std::string arch = "sm_90";  // sm_XX: CUBIN for that GPU; compute_XX: PTX
    std::string cache_dir;       // Default: empty, memory cache only
  };
  struct Stats {
    int64_t compiled = 0;  // NVRTC runs
    int64_t memory_hits = 0;
    int64_t disk_hits = 0;
  };

  explicit KernelCompiler(Options options);

  // The device code (CUBIN or PTX) of `source`. INVALID_ARGUMENT with
  // NVRTC's log when the source does not compile.
  absl::StatusOr<std::shared_ptr<const std::string>> Compile(const std::string& source);

  Stats stats() const;
  const Options& options() const { return options_; }
  // "13.0": the NVRTC this build links.
  static std::string NvrtcVersion();
  // The default disk cache: $TESSEL_KERNEL_CACHE, else $XDG_CACHE_HOME/tessel/kernels,
  // else ~/.cache/tessel/kernels; empty when none can be named.
  static std::string DefaultCacheDir();

 private:
  std::string Key(const std::string& source) const;
  std::shared_ptr<const std::string> ReadDisk(const std::string& key,
                                              const std::string& source) const;
  void WriteDisk(const std::string& key, const std::string& source, const std::string& code) const;

  const Options options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const std::string>> memory_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::cuda
