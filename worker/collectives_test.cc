// Collectives across simulated workers: one CommunicatorRegistry per
// "worker" (self = "w0", "w1", ...), all meeting through one in-process
// gloo::rendezvous::HashStore, each rank on its own thread.
#include "worker/collectives.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/hash_store.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/half.h"
#include "core/rpc_status.h"
#include "server/kv_store.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "worker/kv_store_client.h"

namespace tessel::worker {
namespace {

using Bytes = std::vector<char>;

const auto& kDTypes = kAllDTypes;
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMax, ReduceOp::kMin};

bool IsFloatType(v1::DType t) {
  return t == v1::F32 || t == v1::F64 || t == v1::F16 || t == v1::BF16;
}

double LoadFloat(v1::DType t, const Bytes& b, int64_t i) {
  switch (t) {
    case v1::F32: return reinterpret_cast<const float*>(b.data())[i];
    case v1::F64: return reinterpret_cast<const double*>(b.data())[i];
    case v1::F16: return ToFloat(reinterpret_cast<const f16*>(b.data())[i]);
    case v1::BF16: return ToFloat(reinterpret_cast<const bf16*>(b.data())[i]);
    default: ADD_FAILURE() << "not a float type"; return 0;
  }
}
void StoreFloat(v1::DType t, Bytes& b, int64_t i, double v) {
  switch (t) {
    case v1::F32: reinterpret_cast<float*>(b.data())[i] = float(v); break;
    case v1::F64: reinterpret_cast<double*>(b.data())[i] = v; break;
    case v1::F16: reinterpret_cast<f16*>(b.data())[i] = F16FromDouble(v); break;
    case v1::BF16: reinterpret_cast<bf16*>(b.data())[i] = Bf16FromDouble(v); break;
    default: ADD_FAILURE() << "not a float type";
  }
}
// Integers and pred as two's complement in 64 bits; storing wraps.
uint64_t LoadInt(v1::DType t, const Bytes& b, int64_t i) {
  switch (t) {
    case v1::S8: return uint64_t(int64_t(reinterpret_cast<const int8_t*>(b.data())[i]));
    case v1::S16: return uint64_t(int64_t(reinterpret_cast<const int16_t*>(b.data())[i]));
    case v1::S32: return uint64_t(int64_t(reinterpret_cast<const int32_t*>(b.data())[i]));
    case v1::S64: return uint64_t(reinterpret_cast<const int64_t*>(b.data())[i]);
    case v1::U16: return reinterpret_cast<const uint16_t*>(b.data())[i];
    case v1::U32: return reinterpret_cast<const uint32_t*>(b.data())[i];
    case v1::U64: return reinterpret_cast<const uint64_t*>(b.data())[i];
    case v1::U8:
    case v1::PRED: return reinterpret_cast<const uint8_t*>(b.data())[i];
    default: ADD_FAILURE() << "not an integer type"; return 0;
  }
}
void StoreInt(v1::DType t, Bytes& b, int64_t i, uint64_t v) {
  switch (t) {
    case v1::S8: reinterpret_cast<int8_t*>(b.data())[i] = int8_t(uint8_t(v)); break;
    case v1::S16: reinterpret_cast<int16_t*>(b.data())[i] = int16_t(uint16_t(v)); break;
    case v1::S32: reinterpret_cast<int32_t*>(b.data())[i] = int32_t(uint32_t(v)); break;
    case v1::S64: reinterpret_cast<int64_t*>(b.data())[i] = int64_t(v); break;
    case v1::U16: reinterpret_cast<uint16_t*>(b.data())[i] = uint16_t(v); break;
    case v1::U32: reinterpret_cast<uint32_t*>(b.data())[i] = uint32_t(v); break;
    case v1::U64: reinterpret_cast<uint64_t*>(b.data())[i] = v; break;
    case v1::U8:
    case v1::PRED: reinterpret_cast<uint8_t*>(b.data())[i] = uint8_t(v); break;
    default: ADD_FAILURE() << "not an integer type";
  }
}

// Seeded inputs in ranges where the reference stays exact or well bounded.
Bytes MakeInput(v1::DType t, ReduceOp op, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(n * DTypeSize(t));
  for (int64_t i = 0; i < n; ++i) {
    if (t == v1::PRED) {
      StoreInt(t, b, i, rng() % 4 == 0 ? 0 : 1);  // mostly true, so `and` is not always false
    } else if (IsFloatType(t)) {
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      StoreFloat(t, b, i, op == ReduceOp::kProd ? 0.5 + u : 2 * u - 1);
    } else if (op == ReduceOp::kProd) {
      StoreInt(t, b, i, IsSigned(t) ? uint64_t(int64_t(rng() % 7) - 3) : rng() % 4);
    } else {  // unsigned: every bit pattern, so sums wrap and max sees the top bit
      StoreInt(t, b, i, IsSigned(t) ? uint64_t(int64_t(rng() % 2001) - 1000) : rng());
    }
  }
  return b;
}

// The reduction of `inputs` (one per rank), elementwise, into `out`.
Bytes ReferenceReduce(v1::DType t, ReduceOp op, const std::vector<Bytes>& inputs, int64_t n) {
  Bytes out(n * DTypeSize(t));
  for (int64_t i = 0; i < n; ++i) {
    if (t == v1::PRED) {
      const bool any = op == ReduceOp::kSum || op == ReduceOp::kMax;
      bool acc = !any;
      for (const Bytes& in : inputs)
        acc = any ? (acc || LoadInt(t, in, i)) : (acc && LoadInt(t, in, i));
      StoreInt(t, out, i, acc);
    } else if (IsFloatType(t)) {
      double acc = LoadFloat(t, inputs[0], i);
      for (size_t r = 1; r < inputs.size(); ++r) {
        const double v = LoadFloat(t, inputs[r], i);
        switch (op) {
          case ReduceOp::kSum: acc += v; break;
          case ReduceOp::kProd: acc *= v; break;
          case ReduceOp::kMax: acc = std::max(acc, v); break;
          case ReduceOp::kMin: acc = std::min(acc, v); break;
        }
      }
      StoreFloat(t, out, i, acc);
    } else {
      const bool is_signed = IsSigned(t);
      uint64_t acc = LoadInt(t, inputs[0], i);
      for (size_t r = 1; r < inputs.size(); ++r) {
        const uint64_t v = LoadInt(t, inputs[r], i);
        switch (op) {
          case ReduceOp::kSum: acc += v; break;
          case ReduceOp::kProd: acc *= v; break;
          case ReduceOp::kMax:
            acc = is_signed ? uint64_t(std::max(int64_t(acc), int64_t(v))) : std::max(acc, v);
            break;
          case ReduceOp::kMin:
            acc = is_signed ? uint64_t(std::min(int64_t(acc), int64_t(v))) : std::min(acc, v);
            break;
        }
      }
      StoreInt(t, out, i, acc);
    }
  }
  return out;
}

// Exact for integers, pred, max and min; float sums and products within a
// few roundings of the dtype per rank.
void ExpectReduced(v1::DType t, ReduceOp op, const std::vector<Bytes>& inputs, const Bytes& got,
                   const Bytes& want, const std::string& what) {
  const int64_t n = want.size() / DTypeSize(t);
  if (!IsFloatType(t) || op == ReduceOp::kMax || op == ReduceOp::kMin) {
    ASSERT_EQ(got, want) << what;
    return;
  }
  const double eps = t == v1::F64   ? std::ldexp(1.0, -50)
                     : t == v1::F32 ? std::ldexp(1.0, -21)
                     : t == v1::F16 ? std::ldexp(1.0, -9)
                                    : std::ldexp(1.0, -6);
  for (int64_t i = 0; i < n; ++i) {
    double scale = 0;
    for (const Bytes& in : inputs) scale += std::fabs(LoadFloat(t, in, i));
    if (op == ReduceOp::kProd) scale = std::fabs(LoadFloat(t, want, i));
    const double tol = eps * inputs.size() * scale + 1e-300;
    ASSERT_NEAR(LoadFloat(t, got, i), LoadFloat(t, want, i), tol) << what << " element " << i;
  }
}

// Registries for the distinct workers of `rank_workers`, sharing one store.
class SimulatedWorkers {
 public:
  explicit SimulatedWorkers(const std::vector<std::string>& rank_workers,
                            absl::Duration timeout = absl::Seconds(30),
                            std::shared_ptr<gloo::rendezvous::Store> store = nullptr)
      : store_(store != nullptr ? std::move(store)
                                : std::make_shared<gloo::rendezvous::HashStore>()) {
    for (const std::string& w : rank_workers) {
      if (registries_.count(w)) continue;
      CollectivesOptions options;
      options.self = w;
      options.store = store_;
      options.timeout = timeout;
      auto r = NewCommunicatorRegistry(std::move(options));
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) registries_[w] = std::move(*r);
    }
  }

