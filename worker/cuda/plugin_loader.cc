// Finds and opens libtessel_cuda.so (see plugin.h). Built into every worker;
// needs nothing from CUDA.
#include <dlfcn.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/cuda/plugin.h"

namespace tessel::cuda {
namespace {

absl::Mutex mu(absl::kConstInit);
const PluginApi* loaded ABSL_GUARDED_BY(mu) = nullptr;

}  // namespace

absl::StatusOr<const PluginApi*> LoadPlugin(const std::string& path) {
  absl::MutexLock l(&mu);
  if (loaded != nullptr) return loaded;
  std::string file = path;
  if (file.empty()) {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    const std::filesystem::path beside = self.parent_path() / kPluginFile;
    file = !ec && std::filesystem::exists(beside, ec) ? beside.string() : kPluginFile;
  }
  // RTLD_GLOBAL is not needed: the plugin only takes symbols from the worker.
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("cannot load the CUDA plugin ", file, ": ",
                                                      why != nullptr ? why : "unknown reason"));
  }
  using Entry = const PluginApi* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, kPluginEntry));
  if (entry == nullptr) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA plugin ", file, " has no entry point ", kPluginEntry));
  }
  const PluginApi* api = entry();
  if (api == nullptr || api->abi != kPluginAbi) {
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA plugin ", file, " is from another build: its ABI is ",
                     api == nullptr ? -1 : api->abi, ", this worker's ", kPluginAbi));
  }
  loaded = api;  // never closed: its devices live as long as the process
  return loaded;
}

}  // namespace tessel::cuda
