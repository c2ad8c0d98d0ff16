// The CUDA backend as a plugin. libtessel_cuda.so holds the CUDA devices and
// everything that needs the CUDA libraries (the CUDA runtime, NVRTC,
// cuBLASLt); a worker loads it only for --device_kind=cuda|both, so a CPU
// worker neither links nor needs them, and a machine without them runs CPU
// workers from the same build.
//
// The plugin is built with the worker and is not a stable ABI: Tessel's own
// code that it calls (the protos, the allocator, the CPU kernels' helpers)
// it finds in the worker binary, which exports it, so there is one copy of
// each and one protobuf descriptor pool. `abi` guards against a plugin from
// another build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/device.h"

namespace tessel::cuda {

inline constexpr int kPluginAbi = 2;
inline constexpr char kPluginEntry[] = "tessel_cuda_plugin";
inline constexpr char kPluginFile[] = "libtessel_cuda.so";

struct PluginDeviceOptions {
  int local_index = 0;             // the device's index within its worker
  int ordinal = 0;                 // CUDA device ordinal
  int64_t memory_limit_bytes = 0;  // 0: 90% of the memory free at start
  std::string kernel_cache_dir;    // NVRTC code cache on disk; empty: memory only
  // Bound on an NCCL call once it has started on the GPU, and on reading a
  // group's unique id. The worker's devices share one set of communicators.
  int64_t collective_timeout_ms = 60000;
};

// What the plugin's entry point (extern "C" kPluginEntry) returns.
struct PluginApi {
  int abi = 0;
  // How many GPUs the CUDA runtime sees; with none, `reason` says why.
  int (*probe)(std::string* reason) = nullptr;
  std::string (*default_kernel_cache_dir)() = nullptr;
  // A device, and in `arch` its architecture ("sm_90").
  absl::StatusOr<std::unique_ptr<worker::Device>> (*create_device)(
      const PluginDeviceOptions& options, std::string* arch) = nullptr;
};

// Loads the plugin from `path`; empty: libtessel_cuda.so beside the running
// binary, else wherever the dynamic loader finds it. A plugin that cannot
// load (no CUDA libraries on this machine, another build's plugin) is an
// error naming the file and the reason. Loaded once per process.
absl::StatusOr<const PluginApi*> LoadPlugin(const std::string& path = "");

}  // namespace tessel::cuda