  CommunicatorRegistry& registry(const std::string& worker) { return *registries_.at(worker); }
  void Kill(const std::string& worker) { registries_.erase(worker); }

  // Runs body(rank, communicator) for every rank of `spec` in `ranks` (all by
  // default), each on its own thread, and returns their statuses by rank.
  std::vector<absl::Status> Run(const GroupSpec& spec,
                                const std::function<absl::Status(int, Communicator*)>& body,
                                std::set<int> ranks = {}) {
    const int size = spec.rank_workers.size();
    if (ranks.empty()) {
      for (int r = 0; r < size; ++r) ranks.insert(r);
    }
    std::vector<absl::Status> statuses(size, absl::OkStatus());
    std::vector<std::thread> threads;
    for (int r : ranks) {
      threads.emplace_back([&, r] {
        auto comm = registry(spec.rank_workers[r]).Get(spec);
        statuses[r] = comm.ok() ? body(r, comm->get()) : comm.status();
      });
    }
    for (auto& t : threads) t.join();
    return statuses;
  }

 private:
  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::map<std::string, std::unique_ptr<CommunicatorRegistry>> registries_;
};

void ExpectAllOk(const std::vector<absl::Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r)
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r];
}

struct Layout {
  std::string name;
  std::vector<std::string> rank_workers;
};

class CollectivesLayoutTest : public ::testing::TestWithParam<Layout> {
 protected:
  GroupSpec Spec(const std::string& what) const {
    return GroupSpec{absl::StrCat(GetParam().name, "/", what), GetParam().rank_workers};
  }
  int size() const { return GetParam().rank_workers.size(); }
};

const CollectiveId kId{1, 0};

uint64_t Seed(int test_case, int rank) { return uint64_t(test_case) * 1000 + rank; }

