// A test suite that shares one local cluster (real coordinator and worker
// processes on loopback) and gives each test a fresh session. After each
// test, every buffer the workers hold must belong to a live array or an
// open put (Admin.Reconcile).
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "tessel/local_cluster.h"
#include "tessel/session.h"

namespace tessel {

template <int kWorkers, int kDevicesPerWorker>
class ClusterFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    LocalCluster::Options o;
    o.workers = kWorkers;
    o.devices_per_worker = kDevicesPerWorker;
    auto c = LocalCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    auto s = Session::Connect(cluster_->address());
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = std::move(*s);
  }
  void TearDown() override {
    if (session_ == nullptr) return;
    auto r = session_->Reconcile();
    ASSERT_TRUE(r.ok()) << r.status();
    for (const UnownedBuffer& u : r->unowned) {
      ADD_FAILURE() << "after the test, device " << u.device << " holds buffer 0x" << std::hex
                    << u.handle << std::dec << " (" << u.bytes << " bytes) that no array owns";
    }
  }
  static inline LocalCluster* cluster_ = nullptr;
  std::unique_ptr<Session> session_;
};

}  // namespace tessel
