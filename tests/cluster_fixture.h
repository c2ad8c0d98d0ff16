// A test suite that shares one local cluster (real coordinator and worker
// processes on loopback) and gives each test a fresh session.
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
  static inline LocalCluster* cluster_ = nullptr;
  std::unique_ptr<Session> session_;
};

}  // namespace tessel
