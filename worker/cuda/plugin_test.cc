// The CUDA plugin as the worker loads it: the worker binary links no CUDA
// library, and with --device_kind=both it loads libtessel_cuda.so and either
// serves the GPUs or says why there are none (on a machine without a GPU or
// driver: the CUDA runtime's reason, which only the loaded plugin can give).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace {

std::string Shell(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return "popen failed";
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  pclose(p);
  return out;
}

// The binaries under test: $TESSEL_BIN_DIR (scripts/gpu-check.sh on
// binaries built elsewhere), else this build's.
const std::string kBin = [] {
  const char* dir = std::getenv("TESSEL_BIN_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : TESSEL_PLUGIN_DIR);
}();

TEST(CudaPlugin, TheWorkerLinksNoCudaLibrary) {
  const std::string libs = Shell(absl::StrCat("ldd ", kBin, "/tessel-worker"));
  ASSERT_NE(libs.find("libgrpc"), std::string::npos) << libs;  // ldd ran
  for (const char* lib : {"libcudart", "libnvrtc", "libcublas", "libnccl", "libcuda."}) {
    EXPECT_EQ(libs.find(lib), std::string::npos) << lib << " in\n" << libs;
  }
  const std::string plugin = Shell(absl::StrCat("ldd ", kBin, "/libtessel_cuda.so"));
  EXPECT_NE(plugin.find("libnvrtc"), std::string::npos) << plugin;
}

TEST(CudaPlugin, AWorkerAskedForGpusLoadsThePluginAndServesThemOrSaysWhyNot) {
  // Port 1 refuses: the worker gives up registering after finding its devices.
  const std::string log = Shell(absl::StrCat(kBin, "/tessel-worker --device_kind=both --devices=1 ",
                                             "--coordinator=127.0.0.1:1 --register_timeout_s=1"));
  EXPECT_EQ(log.find("cannot load the CUDA plugin"), std::string::npos) << log;
  const bool gpus = log.find(" is GPU 0 (sm_") != std::string::npos;
  const bool none = log.find("no CUDA devices (") != std::string::npos;
  EXPECT_TRUE(gpus || none) << log;
  // A plugin that is not there: --device_kind=cuda refuses to start, naming the file.
  const std::string missing =
      Shell(absl::StrCat(kBin, "/tessel-worker --device_kind=cuda --cuda_plugin=/nonexistent/",
                         "libtessel_cuda.so --coordinator=127.0.0.1:1 --register_timeout_s=1"));
  EXPECT_NE(missing.find("--device_kind=cuda: no CUDA devices (cannot load the CUDA plugin "
                         "/nonexistent/libtessel_cuda.so: "),
            std::string::npos)
      << missing;
}

}  // namespace
