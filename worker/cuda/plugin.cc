// The plugin's entry point: the CUDA devices behind the PluginApi.
#include "worker/cuda/plugin.h"

#include "worker/cuda/cuda_device.h"
#include "worker/cuda/kernel_compiler.h"

namespace tessel::cuda {
namespace {

int Probe(std::string* reason) {
  const CudaProbe p = ProbeCuda();
  if (reason != nullptr) *reason = p.reason;
  return p.count;
}

std::string DefaultKernelCacheDir() { return KernelCompiler::DefaultCacheDir(); }

// The NCCL communicators every CUDA device of this process shares. Never
// destroyed: its watchdog must not be joined while the CUDA runtime is torn
// down at exit.
std::shared_ptr<NcclGroups> SharedNccl(int64_t timeout_ms) {
  static auto* groups = new std::shared_ptr<NcclGroups>(
      std::make_shared<NcclGroups>(NcclGroups::Options{.timeout = absl::Milliseconds(timeout_ms)}));
  return *groups;
}

absl::StatusOr<std::unique_ptr<worker::Device>> CreateDevice(const PluginDeviceOptions& o,
                                                             std::string* arch) {
  auto d = CudaDevice::Create({.local_index = o.local_index,
                               .ordinal = o.ordinal,
                               .memory_limit_bytes = o.memory_limit_bytes,
                               .kernel_cache_dir = o.kernel_cache_dir,
                               .nccl = SharedNccl(o.collective_timeout_ms)});
  if (!d.ok()) return d.status();
  if (arch != nullptr) *arch = (*d)->arch();
  return std::unique_ptr<worker::Device>(std::move(*d));
}

}  // namespace
}  // namespace tessel::cuda

extern "C" __attribute__((visibility("default"))) const tessel::cuda::PluginApi*
tessel_cuda_plugin() {
  static const tessel::cuda::PluginApi api{tessel::cuda::kPluginAbi, &tessel::cuda::Probe,
                                           &tessel::cuda::DefaultKernelCacheDir,
                                           &tessel::cuda::CreateDevice};
  return &api;
}