TEST_P(CollectivesLayoutTest, AllReduceEveryDTypeAndOp) {
  SimulatedWorkers workers(GetParam().rank_workers);
  struct Case {
    v1::DType dtype;
    ReduceOp op;
    int64_t count;
  };
  std::vector<Case> cases;
  for (v1::DType t : kDTypes) {
    for (ReduceOp op : kOps) cases.push_back({t, op, 37});
  }
  cases.push_back({v1::F32, ReduceOp::kSum,
                   300'000});  // several Gloo segments (two workers: 2 exchange segments)
  cases.push_back({v1::BF16, ReduceOp::kMax, 1});
  // Two workers exchange blocks of up to 16 MiB in 1 MiB segments: an odd
  // count of 2-byte elements leaves a short last segment; past 16 MiB the
  // block goes through Gloo's ring instead.
  cases.push_back({v1::F16, ReduceOp::kSum, 1'048'577});
  cases.push_back({v1::F32, ReduceOp::kMax, (int64_t{16} << 20) / 4 + 3});
  std::vector<std::vector<Bytes>> results(cases.size(), std::vector<Bytes>(size()));
  ExpectAllOk(workers.Run(Spec("allreduce"), [&](int rank, Communicator* comm) -> absl::Status {
    for (size_t c = 0; c < cases.size(); ++c) {
      Bytes data = MakeInput(cases[c].dtype, cases[c].op, cases[c].count, Seed(c, rank));
      absl::Status s = comm->AllReduce(rank, CollectiveId{1, int(c)}, data.data(), cases[c].count,
                                       cases[c].dtype, cases[c].op);
      if (!s.ok()) return s;
      results[c][rank] = std::move(data);
    }
    return absl::OkStatus();
  }));
  for (size_t c = 0; c < cases.size(); ++c) {
    std::vector<Bytes> inputs;
    for (int r = 0; r < size(); ++r)
      inputs.push_back(MakeInput(cases[c].dtype, cases[c].op, cases[c].count, Seed(c, r)));
    const Bytes want = ReferenceReduce(cases[c].dtype, cases[c].op, inputs, cases[c].count);
    for (int r = 0; r < size(); ++r) {
      ExpectReduced(cases[c].dtype, cases[c].op, inputs, results[c][r], want,
                    absl::StrCat(DTypeName(cases[c].dtype), " op ", int(cases[c].op), " rank ", r));
    }
    // Every rank holds the same bits.
    for (int r = 1; r < size(); ++r)
      EXPECT_EQ(results[c][r], results[c][0]) << DTypeName(cases[c].dtype);
  }
}

TEST_P(CollectivesLayoutTest, ReduceScatterEveryDTypeAndOp) {
  SimulatedWorkers workers(GetParam().rank_workers);
  const int64_t count = 13;
  std::vector<std::pair<v1::DType, ReduceOp>> cases;
  for (v1::DType t : kDTypes) {
    for (ReduceOp op : kOps) cases.push_back({t, op});
  }
  std::vector<std::vector<Bytes>> results(cases.size(), std::vector<Bytes>(size()));
  ExpectAllOk(
      workers.Run(Spec("reduce_scatter"), [&](int rank, Communicator* comm) -> absl::Status {
        for (size_t c = 0; c < cases.size(); ++c) {
          const auto [t, op] = cases[c];
          const Bytes in = MakeInput(t, op, count * size(), Seed(c, rank));
          Bytes out(count * DTypeSize(t));
          absl::Status s = comm->ReduceScatter(rank, CollectiveId{1, int(c)}, in.data(), out.data(),
                                               count, t, op);
          if (!s.ok()) return s;
          results[c][rank] = std::move(out);
        }
        return absl::OkStatus();
      }));
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto [t, op] = cases[c];
    std::vector<Bytes> inputs;
    for (int r = 0; r < size(); ++r) inputs.push_back(MakeInput(t, op, count * size(), Seed(c, r)));
    const Bytes full = ReferenceReduce(t, op, inputs, count * size());
    const int esize = DTypeSize(t);
    for (int r = 0; r < size(); ++r) {
      const Bytes want(full.begin() + r * count * esize, full.begin() + (r + 1) * count * esize);
      std::vector<Bytes> block_inputs;
      for (const Bytes& in : inputs)
        block_inputs.emplace_back(in.begin() + r * count * esize,
                                  in.begin() + (r + 1) * count * esize);
      ExpectReduced(t, op, block_inputs, results[c][r], want,
                    absl::StrCat(DTypeName(t), " op ", int(op), " rank ", r));
    }
  }
}

TEST_P(CollectivesLayoutTest, AllGatherEveryDType) {
  SimulatedWorkers workers(GetParam().rank_workers);
  const int64_t count = 11;
  std::vector<std::vector<Bytes>> results(std::size(kDTypes), std::vector<Bytes>(size()));
  ExpectAllOk(workers.Run(Spec("allgather"), [&](int rank, Communicator* comm) -> absl::Status {
    for (size_t c = 0; c < std::size(kDTypes); ++c) {
      const Bytes in = MakeInput(kDTypes[c], ReduceOp::kSum, count, Seed(c, rank));
      Bytes out(count * size() * DTypeSize(kDTypes[c]));
      absl::Status s =
          comm->AllGather(rank, CollectiveId{1, int(c)}, in.data(), out.data(), count, kDTypes[c]);
      if (!s.ok()) return s;
      results[c][rank] = std::move(out);
    }
    return absl::OkStatus();
  }));
  for (size_t c = 0; c < std::size(kDTypes); ++c) {
    Bytes want;
    for (int r = 0; r < size(); ++r) {
      const Bytes in = MakeInput(kDTypes[c], ReduceOp::kSum, count, Seed(c, r));
      want.insert(want.end(), in.begin(), in.end());
    }
    for (int r = 0; r < size(); ++r)
      EXPECT_EQ(results[c][r], want) << DTypeName(kDTypes[c]) << " rank " << r;
  }
}

TEST_P(CollectivesLayoutTest, AllToAllEveryDType) {
  SimulatedWorkers workers(GetParam().rank_workers);
  const int64_t count = 7;
  std::vector<std::vector<Bytes>> results(std::size(kDTypes), std::vector<Bytes>(size()));
  ExpectAllOk(workers.Run(Spec("alltoall"), [&](int rank, Communicator* comm) -> absl::Status {
    for (size_t c = 0; c < std::size(kDTypes); ++c) {
      const Bytes in = MakeInput(kDTypes[c], ReduceOp::kSum, count * size(), Seed(c, rank));
      Bytes out(in.size());
      absl::Status s =
          comm->AllToAll(rank, CollectiveId{1, int(c)}, in.data(), out.data(), count, kDTypes[c]);
      if (!s.ok()) return s;
      results[c][rank] = std::move(out);
    }
    return absl::OkStatus();
  }));
  for (size_t c = 0; c < std::size(kDTypes); ++c) {
    const size_t block = count * DTypeSize(kDTypes[c]);
    std::vector<Bytes> inputs;
    for (int r = 0; r < size(); ++r)
      inputs.push_back(MakeInput(kDTypes[c], ReduceOp::kSum, count * size(), Seed(c, r)));
    for (int i = 0; i < size(); ++i) {
      Bytes want;  // block j of rank i's output is block i of rank j's input
      for (int j = 0; j < size(); ++j)
        want.insert(want.end(), inputs[j].begin() + i * block, inputs[j].begin() + (i + 1) * block);
      EXPECT_EQ(results[c][i], want) << DTypeName(kDTypes[c]) << " rank " << i;
    }
  }
}

TEST_P(CollectivesLayoutTest, PermuteEveryDType) {
  SimulatedWorkers workers(GetParam().rank_workers);
  const int64_t count = 9;
  const int n = size();
  std::vector<std::vector<std::pair<int, int>>> pair_sets(3);
  for (int r = 0; r < n; ++r) pair_sets[0].push_back({r, (r + 1) % n});  // shift
  for (int r = 0; r < n; ++r) pair_sets[1].push_back({r, n - 1 - r});    // reverse
  pair_sets[2] = {{n - 1, 0}};                                           // the rest get zeros
  struct Case {
    v1::DType dtype;
    int pairs;
  };
  std::vector<Case> cases;
  for (v1::DType t : kDTypes) {
    for (int p = 0; p < 3; ++p) cases.push_back({t, p});
  }
  std::vector<std::vector<Bytes>> results(cases.size(), std::vector<Bytes>(n));
  ExpectAllOk(workers.Run(Spec("permute"), [&](int rank, Communicator* comm) -> absl::Status {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Bytes in = MakeInput(cases[c].dtype, ReduceOp::kSum, count, Seed(c, rank));
      Bytes out(in.size(), char(0x5a));
      absl::Status s = comm->Permute(rank, CollectiveId{1, int(c)}, in.data(), out.data(), count,
                                     cases[c].dtype, pair_sets[cases[c].pairs]);
      if (!s.ok()) return s;
      results[c][rank] = std::move(out);
    }
    return absl::OkStatus();
  }));
  for (size_t c = 0; c < cases.size(); ++c) {
    for (int t = 0; t < n; ++t) {
      Bytes want(count * DTypeSize(cases[c].dtype), 0);
      for (const auto& [s, target] : pair_sets[cases[c].pairs]) {
        if (target == t) want = MakeInput(cases[c].dtype, ReduceOp::kSum, count, Seed(c, s));
      }
      EXPECT_EQ(results[c][t], want)
          << DTypeName(cases[c].dtype) << " pairs " << cases[c].pairs << " rank " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Collectives, CollectivesLayoutTest,
                         ::testing::Values(Layout{"one_worker", {"w0", "w0", "w0", "w0"}},
                                           Layout{"blocked", {"w0", "w0", "w1", "w1"}},
                                           Layout{"interleaved", {"w0", "w1", "w0", "w1"}},
                                           Layout{"one_each", {"w0", "w1"}},
                                           Layout{"uneven", {"w0", "w1", "w1", "w2"}}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return info.param.name;
                         });

TEST(Collectives, GetKeepsOneCommunicatorPerGroup) {
  SimulatedWorkers workers({"w0"});
  const GroupSpec spec{"g", {"w0", "w0", "w0"}};
  std::vector<Communicator*> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      auto c = workers.registry("w0").Get(spec);
      got[i] = c.ok() ? c->get() : nullptr;
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_NE(got[0], nullptr);
  for (Communicator* c : got) EXPECT_EQ(c, got[0]);
  EXPECT_EQ(got[0]->size(), 3);
  EXPECT_EQ(got[0]->local_ranks(), (std::vector<int>{0, 1, 2}));

  auto other = workers.registry("w0").Get(GroupSpec{"g", {"w0", "w0"}});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
}

// An open Gloo device's event loop wakes every 10 ms: a worker opens one
// only when a group spanning workers connects, not for groups of its own
// devices, and not at start.
TEST(Collectives, TheTransportOpensWithTheFirstGroupAcrossWorkers) {
  SimulatedWorkers workers({"w0", "w1"});
  EXPECT_FALSE(workers.registry("w0").transport_open());
  EXPECT_FALSE(workers.registry("w1").transport_open());
  auto sum = [](int rank, Communicator* comm) {
    float x[3] = {1.f + rank, 2.f, 3.f};
    absl::Status s = comm->AllReduce(rank, kId, x, 3, v1::F32, ReduceOp::kSum);
    if (s.ok() && comm->size() == 2 && x[0] != 3.f)
      s = absl::InternalError(absl::StrCat("sum ", x[0], ", not 3"));
    return s;
  };
  ExpectAllOk(workers.Run(GroupSpec{"local", {"w0", "w0"}}, sum));
  EXPECT_FALSE(workers.registry("w0").transport_open());
  ExpectAllOk(workers.Run(GroupSpec{"across", {"w0", "w1"}}, sum));
  EXPECT_TRUE(workers.registry("w0").transport_open());
  EXPECT_TRUE(workers.registry("w1").transport_open());
}

// Gloo itself would walk an unset list for a name that does not resolve (it
// checks getaddrinfo's result against -1 only): the registry refuses the
// name before Gloo sees it.
TEST(Collectives, AHostnameGlooCannotUseFailsTheRegistryAtOnce) {
  CollectivesOptions options;
  options.self = "w0";
  options.store = std::make_shared<gloo::rendezvous::HashStore>();
  options.timeout = absl::Seconds(5);
  options.hostname = "no-such-host.invalid";
  auto r = NewCommunicatorRegistry(std::move(options));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("'no-such-host.invalid': the host name does not resolve"),
            absl::string_view::npos)
      << r.status();
}

TEST(Collectives, GetRejectsAGroupThisWorkerHasNoRankIn) {
  SimulatedWorkers workers({"w0"});
  auto c = workers.registry("w0").Get(GroupSpec{"mesh/7", {"w1", "w2"}});
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* part : {"mesh/7", "w0", "w1, w2"}) {
    EXPECT_NE(c.status().message().find(part), absl::string_view::npos) << c.status();
  }
}

