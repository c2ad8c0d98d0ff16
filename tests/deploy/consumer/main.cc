// Starts a local cluster from the installed daemons, runs tanh(x) * 2 + 1
// over a vector split in two, and checks it against a loop here.
#include <cmath>
#include <cstdio>
#include <vector>

#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

int main() {
  auto cluster = tessel::LocalCluster::Start(
      {.workers = 2, .devices_per_worker = 1, .binary_dir = TESSEL_INSTALLED_BIN});
  if (!cluster.ok())
    return std::fprintf(stderr, "cluster: %s\n", cluster.status().ToString().c_str()), 1;
  auto session = tessel::Session::Connect((*cluster)->address());
  if (!session.ok())
    return std::fprintf(stderr, "connect: %s\n", session.status().ToString().c_str()), 1;
  tessel::GraphBuilder g("consumer");
  auto x = g.Parameter({tessel::DType::kF32, {1000}}, "x");
  auto y = g.Add(g.Mul(g.Tanh(x), g.Broadcast(g.Scalar(tessel::DType::kF32, 2), {1000})),
                 g.Broadcast(g.Scalar(tessel::DType::kF32, 1), {1000}));
  auto graph = g.Build({y});
  if (!graph.ok()) return std::fprintf(stderr, "build: %s\n", graph.status().ToString().c_str()), 1;
  auto exe = (*session)->Compile(*graph);
  if (!exe.ok()) return std::fprintf(stderr, "compile: %s\n", exe.status().ToString().c_str()), 1;
  std::vector<float> host(1000);
  for (int i = 0; i < 1000; ++i) host[i] = (i - 500) / 100.0f;
  auto in = (*session)->Put(tessel::HostArray::From<float>({1000}, host));
  if (!in.ok()) return std::fprintf(stderr, "put: %s\n", in.status().ToString().c_str()), 1;
  auto out = (*session)->Execute(*exe, {*in});
  if (!out.ok()) return std::fprintf(stderr, "execute: %s\n", out.status().ToString().c_str()), 1;
  auto result = (*session)->Fetch((*out)[0]);
  if (!result.ok())
    return std::fprintf(stderr, "fetch: %s\n", result.status().ToString().c_str()), 1;
  auto got = result->as<float>();
  if (got.size() != host.size())
    return std::fprintf(stderr, "fetched %zu elements, expected 1000\n", got.size()), 1;
  for (int i = 0; i < 1000; ++i) {
    const float want = std::tanh(host[i]) * 2 + 1;
    if (std::fabs(got[i] - want) > 1e-6f) {
      return std::fprintf(stderr, "element %d: got %.9g, expected %.9g\n", i, got[i], want), 1;
    }
  }
  std::printf(
      "consumer: 1000 elements of tanh(x)*2+1 match on a cluster of the installed daemons\n");
  return 0;
}
