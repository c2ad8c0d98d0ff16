#include "worker/cuda/kernel_compiler.h"

#include <nvrtc.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessel::cuda {
namespace {

constexpr char kMagic[] = "TESSEL-KERNEL-1\n";

uint64_t Fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

KernelCompiler::KernelCompiler(Options options) : options_(std::move(options)) {}

std::string KernelCompiler::NvrtcVersion() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return absl::StrCat(major, ".", minor);
}

std::string KernelCompiler::DefaultCacheDir() {
  if (const char* d = std::getenv("TESSEL_KERNEL_CACHE")) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return absl::StrCat(x, "/tessel/kernels");
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return absl::StrCat(h, "/.cache/tessel/kernels");
  return "";
}

std::string KernelCompiler::Key(const std::string& source) const {
  uint64_t h = 14695981039346656037ull;
  h = Fnv1a(h, options_.arch);
  h = Fnv1a(h, NvrtcVersion());
  h = Fnv1a(h, source);
  return absl::StrFormat("%016x-%s", h, options_.arch);
}

std::shared_ptr<const std::string> KernelCompiler::ReadDisk(const std::string& key,
                                                            const std::string& source) const {
  if (options_.cache_dir.empty()) return nullptr;
  const std::string data = ReadFile(absl::StrCat(options_.cache_dir, "/", key));
  const size_t header = sizeof(kMagic) - 1;
  if (data.size() < header + 8 || data.compare(0, header, kMagic) != 0) return nullptr;
  uint64_t n = 0;
  std::memcpy(&n, data.data() + header, 8);
  if (data.size() < header + 8 + n || data.compare(header + 8, n, source) != 0)
    return nullptr;  // another source
  return std::make_shared<const std::string>(data.substr(header + 8 + n));
}

void KernelCompiler::WriteDisk(const std::string& key, const std::string& source,
                               const std::string& code) const {
  if (options_.cache_dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(options_.cache_dir, ec);
  if (ec) return;  // a cache that cannot be written only costs compile time
  const std::string path = absl::StrCat(options_.cache_dir, "/", key);
  const std::string tmp =
      absl::StrCat(path, ".tmp", getpid(), "-", reinterpret_cast<uintptr_t>(&code));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    const uint64_t n = source.size();
    f.write(kMagic, sizeof(kMagic) - 1);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << source << code;
    if (!f) {
      std::filesystem::remove(tmp, ec);
      return;
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp, ec);
}

absl::StatusOr<std::shared_ptr<const std::string>> KernelCompiler::Compile(
    const std::string& source) {
  const std::string key = Key(source);
  {
    absl::MutexLock l(&mu_);
    auto it = memory_.find(key);
    if (it != memory_.end()) {
      ++stats_.memory_hits;
      return it->second;
    }
  }
  if (auto cached = ReadDisk(key, source)) {
    absl::MutexLock l(&mu_);
    ++stats_.disk_hits;
    memory_[key] = cached;
    return cached;
  }
  nvrtcProgram prog;
  if (nvrtcResult r =
          nvrtcCreateProgram(&prog, source.c_str(), "tessel_kernels.cu", 0, nullptr, nullptr);
      r != NVRTC_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("nvrtc: cannot create a program: ", nvrtcGetErrorString(r)));
  }
  const bool ptx = options_.arch.rfind("compute_", 0) == 0;
  const std::string arch = absl::StrCat("--gpu-architecture=", options_.arch);
  std::vector<const char*> opts = {arch.c_str(), "--std=c++17", "--fmad=true"};
  const nvrtcResult r = nvrtcCompileProgram(prog, int(opts.size()), opts.data());
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 0) nvrtcGetProgramLog(prog, log.data());
  if (r != NVRTC_SUCCESS) {
    nvrtcDestroyProgram(&prog);
    return absl::InvalidArgumentError(absl::StrCat("nvrtc could not compile kernels for ",
                                                   options_.arch, ": ", nvrtcGetErrorString(r),
                                                   "\n", log));
  }
  size_t size = 0;
  auto code = std::make_shared<std::string>();
  nvrtcResult got = ptx ? nvrtcGetPTXSize(prog, &size) : nvrtcGetCUBINSize(prog, &size);
  if (got == NVRTC_SUCCESS) {
    code->resize(size);
    got = ptx ? nvrtcGetPTX(prog, code->data()) : nvrtcGetCUBIN(prog, code->data());
  }
  nvrtcDestroyProgram(&prog);
  if (got != NVRTC_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("nvrtc: cannot read the compiled code: ", nvrtcGetErrorString(got)));
  }
  WriteDisk(key, source, *code);
  absl::MutexLock l(&mu_);
  ++stats_.compiled;
  memory_[key] = code;
  return std::shared_ptr<const std::string>(std::move(code));
}

KernelCompiler::Stats KernelCompiler::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

}  // namespace tessel::cuda