TEST(Collectives, LocalRanksOfOneWorkerSeeOnlyTheirOwnGroup) {
  SimulatedWorkers workers({"w0", "w1"});
  auto c = workers.registry("w1").Get(GroupSpec{"g", {"w0", "w1", "w0", "w1"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->local_ranks(), (std::vector<int>{1, 3}));
  float x = 1;
  absl::Status wrong_rank = (*c)->AllReduce(0, kId, &x, 1, v1::F32, ReduceOp::kSum);
  EXPECT_EQ(wrong_rank.code(), absl::StatusCode::kInvalidArgument) << wrong_rank;
}

TEST(Collectives, MissingLocalRankIsDeadlineExceeded) {
  SimulatedWorkers workers({"w0"}, absl::Seconds(1));
  const GroupSpec spec{"lonely", {"w0", "w0", "w0"}, {10, 11, 12}};
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec,
                              [](int rank, Communicator* comm) {
                                float x = 1;
                                return comm->AllReduce(rank, kId, &x, 1, v1::F32, ReduceOp::kSum);
                              },
                              {0, 1});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  for (int r : {0, 1}) {
    ASSERT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded) << statuses[r];
    EXPECT_NE(statuses[r].message().find("'lonely'"), absl::string_view::npos) << statuses[r];
    // Names the device that stalled, not the ones that waited.
    EXPECT_NE(statuses[r].message().find("device 12 did not arrive"), absl::string_view::npos)
        << statuses[r];
    EXPECT_NE(statuses[r].message().find("execution 1, op 0"), absl::string_view::npos)
        << statuses[r];
  }
  // The late rank gets the same error at once, never another step's data.
  auto late = workers.Run(spec,
                          [](int rank, Communicator* comm) {
                            float x = 1;
                            return comm->AllReduce(rank, kId, &x, 1, v1::F32, ReduceOp::kSum);
                          },
                          {2});
  EXPECT_EQ(late[2].code(), absl::StatusCode::kDeadlineExceeded) << late[2];
  // The group itself is fine: the next collective meets.
  std::vector<float> sums(3);
  ExpectAllOk(workers.Run(spec, [&](int rank, Communicator* comm) {
    sums[rank] = rank + 1;
    return comm->AllReduce(rank, CollectiveId{2, 0}, &sums[rank], 1, v1::F32, ReduceOp::kSum);
  }));
  EXPECT_EQ(sums, (std::vector<float>{6, 6, 6}));
}

