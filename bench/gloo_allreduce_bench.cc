// tessel-gloo-bench: the baselines for Tessel's all_reduce and reshard. Two
// processes on loopback call Gloo directly, as Tessel's workers do:
//   default     gloo::allreduce, ring, f32 sum, the caller's buffer;
//   --sendrecv  rank 0 sends the bytes to rank 1 (unbound buffers, one
//               send and one receive per call).
// Prints one line per size:
//   gloo_allreduce bytes=N seconds=S busbw_gbps=B   (or gloo_sendrecv ...)
// tessel-bench runs it beside the same transfer through Tessel, in alternating rounds.
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

double Run(int rank, const std::string& dir, size_t bytes, int iters, bool sendrecv) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  ctx->connectFullMesh(store, dev);
  std::vector<float> data(bytes / sizeof(float), 1.0f);
  std::vector<double> times;
  // Warm-up calls (connections past slow start, buffers faulted in) are not timed.
  constexpr int kWarm = 5;
  for (int i = 0; i < iters + kWarm; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (sendrecv) {
      // Each call ends once both sides are done: the receiver acknowledges.
      auto buf = ctx->createUnboundBuffer(data.data(), bytes);
      char ack = 0;
      auto ack_buf = ctx->createUnboundBuffer(&ack, 1);
      if (rank == 0) {
        buf->send(1, 2 * i);
        buf->waitSend();
        ack_buf->recv(1, 2 * i + 1);
        ack_buf->waitRecv();
      } else {
        buf->recv(0, 2 * i);
        buf->waitRecv();
        ack_buf->send(0, 2 * i + 1);
        ack_buf->waitSend();
      }
      if (i >= kWarm)
        times.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      continue;
    }
    gloo::AllreduceOptions opts(ctx);
    opts.setOutput(data.data(), data.size());
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setTag(i);
    gloo::allreduce(opts);
    if (i >= kWarm)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> sizes;
  int iters = 10;
  bool sendrecv = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--iters=", 0) == 0) {
      iters = std::atoi(a.c_str() + 8);
    } else if (a == "--sendrecv") {
      sendrecv = true;
    } else {
      sizes.push_back(std::strtoull(a.c_str(), nullptr, 10));
    }
  }
  if (sizes.empty()) sizes = {1 << 20, 16 << 20, 256 << 20};
  for (size_t bytes : sizes) {
    char tmpl[] = "/tmp/tessel-gloo-bench-XXXXXX";
    const std::string dir = mkdtemp(tmpl);
    const pid_t child = fork();
    if (child == 0) {
      Run(1, dir, bytes, iters, sendrecv);
      _exit(0);
    }
    const double s = Run(0, dir, bytes, iters, sendrecv);
    int status = 0;
    waitpid(child, &status, 0);
    std::printf("gloo_%s bytes=%zu seconds=%.6f busbw_gbps=%.3f\n",
                sendrecv ? "sendrecv" : "allreduce", bytes, s, bytes / s / 1e9);
    std::fflush(stdout);
    std::string rm = "rm -rf " + dir;
    (void)std::system(rm.c_str());
  }
  return 0;
}