TEST(Collectives, MissingWorkerIsDeadlineExceeded) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(1));
  const GroupSpec spec{"across", {"w0", "w1"}, {4, 7}};
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec,
                              [](int rank, Communicator* comm) {
                                float x = 1;
                                return comm->AllReduce(rank, kId, &x, 1, v1::F32, ReduceOp::kSum);
                              },
                              {0});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(statuses[0].code(), absl::StatusCode::kDeadlineExceeded) << statuses[0];
  EXPECT_NE(statuses[0].message().find("'across'"), absl::string_view::npos) << statuses[0];
  EXPECT_NE(statuses[0].message().find("all_reduce"), absl::string_view::npos) << statuses[0];
  // The worker and device that never came, not just the group.
  EXPECT_NE(statuses[0].message().find("worker 'w1' (device 7) never joined the group"),
            absl::string_view::npos)
      << statuses[0];
}

// A peer that gives up on a group just as this worker arrives (it said it
// was here, waited out the join, and left for the group's next epoch) must
// not hold this worker for the whole join timeout: two workers that keep
// missing each other that way would never meet again.
TEST(Collectives, APeerThatGivesUpWhileThisWorkerJoinsReleasesItAtOnce) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(2), store);  // joins wait up to 6 s
  const GroupSpec spec{"late", {"w0", "w1"}, {4, 7}};
  store->set("late/here_0", {'1'});  // w0 was here ...
  std::thread give_up([&] {
    absl::SleepFor(absl::Milliseconds(300));
    store->set("late/abandoned", {'1'});  // ... and gave up while w1 was joining
  });
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec,
                              [](int rank, Communicator* comm) {
                                float x = 1;
                                return comm->AllReduce(rank, kId, &x, 1, v1::F32, ReduceOp::kSum);
                              },
                              {1});
  give_up.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << statuses[1];
  ASSERT_FALSE(statuses[1].ok());
  EXPECT_NE(
      statuses[1].message().find("a peer gave up on this group while this worker was joining it"),
      absl::string_view::npos)
      << statuses[1];
  EXPECT_EQ(statuses[1].message().find("never joined"), absl::string_view::npos) << statuses[1];
}

TEST(Collectives, WorkerMissingAfterConnectingIsDeadlineExceeded) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(1));
  const GroupSpec spec{"across", {"w0", "w1"}, {4, 7}};
  int64_t execution = 1;
  auto body = [&](int rank, Communicator* comm) {
    std::vector<float> x(1000, 1);
    return comm->AllReduce(rank, CollectiveId{execution, 0}, x.data(), x.size(), v1::F32,
                           ReduceOp::kSum);
  };
  ExpectAllOk(workers.Run(spec, body));
  ++execution;
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec, body, {0});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(statuses[0].code(), absl::StatusCode::kDeadlineExceeded) << statuses[0];
  EXPECT_NE(statuses[0].message().find("'across'"), absl::string_view::npos) << statuses[0];
  // Names the worker and the device that did not come.
  EXPECT_NE(statuses[0].message().find("worker 'w1' (device 7)"), absl::string_view::npos)
      << statuses[0];
  EXPECT_TRUE(statuses[0].GetPayload(kGroupBrokenPayload).has_value()) << statuses[0];
  // That group is broken for good; a group of the next epoch meets again.
  ++execution;
  EXPECT_EQ(workers.Run(spec, body, {0})[0].code(), absl::StatusCode::kDeadlineExceeded);
  ++execution;
  ExpectAllOk(workers.Run(GroupSpec{"across@1", {"w0", "w1"}, {4, 7}}, body));
}

TEST(Collectives, WorkerGoneIsUnavailable) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(10));
  const GroupSpec spec{"across", {"w0", "w1"}};
  auto body = [](int rank, Communicator* comm) {
    std::vector<float> x(1000, 1);
    return comm->AllReduce(rank, kId, x.data(), x.size(), v1::F32, ReduceOp::kSum);
  };
  ExpectAllOk(workers.Run(spec, body));
  workers.Kill("w1");  // closes its connections
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec, body, {0});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kUnavailable) << statuses[0];
  EXPECT_NE(statuses[0].message().find("'across'"), absl::string_view::npos) << statuses[0];
}

TEST(Collectives, LocalRanksCallingDifferentCollectivesIsAnError) {
  SimulatedWorkers workers({"w0"}, absl::Seconds(5));
  auto statuses = workers.Run(GroupSpec{"mixed", {"w0", "w0"}}, [](int rank, Communicator* comm) {
    float x[2] = {1, 2};
    return rank == 0 ? comm->AllReduce(rank, kId, x, 2, v1::F32, ReduceOp::kSum)
                     : comm->AllReduce(rank, kId, x, 2, v1::F32, ReduceOp::kMax);
  });
  for (const absl::Status& s : statuses)
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// ---- Identity: ranks meet only under the same CollectiveId ------------------

// The seen failure: one worker, two devices, one all_reduce per step. Step B
// fails on device 0 before its collective, and steps C..F follow pipelined.
// Device 1's collective of B must fail (naming the execution, the op and
// device 0), and C..F must pair with C..F, not with each other's neighbours.
void ExpectFailedStepNeverPoisonsTheNextOnes(const std::vector<std::string>& rank_workers,
                                             int failing_rank) {
  SimulatedWorkers workers(rank_workers, absl::Seconds(10));
  std::vector<int> devices;
  for (size_t r = 0; r < rank_workers.size(); ++r) devices.push_back(int(r) + 20);
  const GroupSpec spec{"steps", rank_workers, devices};
  const int size = rank_workers.size();
  constexpr int kSteps = 6;  // A..F; B (1) fails on `failing_rank`
  std::vector<std::vector<absl::Status>> status(size, std::vector<absl::Status>(kSteps));
  std::vector<std::vector<float>> value(size, std::vector<float>(kSteps));
  const absl::Time start = absl::Now();
  workers.Run(spec, [&](int rank, Communicator* comm) {
    for (int step = 0; step < kSteps; ++step) {
      const CollectiveId id{100 + step, 3};
      value[rank][step] = float(11 * (step + 1) + rank);
      if (step == 1 && rank == failing_rank) {
        status[rank][step] =
            comm->Abandon(rank, id, absl::ResourceExhaustedError("device 20: out of memory"));
      } else {
        status[rank][step] =
            comm->AllReduce(rank, id, &value[rank][step], 1, v1::F32, ReduceOp::kSum);
      }
    }
    return absl::OkStatus();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a peer waited for the abandoned collective";
  for (int rank = 0; rank < size; ++rank) {
    if (rank != failing_rank) {
      const absl::Status& b = status[rank][1];
      EXPECT_EQ(b.code(), absl::StatusCode::kAborted) << b;
      EXPECT_NE(b.message().find("execution 101, op 3"), absl::string_view::npos) << b;
      EXPECT_NE(b.message().find(absl::StrCat("device ", 20 + failing_rank)),
                absl::string_view::npos)
          << b;
      EXPECT_NE(b.message().find("out of memory"), absl::string_view::npos) << b;
    }
    for (int step : {0, 2, 3, 4, 5}) {
      ASSERT_TRUE(status[rank][step].ok())
          << "rank " << rank << " step " << step << ": " << status[rank][step];
      float want = 0;
      for (int r = 0; r < size; ++r) want += float(11 * (step + 1) + r);
      EXPECT_EQ(value[rank][step], want) << "rank " << rank << " step " << step;
    }
  }
}

TEST(CollectiveIdentity, FailedStepNeverPoisonsTheNextOnesInMemory) {
  ExpectFailedStepNeverPoisonsTheNextOnes({"w0", "w0"}, 0);
}

TEST(CollectiveIdentity, FailedStepNeverPoisonsTheNextOnesAcrossWorkers) {
  ExpectFailedStepNeverPoisonsTheNextOnes({"w0", "w1"}, 0);
}

TEST(CollectiveIdentity, FailedStepNeverPoisonsTheNextOnesMixed) {
  ExpectFailedStepNeverPoisonsTheNextOnes({"w0", "w1", "w0", "w1"}, 2);
}

TEST(CollectiveIdentity, DifferentStepsNeverPair) {
  SimulatedWorkers workers({"w0"}, absl::Milliseconds(500));
  const GroupSpec spec{"apart", {"w0", "w0"}, {0, 1}};
  float x[2] = {1, 2};
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    return comm->AllReduce(rank, CollectiveId{rank == 0 ? 5 : 6, 0}, &x[rank], 1, v1::F32,
                           ReduceOp::kSum);
  });
  for (const absl::Status& s : statuses)
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(x[0], 1);
  EXPECT_EQ(x[1], 2);
}

TEST(CollectiveIdentity, WorkersAtDifferentStepsBreakTheGroupInsteadOfPairing) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(5));
  const GroupSpec spec{"skew", {"w0", "w1"}, {0, 1}};
  float x[2] = {1, 2};
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    return comm->AllReduce(rank, CollectiveId{rank == 0 ? 5 : 6, 0}, &x[rank], 1, v1::F32,
                           ReduceOp::kSum);
  });
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("out of step"), absl::string_view::npos) << s;
    EXPECT_TRUE(s.GetPayload(kGroupBrokenPayload).has_value()) << s;
  }
  // An all_reduce moves its data while the headers travel: what landed in
  // the failed steps' own buffers is never read (the steps fail).
}

TEST(CollectiveIdentity, AWorkerCallingSomethingElseFailsTheRoundOnBothAndTheGroupGoesOn) {
  // Worker w0 goes ahead with its all_reduce before the headers are in;
  // w1, at an all_gather under the same id, joins it with a dummy block, so
  // neither waits out the timeout, and both give the same verdict.
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(20));
  const GroupSpec spec{"mixed", {"w0", "w1"}, {0, 1}};
  std::vector<float> x = {1, 2}, gathered(2, -1);
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    if (rank == 0)
      return comm->AllReduce(rank, CollectiveId{3, 1}, &x[0], 1, v1::F32, ReduceOp::kSum);
    return comm->AllGather(rank, CollectiveId{3, 1}, &x[1], gathered.data(), 1, v1::F32);
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("the ranks disagree on the call"), absl::string_view::npos) << s;
    EXPECT_FALSE(s.GetPayload(kGroupBrokenPayload).has_value()) << s;
  }
  EXPECT_EQ(gathered[0], -1);  // the all_gather moved nothing into its output
  // The group goes on: the next collective pairs and sums.
  std::vector<float> y = {10, 32};
  statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    return comm->AllReduce(rank, CollectiveId{4, 0}, &y[rank], 1, v1::F32, ReduceOp::kSum);
  });
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(y[0], 42);
  EXPECT_EQ(y[1], 42);
}

TEST(CollectiveIdentity, AllReducesOfDifferentSizesFailOnBothNamingTheMismatch) {
  // Two workers exchange their blocks while the headers travel. Blocks of
  // different sizes never pass for a result: the worker sent the larger
  // block fails reading it, the other fails when its peer leaves, and both
  // name the mismatch the headers show; neither waits out the timeout.
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(20));
  const GroupSpec spec{"sizes", {"w0", "w1"}, {0, 1}};
  std::vector<float> big((3 << 20) / 4, 1.0f), small(1, 5.0f);
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    if (rank == 0)
      return comm->AllReduce(rank, CollectiveId{5, 0}, big.data(), big.size(), v1::F32,
                             ReduceOp::kSum);
    return comm->AllReduce(rank, CollectiveId{5, 0}, small.data(), 1, v1::F32, ReduceOp::kSum);
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (const absl::Status& s : statuses) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("the ranks disagree on the call"), absl::string_view::npos) << s;
  }
}

TEST(CollectiveIdentity, AMessageLeftFromAnEarlierRoundFailsTheNextInsteadOfFillingIt) {
  // w0 sends two segments (1.2 MB), w1 takes one (1 MiB) and fails the
  // round on the headers' verdict; w0's second segment is still on w1's
  // connection when w1's next round reads it. That round fails naming the
  // workers out of step and breaks the group, which releases w0.
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(20));
  const GroupSpec spec{"leftover", {"w0", "w1"}, {0, 1}};
  std::vector<float> big(300'000, 1.0f), one_mib((1 << 20) / 4, 2.0f), next = {7, 8};
  std::vector<absl::Status> second(2);
  const absl::Time start = absl::Now();
  auto first = workers.Run(spec, [&](int rank, Communicator* comm) {
    std::vector<float>& mine = rank == 0 ? big : one_mib;
    absl::Status s = comm->AllReduce(rank, CollectiveId{5, 0}, mine.data(), mine.size(), v1::F32,
                                     ReduceOp::kSum);
    second[rank] =
        comm->AllReduce(rank, CollectiveId{6, 0}, &next[rank], 1, v1::F32, ReduceOp::kSum);
    return s;
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  for (const absl::Status& s : first) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("the ranks disagree on the call"), absl::string_view::npos) << s;
  }
  for (const absl::Status& s : second) EXPECT_FALSE(s.ok()) << s;
  EXPECT_NE(second[1].message().find("a message of another round"), absl::string_view::npos)
      << second[1];
  EXPECT_NE(second[1].message().find("out of step"), absl::string_view::npos) << second[1];
  EXPECT_TRUE(second[1].GetPayload(kGroupBrokenPayload).has_value()) << second[1];
  EXPECT_EQ(next[1], 8);  // never summed with a stale segment
}

TEST(CollectiveIdentity, AnAbandonedAllReduceAcrossWorkersFailsPromptlyAndTheNextPairs) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(20));
  const GroupSpec spec{"abandon_ar", {"w0", "w1"}, {0, 1}};
  std::vector<float> x(1024, 1.0f);
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    if (rank == 1)
      return comm->Abandon(rank, CollectiveId{7, 0}, absl::ResourceExhaustedError("out of memory"));
    return comm->AllReduce(rank, CollectiveId{7, 0}, x.data(), x.size(), v1::F32, ReduceOp::kSum);
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kAborted) << statuses[0];
  EXPECT_NE(statuses[0].message().find("out of memory"), absl::string_view::npos) << statuses[0];
  std::vector<std::vector<float>> y = {{1, 2}, {30, 40}};
  statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    return comm->AllReduce(rank, CollectiveId{8, 0}, y[rank].data(), 2, v1::F32, ReduceOp::kSum);
  });
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(y[0], (std::vector<float>{31, 42}));
  EXPECT_EQ(y[1], (std::vector<float>{31, 42}));
}

TEST(CollectiveIdentity, AbandonedCollectiveAcrossWorkersMovesNoData) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(5));
  const GroupSpec spec{"abandon", {"w0", "w1"}, {0, 1}};
  std::vector<float> x = {3, 4};
  auto statuses = workers.Run(spec, [&](int rank, Communicator* comm) {
    if (rank == 1)
      return comm->Abandon(rank, CollectiveId{9, 2}, absl::InvalidArgumentError("bad argument"));
    return comm->AllGather(rank, CollectiveId{9, 2}, &x[0], &x[1], 1, v1::F32);
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kAborted) << statuses[0];
  EXPECT_EQ(x[1], 4);  // untouched
}

// The coordinator's end of the rendezvous: KvSet and KvGet over a KvStore,
// as server::RegistryService serves them, on a port-0 server.
class KvOnlyRegistry final : public v1::Registry::Service {
 public:
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest* req,
                     v1::KvSetResponse*) override {
    return ToGrpc(kv_.Set(req->key(), req->value()));
  }
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest* req,
                     v1::KvGetResponse* resp) override {
    auto v = kv_.Get(req->key(), absl::Milliseconds(req->timeout_ms()));
    if (!v.ok()) return ToGrpc(v.status());
    resp->set_value(*v);
    return grpc::Status::OK;
  }

 private:
  server::KvStore kv_;
};

class CollectivesKvStoreClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    auto channel =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = v1::Registry::NewStub(channel);
  }
  void TearDown() override { server_->Shutdown(); }

  std::shared_ptr<KvStoreClient> Client(absl::Duration timeout) {
    return std::make_shared<KvStoreClient>(stub_, KvStoreClient::Options{.timeout = timeout});
  }

  KvOnlyRegistry service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<v1::Registry::StubInterface> stub_;
};

TEST_F(CollectivesKvStoreClientTest, SetGetAndWait) {
  auto store = Client(absl::Seconds(5));
  store->set("k", {'a', '\0', 'b'});
  EXPECT_EQ(store->get("k"), (std::vector<char>{'a', '\0', 'b'}));
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(50));
    store->set("later", {'x'});
  });
  store->wait({"k", "later"}, std::chrono::seconds(5));
  later.join();
  EXPECT_EQ(store->get("later"), std::vector<char>{'x'});
}

TEST_F(CollectivesKvStoreClientTest, MissingKeyThrowsNamingTheKey) {
  auto store = Client(absl::Milliseconds(200));
  try {
    store->get("group/7/1");
    FAIL() << "no exception";
  } catch (const gloo::IoException& e) {
    EXPECT_NE(std::string(e.what()).find("'group/7/1'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("DEADLINE_EXCEEDED"), std::string::npos) << e.what();
  }
  EXPECT_THROW(store->wait({"group/7/1"}, std::chrono::milliseconds(100)), gloo::IoException);
  EXPECT_THROW(store->set(std::string(2000, 'k'), {'v'}), gloo::IoException);
}

TEST_F(CollectivesKvStoreClientTest, WorkersMeetThroughTheCoordinatorStore) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(10), Client(absl::Seconds(10)));
  ExpectAllOk(workers.Run(GroupSpec{"kv", {"w0", "w1", "w0"}}, [](int rank, Communicator* comm) {
    std::vector<int32_t> x(100, rank + 1);
    absl::Status s = comm->AllReduce(rank, kId, x.data(), x.size(), v1::S32, ReduceOp::kSum);
    if (s.ok() && x != std::vector<int32_t>(100, 6)) s = absl::InternalError("wrong sum");
    return s;
  }));
}

TEST_F(CollectivesKvStoreClientTest, MissingWorkerTimesOutThroughTheCoordinatorStore) {
  SimulatedWorkers workers({"w0", "w1"}, absl::Seconds(1), Client(absl::Seconds(1)));
  const absl::Time start = absl::Now();
  auto statuses = workers.Run(GroupSpec{"kv", {"w0", "w1"}},
                              [](int rank, Communicator* comm) {
                                float x = 1;
                                return comm->AllReduce(rank, kId, &x, 1, v1::F32, ReduceOp::kSum);
                              },
                              {0});
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kDeadlineExceeded) << statuses[0];
}

}  // namespace
}  // namespace tessel::worker

namespace tessel::worker {
namespace {

TEST(CollectiveIdentity, ANewEpochDropsTheOldGroupAndRefusesItsStragglers) {
  SimulatedWorkers workers({"w0"});
  CommunicatorRegistry& reg = workers.registry("w0");
  const GroupSpec old_spec{"devices:0,1@00ab.0", {"w0", "w0"}, {0, 1}};
  const GroupSpec new_spec{"devices:0,1@00ab.1", {"w0", "w0"}, {0, 1}};
  const GroupSpec other{"devices:2,3@00ab.0", {"w0", "w0"}, {2, 3}};
  auto held = reg.Get(old_spec);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_TRUE(reg.Get(other).ok());
  std::weak_ptr<Communicator> old_group = *held;
  EXPECT_EQ(reg.num_groups(), 2);
  ASSERT_TRUE(reg.Get(new_spec).ok());
  EXPECT_EQ(reg.num_groups(), 2);  // the old epoch of devices 0,1 went; devices 2,3 stay
  // A step still holding the old group keeps it usable until it lets go.
  float x[2] = {1, 2};
  absl::Status statuses[2];
  std::thread ranks[2];
  for (int rank = 0; rank < 2; ++rank) {
    ranks[rank] = std::thread([&, rank] {
      statuses[rank] =
          (*held)->AllReduce(rank, CollectiveId{1, 0}, &x[rank], 1, v1::F32, ReduceOp::kSum);
    });
  }
  for (auto& t : ranks) t.join();
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(x[0], 3);
  held->reset();
  EXPECT_TRUE(old_group.expired());
  // A straggler of the old epoch is refused, not given a rebuilt group.
  auto stale = reg.Get(old_spec);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.status().message().find("epoch 0 is over (this worker meets in epoch 1 now)"),
            std::string::npos)
      << stale.status();
  // Another coordinator's groups supersede this one's.
  ASSERT_TRUE(reg.Get(GroupSpec{"devices:0,1@77cd.0", {"w0", "w0"}, {0, 1}}).ok());
  EXPECT_EQ(reg.num_groups(), 2);
}

}  // namespace
}  // namespace tessel::worker
